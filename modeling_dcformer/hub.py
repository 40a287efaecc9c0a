"""Saving and sharing DCFormer models: what `save_pretrained` and `push_to_hub` add to transformers' own.

`DCFormerPreTrainedModel.save_pretrained` calls `save_pretrained` here (where this package is installed; a model
loaded as remote code without it saves with transformers' plain `save_pretrained`, which still copies the remote
code and its `auto_map`):
- transformers writes the config and weights, and copies the remote code (`custom_object_save`: the classes are
  registered with `register_for_auto_class`) into a hidden sibling of the destination (`atomic_dir.replacing`),
- `finish_directory` points config.json's `auto_map` at every Auto class (or removes code and `auto_map` with
  `remote_code=False`), names the save (`save_id`: a load that sees the folder replaced meanwhile reads it again)
  and writes the model card (`model_card.py`),
- the sibling takes the destination's place in one step; with `push_to_hub` the complete folder is uploaded.
Uploads that fail raise `HubUploadError`: one message naming the Hub, the repository, the folder and the command
that retries (the cause is kept in `.cause`, not chained into the traceback).

This module, `atomic_dir.py` and `model_card.py` stay in the installed package: a saved model's remote code is only
what computes (config, model, cache, DCMHA interface and its PyTorch backends, load-time checks).
"""

import json
import os
import re
import shlex
import tempfile
import uuid
from pathlib import Path

from transformers.dynamic_module_utils import get_relative_import_files
from transformers.utils import logging

from . import atomic_dir
from .model_card import card_options, write_model_card

logger = logging.get_logger(__name__)

AUTO_MAP = {
    "AutoConfig": "configuration_dcformer.DCFormerConfig",
    "AutoModel": "modeling_dcformer.DCFormerModel",
    "AutoModelForCausalLM": "modeling_dcformer.DCFormerForCausalLM",
}
# config.json's random id of each save: `DCFormerPreTrainedModel.from_pretrained` compares it before and after a load
SAVE_ID_KEY = "save_id"
# Weight files of an earlier save: never carried into a new save (they are what it replaces).
_WEIGHT_FILE = re.compile(
    r"^(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)$"
    r"|^(model\.safetensors|pytorch_model\.bin)\.index\.json$"
)
UPLOAD_KEYS = ("private", "token", "commit_message", "commit_description", "create_pr", "revision",
               "overwrite_model_card")


def remote_code_files() -> list[Path]:
    """`modeling_dcformer.py` and the files it imports relatively, recursively: what transformers'
    `custom_object_save` copies and its dynamic-module loader asks for. A new module imported relatively by the
    model joins the list by itself."""
    modeling = Path(__file__).with_name("modeling_dcformer.py")
    return list(dict.fromkeys([modeling, *map(Path, get_relative_import_files(modeling))]))


def update_config_file(directory: str | os.PathLike, auto_map: bool = True, save_id: str | None = None) -> None:
    """Rewrite the saved `config.json`: `auto_map` pointing at the remote code for AutoConfig, AutoModel and
    AutoModelForCausalLM (with `auto_map=False`: no entry pointing there), model_type "dcformer" for a config saved
    from a `DCPythiaConfig` (its keys are ours, not the released ones "dcpythia" reads), and `save_id`."""
    config_file = Path(directory) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in {directory}: save the config first")
    config = json.loads(config_file.read_text(encoding="utf-8"))
    others = {k: v for k, v in (config.pop("auto_map", None) or {}).items() if k not in AUTO_MAP}
    if auto_map or others:  # without the remote code, no auto_map may point at it
        config["auto_map"] = {**others, **AUTO_MAP} if auto_map else others
    if config.get("model_type") == "dcpythia" and "hidden_size" in config:
        config["model_type"] = "dcformer"
    if save_id is not None:
        config[SAVE_ID_KEY] = save_id
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_remote_code(directory: str | os.PathLike) -> list[str]:
    """Copy the remote code into `directory` (which holds a saved `config.json`, written by a converter) and point
    its `auto_map` at it. Returns the names of the copied files."""
    import shutil

    update_config_file(directory, auto_map=True)
    for source in remote_code_files():
        shutil.copyfile(source, Path(directory) / source.name)
    return [source.name for source in remote_code_files()]


def finish_directory(model, directory: Path, *, remote_code: bool, card: dict | None, users_readme: bool) -> None:
    """After transformers saved `model` into `directory`: the remote code's `auto_map` (or no code with
    `remote_code=False`), a new `save_id`, and the model card (`card`: `write_model_card` options; None, or
    `users_readme` (a README.md this package did not write is there): none)."""
    if not remote_code:
        for source in remote_code_files():
            (directory / source.name).unlink(missing_ok=True)
    update_config_file(directory, auto_map=remote_code, save_id=uuid.uuid4().hex)
    if card is not None and not (users_readme and not card.get("overwrite")):
        write_model_card(directory, model.config, **card)


def _users_readme(folder: Path) -> bool:
    from .model_card import is_generated_card

    readme = folder / "README.md"
    return readme.is_file() and not is_generated_card(readme.read_text(encoding="utf-8", errors="replace"))


def save_pretrained(model, save_directory, *args, remote_code: bool = True, model_card: bool | dict = True,
                    push_to_hub: bool = False, repo_id: str | None = None, **kwargs) -> None:
    """What `DCFormerPreTrainedModel.save_pretrained` does (see the module's docstring and docs/hub.md)."""
    from transformers import PreTrainedModel

    upload = {key: kwargs.pop(key) for key in UPLOAD_KEYS if key in kwargs}
    target = atomic_dir.resolve(save_directory)  # ".", "..", a symlink: the folder it names; a file: an error
    if push_to_hub:  # a bad id is refused before anything is written
        repo_id = check_repo_id(repo_id or target.name)
    on_this_rank = model.should_save_on_this_rank(args[0] if args else kwargs.get("is_main_process", True))
    card = card_options(model, model_card) if on_this_rank else None  # before the config (it keeps the results)
    if card is not None:
        card.setdefault("model_name", None if push_to_hub or card.get("repo_id") else target.name)
        card["repo_id"] = card.get("repo_id") or repo_id
    users_readme = _users_readme(target)
    if not on_this_rank or getattr(model, "_tp_size", None) is not None:  # collective: every rank, in place
        PreTrainedModel.save_pretrained(model, save_directory, *args, **kwargs)
        if on_this_rank:
            finish_directory(model, target, remote_code=remote_code, card=card, users_readme=users_readme)
        return
    code = {f.name for f in remote_code_files()}
    keep = lambda name: not _WEIGHT_FILE.match(name) and (remote_code or name not in code)  # noqa: E731
    with atomic_dir.replacing(target, keep=keep) as tmp:
        PreTrainedModel.save_pretrained(model, tmp, *args, **kwargs)
        if not (tmp / "config.json").is_file():
            raise OSError(f"saving to {target} wrote no config.json: nothing was changed there")
        finish_directory(model, tmp, remote_code=remote_code, card=card, users_readme=users_readme)
    if push_to_hub:
        upload_saved(model, target, repo_id, card, **upload)


def push_to_hub(model, repo_id: str, *, max_shard_size: int | str = "50GB", remote_code: bool = True,
                license: str | None = "apache-2.0", base_model: str | None = None, eval_results=None,
                tags: list[str] | None = None, **upload_kwargs):
    """What `DCFormerPreTrainedModel.push_to_hub` does: save into a temporary folder (weights, config, remote code,
    model card with `license`, `base_model`, `eval_results` and the model's tags plus `tags`) and upload it in one
    commit (`upload_kwargs`: `UPLOAD_KEYS`). Returns the `CommitInfo`; a failure is a `HubUploadError`."""
    if eval_results is not None:
        from .evals.lm_eval_results import read_eval_results

        read_eval_results(eval_results)  # malformed results fail before anything is created on the Hub
    check_repo_id(repo_id)
    private, token = upload_kwargs.pop("private", None), upload_kwargs.get("token")
    try:
        full_id = create_repo(repo_id, private=private, token=token)
    except Exception as err:
        raise HubUploadError.of(err, repo_id, private=private) from None
    card = dict(repo_id=full_id, license=license, base_model=base_model, eval_results=eval_results, tags=tags)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, max_shard_size=max_shard_size, remote_code=remote_code, model_card=card)
        try:
            return upload_folder(tmp, full_id, **upload_kwargs)
        except Exception as err:
            raise HubUploadError.of(err, repo_id, private=private) from None


# ----------------------------------------------------------------------------------------------------------------
# Hub ids and uploads
# ----------------------------------------------------------------------------------------------------------------
def is_hub_id(name) -> bool:
    """Whether `name` reads as a Hub repository id ("name" or "namespace/name") rather than a local path."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not isinstance(name, str) or name.startswith((".", "/", "~")) or os.path.isabs(name):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def check_repo_id(repo_id) -> str:
    """`repo_id` if it is a valid Hub repository id, else a ValueError saying what one looks like."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        if not repo_id:
            raise HFValidationError("it is empty")
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise ValueError(f"{repo_id!r} is not a Hub repository id: use 'name' or 'namespace/name' ({err})") from None
    return repo_id


def create_repo(repo_id: str, *, private: bool | None = None, token: str | bool | None = None) -> str:
    """Create the model repository if it does not exist; returns its full id ("namespace/name")."""
    from huggingface_hub import HfApi

    return HfApi().create_repo(check_repo_id(repo_id), private=private, token=token, exist_ok=True).repo_id


def upload_folder(folder: str | os.PathLike, repo_id: str, *, token: str | bool | None = None,
                  revision: str | None = None, create_pr: bool = False, commit_message: str | None = None,
                  commit_description: str | None = None, overwrite_model_card: bool = False):
    """Upload every file of `folder` to the existing repository `repo_id` in one commit. A README.md already on the
    Hub that this package did not generate is kept (unless `overwrite_model_card`). Returns the `CommitInfo`."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import EntryNotFoundError, RevisionNotFoundError

    from .model_card import is_generated_card

    api = HfApi()
    if revision is not None and not revision.startswith("refs/pr"):
        api.create_branch(repo_id, branch=revision, token=token, exist_ok=True)
    ignore = ["__pycache__/*", "*.pyc"]
    if (Path(folder) / "README.md").is_file() and not overwrite_model_card:
        try:
            path = api.hf_hub_download(repo_id, "README.md", revision=None if create_pr else revision, token=token)
        except (EntryNotFoundError, RevisionNotFoundError):
            path = None
        if path is not None and not is_generated_card(Path(path).read_text(encoding="utf-8", errors="replace")):
            logger.warning(f"{repo_id} has a README.md not generated by modeling_dcformer: kept, ours not uploaded")
            ignore.append("README.md")
    logger.info(f"Uploading {folder} to {repo_id}")
    return api.upload_folder(
        repo_id=repo_id, folder_path=str(folder), commit_message=commit_message or "Upload DCFormer model",
        commit_description=commit_description, token=token, revision=revision, create_pr=create_pr,
        ignore_patterns=ignore,
    )


def push_folder(folder: str | os.PathLike, repo_id: str, *, private: bool | None = None,
                token: str | bool | None = None, **upload_kwargs):
    """`create_repo` then `upload_folder`: publish a saved (or converted) model directory as it is."""
    return upload_folder(folder, create_repo(repo_id, private=private, token=token), token=token, **upload_kwargs)


def retry_upload_command(repo_id: str, directory: str | os.PathLike, private: bool | None = False) -> str:
    """The command that retries just the upload of the complete `directory` to `repo_id` (quoted for a shell)."""
    command = f"hf upload {shlex.quote(repo_id)} {shlex.quote(str(directory))}"
    return command + " --private" if private else command


class HubUploadError(OSError):
    """An upload to the Hub that failed. `cause`: the exception of huggingface_hub (or of the network) behind it,
    kept here instead of being chained, so that the traceback printed is this one message."""

    cause: BaseException | None = None

    @classmethod
    def of(cls, err: BaseException, repo_id: str, directory=None, private: bool | None = None) -> "HubUploadError":
        reason = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        if directory is None:
            message = (f"uploading the model to the Hugging Face Hub repository {repo_id!r} failed ({reason}); "
                       f"nothing was saved locally. Retry with `model.push_to_hub({repo_id!r})` once the Hub is "
                       "reachable, or save it with save_pretrained(DIR) and upload DIR with `hf upload`")
        else:
            message = (f"saved the model to {directory} (complete: it loads with from_pretrained), but uploading it "
                       f"to the Hugging Face Hub repository {repo_id!r} failed ({reason}). Retry the upload alone "
                       f"with `{retry_upload_command(repo_id, directory, private)}`, or with "
                       f"`model.push_to_hub({repo_id!r})`")
        error = cls(message)
        error.cause = err
        return error


def upload_saved(model, directory: Path, repo_id: str, card: dict | None = None, *, private: bool | None = None,
                 token: str | bool | None = None, **upload_kwargs):
    """The upload of `save_pretrained(..., push_to_hub=True)`, once `directory` is complete: `create_repo`, the card
    pointed at the full repository id where the Hub added a namespace, then `upload_folder`. Any failure raises
    `HubUploadError`, saying that the directory is complete and how to retry the upload."""
    try:
        full_id = create_repo(repo_id, private=private, token=token)
        if card is not None and full_id != card.get("repo_id") and not _users_readme(directory):
            write_model_card(directory, model.config, **{**card, "repo_id": full_id})
        return upload_folder(directory, full_id, token=token, **upload_kwargs)
    except Exception as err:
        raise HubUploadError.of(err, repo_id, directory, private) from None


__all__ = ["AUTO_MAP", "HubUploadError", "check_repo_id", "is_hub_id", "push_folder", "push_to_hub",
           "retry_upload_command", "save_pretrained", "upload_folder", "write_model_card", "write_remote_code"]
