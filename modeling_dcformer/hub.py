"""Saving and sharing DCFormer models: what `save_pretrained` and `push_to_hub` add to transformers' own (installed
package only; docs/implementations.md has the call path). A failed upload is one `HubUploadError`."""

import json
import os
import re
import shlex
import shutil
import uuid
from pathlib import Path

from huggingface_hub import HfApi
from huggingface_hub.errors import EntryNotFoundError, RevisionNotFoundError
from transformers import PreTrainedModel
from transformers.dynamic_module_utils import get_relative_import_files
from transformers.utils import logging

from . import atomic_dir
from .evals.lm_eval_results import read_eval_results
from .model_card import card_options, check_repo_id, is_generated_card, is_hub_id, users_readme, write_model_card

logger = logging.get_logger(__name__)

AUTO_MAP = {
    "AutoConfig": "configuration_dcformer.DCFormerConfig",
    "AutoModel": "modeling_dcformer.DCFormerModel",
    "AutoModelForCausalLM": "modeling_dcformer.DCFormerForCausalLM",
}
SAVE_ID_KEY = "save_id"  # config.json's random id of each save: a load that sees it change reads the config again
# Weight files of an earlier save: never carried into a new save (they are what it replaces).
_WEIGHT_FILE = re.compile(
    r"^(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)$"
    r"|^(model\.safetensors|pytorch_model\.bin)\.index\.json$"
)
UPLOAD_KEYS = ("private", "token", "commit_message", "commit_description", "create_pr", "revision",
               "overwrite_model_card")
BLANK_CARD = "This is the model card of a 🤗 transformers model that has been pushed on the Hub."  # transformers'


def remote_code_files() -> list[Path]:  # what `custom_object_save` copies: the model file and its relative imports
    modeling = Path(__file__).with_name("modeling_dcformer.py")
    return list(dict.fromkeys([modeling, *map(Path, get_relative_import_files(modeling))]))


def update_config_file(directory: str | os.PathLike, auto_map: bool = True, save_id: str | None = None) -> None:
    """A saved `config.json` with our `auto_map` (none with `auto_map=False`), `save_id`, and model_type "dcformer"
    for a config saved from a `DCPythiaConfig` (its keys are ours, not the released ones)."""
    config_file = Path(directory) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in {directory}: save the config first")
    config = json.loads(config_file.read_text(encoding="utf-8"))
    others = {k: v for k, v in (config.pop("auto_map", None) or {}).items() if k not in AUTO_MAP}
    if auto_map or others:
        config["auto_map"] = {**others, **AUTO_MAP} if auto_map else others
    if config.get("model_type") == "dcpythia" and "hidden_size" in config:
        config["model_type"] = "dcformer"
    if save_id is not None:
        config[SAVE_ID_KEY] = save_id
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_remote_code(directory: str | os.PathLike) -> None:
    """Copy the remote code into a converter's output `directory` and point `auto_map` at it."""
    update_config_file(directory, auto_map=True)
    for source in remote_code_files():
        shutil.copyfile(source, Path(directory) / source.name)


def finish_directory(model, directory: Path, *, remote_code: bool, card: dict | None) -> None:
    """After transformers' save: `auto_map` (or no code), a new `save_id`, the card (`card`: its options, or None)."""
    if not remote_code:
        for source in remote_code_files():
            (directory / source.name).unlink(missing_ok=True)
    update_config_file(directory, auto_map=remote_code, save_id=uuid.uuid4().hex)
    if card is not None:
        write_model_card(directory, model.config, **card)


def save_pretrained(model, save_directory, *args, remote_code: bool = True, model_card: bool | dict = True,
                    push_to_hub: bool = False, repo_id: str | None = None, **kwargs) -> None:
    """What `DCFormerPreTrainedModel.save_pretrained` does (module docstring; docs/implementations.md)."""
    kwargs.setdefault("save_original_format", False)  # else transformers reverts the released keys' renaming
    push = getattr(model, "_dcformer_push", None)  # inside `push_to_hub`: its options
    if push is not None:
        remote_code, model_card = push["remote_code"], push["card"]
    upload = {key: kwargs.pop(key) for key in UPLOAD_KEYS if key in kwargs}
    target = atomic_dir.resolve(save_directory)  # ".", "..", a symlink: the folder it names; a file: an error
    if push_to_hub:  # a bad id is refused before anything is written
        repo_id = check_repo_id(repo_id or target.name)
    on_this_rank = model.should_save_on_this_rank(args[0] if args else kwargs.get("is_main_process", True))
    card = card_options(model, model_card) if on_this_rank else None  # before the config (it keeps the results)
    if card is not None:
        card.setdefault("model_name", None if push_to_hub or push or card.get("repo_id") else target.name)
        card["repo_id"] = card.get("repo_id") or repo_id
        if push is not None:
            push["card"] = card
        if not card.get("overwrite") and users_readme(target):
            card = None  # the user's README.md stays (carried over into the new save)
    if not on_this_rank or getattr(model, "_tp_size", None) is not None:  # collective: every rank, in place
        PreTrainedModel.save_pretrained(model, save_directory, *args, **kwargs)
        if on_this_rank:
            finish_directory(model, target, remote_code=remote_code, card=card)
        return
    code = {f.name for f in remote_code_files()}
    keep = lambda name: not _WEIGHT_FILE.match(name) and (remote_code or name not in code)  # noqa: E731
    with atomic_dir.replacing(target, keep=keep) as tmp:
        PreTrainedModel.save_pretrained(model, tmp, *args, **kwargs)
        if not (tmp / "config.json").is_file():
            raise OSError(f"saving to {target} wrote no config.json: nothing was changed there")
        finish_directory(model, tmp, remote_code=remote_code, card=card)
    if push_to_hub:  # the directory is complete: a failed upload says so, and how to retry it alone
        try:
            push_folder(target, repo_id, card=None if card is None else (model.config, card), **upload)
        except Exception as err:
            raise HubUploadError.of(err, repo_id, target, upload.get("private")) from None


def push_to_hub(model, repo_id: str, *, remote_code: bool = True, overwrite_model_card: bool = False,
                license: str | None = "apache-2.0", base_model: str | None = None, eval_results=None, **kwargs):
    """transformers' `push_to_hub` (`kwargs`: its options) saving with `remote_code` and a card with `license`,
    `base_model`, `eval_results`; its upload step (`_upload_modified_files`, after it wrote the Hub's card over ours) is
    `upload_pushed` for this call. Returns the `CommitInfo`; a failure is one `HubUploadError`."""
    if eval_results is not None:
        read_eval_results(eval_results)  # malformed results fail before anything is created on the Hub
    check_repo_id(repo_id)
    card = dict(license=license, base_model=base_model, eval_results=eval_results, tags=kwargs.get("tags"))
    model._dcformer_push = dict(remote_code=remote_code, overwrite=overwrite_model_card, card=card)
    model._upload_modified_files = lambda folder, repo_id, *args, **kw: upload_pushed(model, folder, repo_id, **kw)
    try:
        return PreTrainedModel.push_to_hub(model, repo_id, **kwargs)
    except Exception as err:
        raise HubUploadError.of(err, repo_id, private=kwargs.get("private")) from None
    finally:
        del model._dcformer_push, model._upload_modified_files


def upload_pushed(model, folder, repo_id: str, *, files_timestamps=None, **upload_kwargs):
    """The upload step of `push_to_hub`, after transformers wrote the Hub's card (tagged) or a blank one into the
    saved `folder`: DCFormer's card goes back (named after the full `repo_id`) unless the Hub's card is the user's
    (kept, with transformers' tags added) and `overwrite_model_card` is off; then `upload_folder`."""
    push = model._dcformer_push
    readme = Path(folder) / "README.md"
    hubs = readme.read_text(encoding="utf-8") if readme.is_file() else ""
    if push["overwrite"] or is_generated_card(hubs) or BLANK_CARD in hubs:
        write_model_card(folder, model.config, **{**push["card"], "repo_id": repo_id, "overwrite": True})
    else:
        logger.warning(f"{repo_id} has a README.md not generated by modeling_dcformer: kept (tags added)")
    return upload_folder(folder, repo_id, **{**upload_kwargs, "overwrite_model_card": True})


def upload_folder(folder: str | os.PathLike, repo_id: str, *, token: str | bool | None = None,
                  revision: str | None = None, create_pr: bool = False, commit_message: str | None = None,
                  commit_description: str | None = None, overwrite_model_card: bool = False):
    """Upload `folder` to `repo_id` in one commit, keeping a README.md on the Hub that this package did not generate
    (unless `overwrite_model_card`)."""
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
                token: str | bool | None = None, card: tuple | None = None, **upload_kwargs):
    """Publish a saved (or converted) model directory as it is, creating the repository if need be. `card`: (config,
    card options) of the card to write again for the full id where the Hub added a namespace to `repo_id`."""
    full_id = HfApi().create_repo(check_repo_id(repo_id), private=private, token=token, exist_ok=True).repo_id
    if card is not None and full_id != card[1].get("repo_id") and not users_readme(Path(folder)):
        write_model_card(folder, card[0], **{**card[1], "repo_id": full_id})
    return upload_folder(folder, full_id, token=token, **upload_kwargs)


def retry_upload_command(repo_id: str, directory: str | os.PathLike, private: bool | None = False) -> str:
    """The shell command that retries just the upload of the complete `directory`."""
    command = f"hf upload {shlex.quote(repo_id)} {shlex.quote(str(directory))}"
    return command + " --private" if private else command


class HubUploadError(OSError):
    """A failed upload, in one message saying what is saved and how to retry; `cause`: the error behind it (kept here
    instead of chained: the traceback is one message)."""

    cause: BaseException | None = None

    @classmethod
    def of(cls, err: BaseException, repo_id: str, directory=None, private: bool | None = None) -> "HubUploadError":
        failed = (f"the Hugging Face Hub repository {repo_id!r} failed "
                  f"({type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]})")
        retry = f"`model.push_to_hub({repo_id!r})`"
        error = cls(
            f"uploading the model to {failed}; nothing was saved locally. Retry with {retry} once the Hub is "
            "reachable, or save it with save_pretrained(DIR) and upload DIR with `hf upload`" if directory is None else
            f"saved the model to {directory} (complete: it loads with from_pretrained), but uploading it to {failed}. "
            f"Retry the upload alone with `{retry_upload_command(repo_id, directory, private)}`, or with {retry}"
        )
        error.cause = err
        return error


__all__ = ["AUTO_MAP", "HubUploadError", "check_repo_id", "is_hub_id", "push_folder", "push_to_hub",
           "retry_upload_command", "save_pretrained", "upload_folder", "write_model_card", "write_remote_code"]
