"""`dcformer-serve`: `transformers serve`, the same command with the same options, for DCFormer models.

transformers' server loads a model by looking its class up inside transformers
(`getattr(transformers, config.architectures[0])`) whatever `--trust-remote-code` says, so `transformers serve
FOLDER` ends in `AttributeError: module transformers has no attribute DCFormerForCausalLM` for a DCFormer folder.
`dcformer-serve` runs the server in a process where `install()` has

- imported `modeling_dcformer` (the Auto classes know "dcformer") and put `DCFormerForCausalLM` where the server
  looks for it;
- made a chat request (`/v1/chat/completions`, `/v1/responses`) for a tokenizer without a chat template answer 400
  with a message naming the model, where the server fails inside `apply_chat_template` with a 500.

Both changes live in the server's process only: `import modeling_dcformer` leaves transformers as it is. Bad input
found before the server starts (a folder that does not load, a bad `--dtype`) is one line on stderr and exit 2.
"""

import os
import sys

from transformers.utils import logging

logger = logging.get_logger(__name__)

PROGRAM = "dcformer-serve"
SERVING_PACKAGES = (
    "dcformer-serve needs transformers' serving packages (fastapi, uvicorn, pydantic, openai): "
    'pip install "transformers[serving]"'
)
# The architectures a DCFormer config names (`config.architectures[0]`), by the class that loads them
ARCHITECTURES = ("DCFormerForCausalLM",)
# The endpoints whose handler formats the request with the tokenizer's chat template
CHAT_HANDLERS = (
    ("transformers.cli.serving.chat_completion", "ChatCompletionHandler"),
    ("transformers.cli.serving.response", "ResponseHandler"),
)


def require_chat_template(model_id: str, processor, template_kwargs: dict) -> None:
    """Raises fastapi's HTTPException 400 when neither the model's tokenizer (or processor) nor the request
    (`chat_template_kwargs={"chat_template": ...}`) gives a chat template."""
    if getattr(processor, "chat_template", None) or template_kwargs.get("chat_template"):
        return
    from fastapi import HTTPException

    raise HTTPException(
        status_code=400,
        detail=(
            f"{model_id} has no chat template (its tokenizer defines none), so a chat request cannot be formatted: "
            "send the text as a prompt to /v1/completions, or give the tokenizer a chat template "
            "(tokenizer.chat_template = ...; tokenizer.save_pretrained(folder))"
        ),
    )


class ChatTemplateRequired:
    """Mixed into a handler of transformers' server: the model it resolves for a chat request must have a chat
    template (checked after the model is loaded, before the request is formatted)."""

    def _resolve_model(self, body: dict):
        model_id, model, processor = super()._resolve_model(body)
        requested = body.get("chat_template_kwargs")
        requested = requested if isinstance(requested, dict) else {}
        require_chat_template(model_id, processor, {**self.chat_template_kwargs, **requested})
        return model_id, model, processor


def install():
    """Prepares this process for transformers' server (see the module docstring) and returns the `serve` command
    of transformers' command line (a click command: `.main(args=[...], prog_name=...)`)."""
    import importlib

    import transformers
    from transformers.cli.serving.utils import BaseHandler

    import modeling_dcformer

    for name in ARCHITECTURES:
        setattr(transformers, name, getattr(modeling_dcformer, name))
    if not hasattr(BaseHandler, "_resolve_model"):  # another layout of transformers' server
        logger.warning(
            "this transformers' server has no BaseHandler._resolve_model: a chat request for a tokenizer without "
            "a chat template gets the server's own answer"
        )
    else:
        for module_name, class_name in CHAT_HANDLERS:
            module = importlib.import_module(module_name)
            handler = getattr(module, class_name)
            if not issubclass(handler, ChatTemplateRequired):
                setattr(module, class_name, type(class_name, (ChatTemplateRequired, handler), {}))
    from transformers.cli.transformers import app

    return app.commands["serve"]


def one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def missing_folder(model: str | None) -> str | None:
    """The message for a model named by a local path (absolute, `./`, `../`, `~`) that does not exist, which the
    server would take for a Hub repository id; None otherwise."""
    if model is None or not model.startswith(("/", ".", "~")):
        return None
    path = os.path.expanduser(model)
    return None if os.path.exists(path) else f"{model}: no such folder"


def unservable(model: str | None, trust_remote_code: bool) -> str | None:
    """The message for a local folder whose config names no class the server can find (`config.architectures[0]`
    inside transformers, after `install()`), such as a released checkpoint in the authors' layout; None otherwise
    (a config that does not load is the server's to report)."""
    if model is None or not os.path.isdir(os.path.expanduser(model)):
        return None
    import transformers
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(os.path.expanduser(model), trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return None
    names = getattr(config, "architectures", None) or []
    if names and getattr(transformers, names[0], None) is not None:
        return None
    return (
        f"{model}: config.json names no model class the server can load (architectures: {names or None}): it "
        f"serves {', '.join(ARCHITECTURES)} and transformers' own classes; a released DCFormer checkpoint is "
        "converted first (dcformer-convert-released, docs/conversion.md)"
    )


def cli(argv: list[str] | None = None) -> int:
    """The console script `dcformer-serve [MODEL] [OPTIONS]`: the options are `transformers serve`'s
    (`dcformer-serve --help`). Returns the exit status: 0 after the server stops, 2 for bad input."""
    import typer
    from transformers.utils.import_utils import is_serve_available

    argv = sys.argv[1:] if argv is None else list(argv)
    if not is_serve_available():
        print(f"error: {SERVING_PACKAGES}", file=sys.stderr)
        return 2
    command = install()
    params = command.make_context(PROGRAM, list(argv), resilient_parsing=True).params
    model = params.get("force_model")
    if message := missing_folder(model) or unservable(model, bool(params.get("trust_remote_code"))):
        print(f"error: {message}", file=sys.stderr)
        return 2
    try:
        command.main(args=argv, prog_name=PROGRAM)  # usage errors: click's message, exit 2
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    except (OSError, ValueError, typer.BadParameter) as error:  # before the server starts: bad input
        print(f"error: {one_line(error)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli())
