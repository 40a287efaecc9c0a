"""What `DCFormerPreTrainedModel.save_pretrained` and `push_to_hub` do where the package is installed
(docs/implementations.md has the call path): the save written beside its folder and swapped in whole, with the
remote code, `auto_map`, a new `save_id` and the model card; the push saved into a temporary folder and uploaded in one
commit (`hub.py`). A failed upload is one `HubUploadError`."""

import json
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path

import transformers.utils.hub as transformers_hub
from huggingface_hub import HfApi
from transformers import PreTrainedModel
from transformers.dynamic_module_utils import get_relative_import_files
from transformers.utils import logging

from ..checkpoint_checks import listing
from ..checkpoints import atomic_dir
from .eval_results import read_eval_results
from .hub import HubUploadError, push_folder, upload_folder
from .model_card import card_options, check_repo_id, has_tokenizer, is_generated_card, users_readme, write_model_card

logger = logging.get_logger(__name__)

AUTO_MAP = {
    "AutoConfig": "configuration_dcformer.DCFormerConfig",
    "AutoModel": "modeling_dcformer.DCFormerModel",
    "AutoModelForCausalLM": "modeling_dcformer.DCFormerForCausalLM",
}
SAVE_ID_KEY = "save_id"  # config.json's random id of each save: a load that sees it change reads the config again
# (the shard index's "metadata" carries it too: the remote code refuses a load mixing two saves, checkpoint_checks.py)
_INDEX_FILE = re.compile(r"^(model\.safetensors|pytorch_model\.bin)\.index(\.[^.]+)?\.json$")
# Weight files of an earlier save: never carried into a new save (they are what it replaces).
_WEIGHT_FILE = re.compile(
    r"^(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)$"
    r"|^(model\.safetensors|pytorch_model\.bin)\.index\.json$"
)
UPLOAD_KEYS = ("private", "token", "commit_message", "commit_description", "create_pr", "revision",
               "overwrite_model_card")
# The start of the card transformers makes for a repository that has none (`create_and_tag_model_card`)
BLANK_CARD = "This is the model card of a 🤗 transformers model that has been pushed on the Hub."


def remote_code_files() -> list[Path]:
    """What a save carries as remote code (transformers' `custom_object_save` copies it): the model file and its
    relative imports, the flat modules of the package."""
    modeling = Path(__file__).parent.parent / "modeling_dcformer.py"
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
        stamp_indexes(directory, save_id)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def stamp_indexes(directory: str | os.PathLike, save_id: str) -> None:
    """The save's `save_id` in the "metadata" of each shard index of `directory` (transformers passes it to the load
    as the index's metadata, so the load can tell a config and shards of two saves apart)."""
    for index_file in Path(directory).iterdir():
        if not _INDEX_FILE.match(index_file.name):
            continue
        index = json.loads(index_file.read_text(encoding="utf-8"))
        if isinstance(index, dict) and isinstance(index.get("metadata"), dict):
            index["metadata"][SAVE_ID_KEY] = save_id
            index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")


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
    save_id = uuid.uuid4().hex
    update_config_file(directory, auto_map=remote_code, save_id=save_id)
    model.config.save_id = save_id  # the config of the model as saved last (a config saved alone there matches it)
    if card is not None:
        write_model_card(directory, model.config, **card)


def repacked_4bit_weights(model) -> list[str]:
    """The modules whose bitsandbytes 4-bit weights its CPU kernels repacked in place at a forward pass (on CPUs with
    AVX-512 bf16, in evaluation mode): bitsandbytes 0.50 turns them back, when a state dict is read, into other
    numbers than it computes with (the block scales were rounded to bf16 and, without double quantization, not
    restored), and the model itself then computes with those."""
    return [name for name, module in model.named_modules()
            if getattr(getattr(getattr(module, "weight", None), "quant_state", None), "packing_format_for_cpu", False)]


def check_not_repacked(model, target) -> None:
    """A 4-bit model repacked by bitsandbytes (`repacked_4bit_weights`) is refused, one line, before its state dict
    is read: a save would write, and leave the model with, weights other than those it ran with."""
    repacked = repacked_4bit_weights(model)
    if repacked:
        raise ValueError(f"cannot save to {target}: bitsandbytes repacked this 4-bit model's weights for its CPU "
                         f"kernels (AVX-512 bf16) at its first forward pass ({listing(repacked)}), and it cannot turn "
                         "them back exactly; save the model before running it, or load it again from its checkpoint "
                         "and save that")


def save_pretrained(model, save_directory, *args, remote_code: bool = True, model_card: bool | dict = True,
                    push_to_hub: bool = False, repo_id: str | None = None, **kwargs) -> None:
    """What `DCFormerPreTrainedModel.save_pretrained` does (module docstring; docs/implementations.md)."""
    kwargs.setdefault("save_original_format", False)  # else transformers reverts the released keys' renaming
    upload = {key: kwargs.pop(key) for key in UPLOAD_KEYS if key in kwargs}
    target = atomic_dir.resolve(save_directory)  # ".", "..", a symlink: the folder it names; a file: an error
    check_not_repacked(model, target)  # before anything reads the state dict
    if push_to_hub:  # a bad id is refused before anything is written
        repo_id = check_repo_id(repo_id or target.name)
    on_this_rank = model.should_save_on_this_rank(args[0] if args else kwargs.get("is_main_process", True))
    card = card_options(model, model_card) if on_this_rank else None  # before the config (it keeps the results)
    if card is not None:
        card.setdefault("model_name", None if push_to_hub or card.get("repo_id") else target.name)
        card["repo_id"] = card.get("repo_id") or repo_id
        if not card.get("overwrite") and users_readme(target):
            card = None  # the user's README.md stays (carried over into the new save)
        elif card.get("tokenizer") is None and has_tokenizer(target):
            card["tokenizer"] = True  # the tokenizer saved there before is carried over into the new save
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
            raise HubUploadError.of(err, repo_id, target, upload.get("private"), revision=upload.get("revision"),
                                    create_pr=upload.get("create_pr", False), token=upload.get("token")) from None


def push_to_hub(model, repo_id: str, *, remote_code: bool = True, overwrite_model_card: bool = False,
                license: str | None = "apache-2.0", base_model: str | None = None, eval_results=None,
                tags: list[str] | str | None = None, private: bool | None = None, token: bool | str | None = None,
                revision: str | None = None, create_pr: bool = False, commit_message: str | None = None,
                commit_description: str | None = None, max_shard_size: int | str | None = "50GB"):
    """What `DCFormerPreTrainedModel.push_to_hub` does: transformers' steps (the repository created, the Hub's card
    tagged with the model's and the call's `tags`, the model saved into a temporary folder, one upload) with this
    package's save (`remote_code`) and card (`license`, `base_model`, `eval_results`, named for the full repository
    id). A card on the Hub that this package did not write is kept, tagged, unless `overwrite_model_card`. Returns
    the `CommitInfo`; any failure is one `HubUploadError`."""
    if eval_results is not None:
        read_eval_results(eval_results)  # malformed results fail before anything is created on the Hub
    check_repo_id(repo_id)
    tags = list(dict.fromkeys([*(model.model_tags or []), *([tags] if isinstance(tags, str) else tags or [])]))
    try:
        full_id = HfApi().create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
        hub_card = transformers_hub.create_and_tag_model_card(full_id, tags, token=token)
        card = dict(license=license, base_model=base_model, eval_results=eval_results, tags=tags, repo_id=full_id,
                    overwrite=True)
        with tempfile.TemporaryDirectory() as folder:
            save_pretrained(model, folder, remote_code=remote_code, model_card=card, max_shard_size=max_shard_size)
            if not (overwrite_model_card or is_generated_card(hub_card.content) or BLANK_CARD in hub_card.content):
                logger.warning(f"{full_id} has a README.md not generated by modeling_dcformer: kept (tags added)")
                hub_card.save(Path(folder) / "README.md")
            return upload_folder(folder, full_id, token=token, revision=revision, create_pr=create_pr,
                                 commit_message=commit_message, commit_description=commit_description,
                                 overwrite_model_card=True)
    except Exception as err:
        raise HubUploadError.of(err, repo_id, private=private, revision=revision, create_pr=create_pr,
                                token=token) from None


__all__ = ["AUTO_MAP", "push_to_hub", "remote_code_files", "save_pretrained", "write_remote_code"]
