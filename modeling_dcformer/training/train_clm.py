"""Causal-LM training of DCFormer / DCPythia with the `transformers` Trainer, in the style of `run_clm.py`.

Installed as the console script `dcformer-train` (the `train` extra: `pip install "modeling-dcformer[train]"`);
`examples/train_clm.py` is the same command as a script, for `accelerate launch` / `torchrun`, which take a file.

The model comes from
  * `--model_name_or_path`: a model directory or Hub id (a released DCFormer/DCPythia, a model saved by this
    script, or a Pythia converted with `dcformer-convert-pythia`), or
  * `--config_name`: a preset (`dcformer-tiny` is `DCFormerConfig.from_preset("dcformer-tiny")`), a config JSON
    file, or a directory / Hub id holding a config, trained from scratch; it needs `--tokenizer_name` (or
    `--new_tokenizer_vocab_size` to train a small byte-level BPE tokenizer on the training text).
The data comes from `--dataset_name [--dataset_config_name]` (the Hub) or `--train_file [--validation_file]`
(.txt: one example a line; .json/.jsonl: a `text` column, see `--text_column_name`); without a validation split,
`--validation_split_percentage` of the training data is held out. Texts are tokenised, concatenated and packed
into blocks of `--block_size` tokens. Every `TrainingArguments` option is a flag (`--bf16`, `--fp16`,
`--gradient_checkpointing`, `--torch_compile`, `--eval_strategy`, `--resume_from_checkpoint`, ...).

    dcformer-train --config_name dcformer-tiny --new_tokenizer_vocab_size 512 \
        --train_file examples/data/harbour_train.txt --validation_file examples/data/harbour_validation.txt \
        --block_size 64 --per_device_train_batch_size 8 --max_steps 100 --learning_rate 3e-3 \
        --do_train --do_eval --output_dir /tmp/dcformer-tiny-harbour --use_cpu --report_to none

It runs unchanged under `accelerate launch` (DDP, FSDP, DeepSpeed ZeRO) and `torchrun`, with the accelerate configs
installed beside this module: `dcformer-train --print-accelerate-config NAME` prints the path of one (names:
`dcformer-train --print-accelerate-config list`). On CPUs, `accelerate launch --cpu` starts one process whatever
`--num_processes` says (the script warns): use the `multi_cpu_gloo` config or `torchrun --nproc_per_node N`
(docs/training.md). After `trainer.save_model`, `AutoModelForCausalLM.from_pretrained(output_dir)` loads the
result (with `import modeling_dcformer` first), and the tokenizer is saved beside it.

Bad input and runs that go wrong end in one line (`error: ...`, exit code 2) naming the flag, file or value:
a missing model, data too short for one block, an unwritable output folder, a full disk (checkpoints, the final
save, the datasets cache), a diverged run, a Hub that cannot be reached with --push_to_hub (before training). The
flags are checked before the settings are printed. Checkpoints that cannot be resumed from (interrupted, truncated,
non-finite weights, a state file that `torch.load(weights_only=True)` refuses) are set aside with a warning. When
only the final upload fails (--push_to_hub), the output folder is complete and one line gives the `hf upload`
command that uploads it (exit code 3).
"""

import codecs
import contextlib
import errno
import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

import datasets
import torch
from datasets import load_dataset
from datasets.exceptions import DatasetGenerationError
from huggingface_hub import is_offline_mode
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
    set_seed,
)
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, sort_checkpoints
from transformers.utils import logging as hf_logging

from .. import DCFormerConfig  # importing the package registers "dcformer"/"dcpythia" with the Auto classes
from ..configuration import config_file
from ..publishing.hub import HubUploadError
from ..publishing.trainer import DCFormerTrainer

logger = hf_logging.get_logger("dcformer.train_clm")

ACCELERATE_DIR = Path(__file__).resolve().parent / "accelerate"  # the accelerate / DeepSpeed configs (package data)
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")
DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TrainingError(ValueError):
    """Bad input or a run that went wrong, said in one line (the script prints it as `error: ...`, exit code 2)."""


def one_line(err: BaseException) -> str:
    """An exception's message on one line (its lines joined; the type when it has no message)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return " ".join(lines) if lines else type(err).__name__


def _causes(err: BaseException):
    """`err` and the errors behind it (`__cause__`, `__context__`), each once."""
    seen = []
    while err is not None and not any(err is e for e in seen):
        seen.append(err)
        yield err
        err = err.__cause__ or err.__context__


DISK_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


def write_failure(err: BaseException, where: str | os.PathLike | None = None) -> str | None:
    """Why a write failed, in words, or None when `err` is no failed write: an OSError with an errno (or a "No space
    left" message), safetensors' error for an I/O failure, or torch.save's RuntimeError for a file it could not finish
    (it carries no errno: a nearly full disk at `where` is then named as the likely reason)."""
    for e in _causes(err):
        text = str(e)
        if isinstance(e, OSError) and (e.errno or "No space left" in text):
            code = e.errno or errno.ENOSPC
            return os.strerror(code) + (" (the disk is full)" if code in DISK_FULL else "")
        if type(e).__name__ == "SafetensorError" and "I/O error" in text:
            return text.split("I/O error:", 1)[1].strip() + (" (the disk is full)" if "No space left" in text else "")
        if isinstance(e, RuntimeError) and any(
                mark in text for mark in ("PytorchStreamWriter", "inline_container", "file write failed")):
            free = None
            try:
                free = shutil.disk_usage(where).free if where is not None else None
            except OSError:
                pass
            full = f" (the disk is full: {free // 1024} KiB free)" if free is not None and free < 16 << 20 else ""
            return f"torch.save could not finish the file ({one_line(e)}){full}"
    return None


def check_model_source(flag: str, name: str) -> None:
    """`--model_name_or_path` / `--config_name` / `--tokenizer_name` that is neither an existing path nor a
    possible Hub id (`owner/name`, `name`): one line naming it, instead of huggingface_hub's repo-id traceback."""
    if os.path.exists(name):
        return
    looks_local = name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name
    if looks_local or not HUB_ID.fullmatch(name):
        raise TrainingError(f"--{flag} {name}: no such directory or file (and not a Hub id of the form owner/name)")


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "A model directory or Hub id to start from (DCFormer/DCPythia, released or ours, or a Pythia "
            "converted with dcformer-convert-pythia). Leave out to train from --config_name."
        },
    )
    config_name: str | None = field(
        default=None,
        metadata={
            "help": "Train from scratch from this config: a preset name (configuration/NAME.json, e.g. "
            "dcformer-tiny, dcpythia-pythia-160m), a config JSON file, or a directory / Hub id with a config.json. "
            "With --model_name_or_path: the config to load the weights with."
        },
    )
    config_overrides: str | None = field(
        default=None,
        metadata={
            "help": "Comma-separated config overrides, e.g. 'attention_chunk_size=256,window_size=128'. Shape "
            "changes only make sense from scratch; attention_chunk_size / attention_recompute are safe anywhere."
        },
    )
    tokenizer_name: str | None = field(
        default=None,
        metadata={"help": "Tokenizer directory or Hub id; default: --model_name_or_path."},
    )
    new_tokenizer_vocab_size: int | None = field(
        default=None,
        metadata={
            "help": "Train a byte-level BPE tokenizer of this many tokens on the training texts instead of "
            "loading one (for from-scratch demos without downloads). Saved with the model."
        },
    )
    cache_dir: str | None = field(default=None, metadata={"help": "Where downloaded models and datasets are cached."})
    model_revision: str = field(default="main", metadata={"help": "Branch, tag or commit of the model on the Hub."})
    token: str | None = field(default=None, metadata={"help": "Hub token for private models or datasets."})
    dtype: str = field(
        default="float32",
        metadata={
            "help": "dtype to load the weights in. Keep float32 for training (mixed precision with --bf16/--fp16 "
            "keeps fp32 master weights); 'auto' takes the checkpoint's dtype (fp16 for DCPythia-6.9B).",
            "choices": list(DTYPES),
        },
    )


@dataclass
class DataTrainingArguments:
    dataset_name: str | None = field(default=None, metadata={"help": "A dataset on the Hub (datasets library)."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "The dataset's configuration name."})
    train_file: str | None = field(default=None, metadata={"help": "Training data: .txt, .json or .jsonl."})
    validation_file: str | None = field(default=None, metadata={"help": "Evaluation data: .txt, .json or .jsonl."})
    text_column_name: str | None = field(
        default=None, metadata={"help": "Column holding the text; default 'text', else the first column."}
    )
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Keep only this many training blocks (for debugging or quick runs)."}
    )
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Keep only this many evaluation blocks (for debugging or quick runs)."}
    )
    streaming: bool = field(default=False, metadata={"help": "Stream the dataset (needs --max_steps)."})
    block_size: int | None = field(
        default=None,
        metadata={
            "help": "Tokens per training block after packing. Default: the smallest of the tokenizer's "
            "model_max_length, the model's max_position_embeddings and 1024."
        },
    )
    append_eos: bool = field(
        default=False,
        metadata={"help": "Append the tokenizer's eos token to every example before packing (document separators)."},
    )
    overwrite_cache: bool = field(default=False, metadata={"help": "Recompute the tokenised datasets."})
    validation_split_percentage: int = field(
        default=5, metadata={"help": "Percent of the training data held out when there is no validation split."}
    )
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for tokenisation."})
    keep_linebreaks: bool = field(default=True, metadata={"help": "Keep line breaks in .txt files."})
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Start afresh even if --output_dir holds checkpoints (otherwise training resumes from the last)."
        },
    )

    def __post_init__(self):
        if self.streaming:
            datasets.utils.logging.set_verbosity_warning()
        if self.dataset_name is None and self.train_file is None and self.validation_file is None:
            raise TrainingError("Need --dataset_name, or --train_file / --validation_file.")
        for name in ("train_file", "validation_file"):
            path = getattr(self, name)
            if path is not None and path.rsplit(".", 1)[-1] not in ("txt", "json", "jsonl"):
                raise TrainingError(f"--{name} must be a .txt, .json or .jsonl file, got {path!r}")
        if not 0 < self.validation_split_percentage < 100:
            raise TrainingError("--validation_split_percentage must be between 1 and 99")
        for name in ("max_train_samples", "max_eval_samples"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise TrainingError(f"--{name} {value}: give a positive number of blocks (or leave it out for all)")


# ----------------------------------------------------------------------------------------------------------------
# Model and tokenizer
# ----------------------------------------------------------------------------------------------------------------
def refuse_non_dcformer(config, source: str):
    if isinstance(config, DCFormerConfig):
        return
    model_type = getattr(config, "model_type", type(config).__name__)
    hint = ""
    if model_type == "gpt_neox":
        hint = (
            f" Convert the Pythia/GPT-NeoX checkpoint first: dcformer-convert-pythia {source} "
            "./dcpythia-converted, then pass --model_name_or_path ./dcpythia-converted."
        )
    raise TrainingError(f"{source!r} is a {model_type!r} model, not DCFormer.{hint}")


def load_config(model_args: ModelArguments):
    hub = dict(cache_dir=model_args.cache_dir, revision=model_args.model_revision, token=model_args.token)
    name = model_args.config_name or model_args.model_name_or_path
    flag = "config_name" if model_args.config_name else "model_name_or_path"
    try:
        preset = config_file(name) if model_args.config_name else None
    except FileNotFoundError as err:
        raise TrainingError(f"--config_name: {err}") from None
    if preset is not None:
        try:
            with open(preset, encoding="utf-8") as f:
                config = DCFormerConfig.from_dict(json.load(f))  # also accepts the authors' released keys
        except (OSError, ValueError, TypeError) as err:
            raise TrainingError(f"--{flag} {preset}: not a readable DCFormer config ({one_line(err)})") from None
        logger.info(f"config from preset {preset}")
    else:
        check_model_source(flag, name)
        try:
            config = AutoConfig.from_pretrained(name, **hub)
        except (OSError, ValueError) as err:  # no config.json, not on the Hub, offline, not JSON, ...
            raise TrainingError(f"--{flag} {name}: cannot load its config ({one_line(err)})") from None
    refuse_non_dcformer(config, name)
    if model_args.config_overrides:
        logger.info(f"overriding config: {model_args.config_overrides}")
        config = apply_config_overrides(config, model_args.config_overrides)
    return config


def parse_override_value(text: str):
    lowered = text.strip().lower()
    if lowered in ("none", "null"):
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text.strip()


def apply_config_overrides(config, overrides: str):
    """`key=value,key=value` on top of `config`, rebuilt through the config class so that its checks run and
    derived fields follow (a new window_size / window_type / num_hidden_layers re-derives layer_types)."""
    values = {}
    for item in overrides.split(","):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise TrainingError(f"--config_overrides: {item!r} is not key=value")
        if not hasattr(config, key):
            raise TrainingError(f"--config_overrides: {type(config).__name__} has no attribute {key!r}")
        values[key] = parse_override_value(value)
    config_dict = config.to_dict()
    config_dict.update(values)
    if {"window_size", "window_type", "num_hidden_layers"} & set(values) and "layer_types" not in values:
        config_dict.pop("layer_types", None)
    if {"num_attention_heads", "num_head_groups"} & set(values) and "dynamic_hidden_size" not in values:
        config_dict.pop("dynamic_hidden_size", None)  # re-derived: 4 * heads per group
    try:
        config = type(config).from_dict(config_dict)
        with torch.device("meta"):  # the shapes the values give, built without memory: refused here, not later
            AutoModelForCausalLM.from_config(config)
    except Exception as err:  # the config's checks: ValueError, TypeError, huggingface_hub's StrictDataclassError
        raise TrainingError(f"--config_overrides {overrides!r}: {one_line(err)}") from None
    return config


def load_tokenizer(model_args: ModelArguments, training_texts, resume_from: str | None = None):
    if model_args.new_tokenizer_vocab_size and resume_from is not None:
        # The checkpoint's weights belong to its token ids: a tokenizer retrained on (maybe changed) text would not.
        if not any(Path(resume_from, name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
            raise TrainingError(
                f"cannot resume from {resume_from}: it holds no tokenizer, and a new one trained now "
                "(--new_tokenizer_vocab_size) would give its weights other token ids; pass --tokenizer_name DIR "
                "with the tokenizer it was trained with, or --overwrite_output_dir to start afresh"
            )
        logger.info(f"resuming: the tokenizer of {resume_from} (not a newly trained one)")
        return AutoTokenizer.from_pretrained(resume_from)
    if model_args.new_tokenizer_vocab_size:
        from .tokenizer import build_tiny_tokenizer

        logger.info(f"training a {model_args.new_tokenizer_vocab_size}-token byte-level BPE tokenizer")
        return build_tiny_tokenizer(training_texts(), model_args.new_tokenizer_vocab_size)
    name = model_args.tokenizer_name or model_args.model_name_or_path
    if name is None:
        raise TrainingError(
            "Training from --config_name needs a tokenizer: --tokenizer_name (a directory or Hub id, e.g. "
            "EleutherAI/pythia-160m for the DCPythia presets) or --new_tokenizer_vocab_size N."
        )
    flag = "tokenizer_name" if model_args.tokenizer_name else "model_name_or_path"
    check_model_source(flag, name)
    try:
        return AutoTokenizer.from_pretrained(
            name, cache_dir=model_args.cache_dir, revision=model_args.model_revision, token=model_args.token
        )
    except (OSError, ValueError) as err:
        raise TrainingError(f"--{flag} {name}: cannot load a tokenizer from it ({one_line(err)})") from None


def build_model(model_args: ModelArguments, config, tokenizer):
    if model_args.model_name_or_path:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                model_args.model_name_or_path,
                config=config,
                dtype=DTYPES[model_args.dtype],
                cache_dir=model_args.cache_dir,
                revision=model_args.model_revision,
                token=model_args.token,
            )
        except OSError as err:  # no weights, a truncated or unreadable file
            raise TrainingError(f"--model_name_or_path {model_args.model_name_or_path}: {one_line(err)}") from None
    else:
        # From scratch: the vocabulary must hold the tokenizer, and special ids follow it.
        if len(tokenizer) > config.vocab_size:
            logger.info(f"vocab_size {config.vocab_size} -> {len(tokenizer)} to hold the tokenizer")
            config.vocab_size = len(tokenizer)
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(tokenizer, name, None)
            if value is not None:
                setattr(config, name, value)
        model = AutoModelForCausalLM.from_config(config)
        if model_args.dtype not in ("auto", "float32"):
            model = model.to(DTYPES[model_args.dtype])
        n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ds_numel: ZeRO-3
        logger.info(f"training a new DCFormer from scratch: {n_params / 2**20:.2f}M parameters")
    embedding_size = model.get_input_embeddings().num_embeddings  # not weight.shape: ZeRO-3 partitions it
    if len(tokenizer) > embedding_size:
        logger.warning(f"resizing the embeddings from {embedding_size} to {len(tokenizer)} tokens for the tokenizer")
        model.resize_token_embeddings(len(tokenizer))
    return model


# ----------------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------------
def load_raw_datasets(data_args: DataTrainingArguments, model_args: ModelArguments):
    p = data_args.validation_split_percentage
    if data_args.dataset_name is not None:
        kwargs = dict(cache_dir=model_args.cache_dir, token=model_args.token, streaming=data_args.streaming)
        raw = load_dataset(data_args.dataset_name, data_args.dataset_config_name, **kwargs)
        if "validation" not in raw:
            raw["validation"] = load_dataset(
                data_args.dataset_name, data_args.dataset_config_name, split=f"train[:{p}%]", **kwargs
            )
            raw["train"] = load_dataset(
                data_args.dataset_name, data_args.dataset_config_name, split=f"train[{p}%:]", **kwargs
            )
        return raw
    check_data_files(data_args)
    data_files = {}
    if data_args.train_file is not None:
        data_files["train"] = data_args.train_file
    if data_args.validation_file is not None:
        data_files["validation"] = data_args.validation_file
    extension = next(iter(data_files.values())).rsplit(".", 1)[-1]
    builder = {"txt": "text", "jsonl": "json"}.get(extension, extension)
    kwargs = dict(data_files=data_files, cache_dir=model_args.cache_dir, token=model_args.token)
    if builder == "text":
        kwargs["keep_linebreaks"] = data_args.keep_linebreaks
    try:
        raw = load_dataset(builder, streaming=data_args.streaming, **kwargs)
    except (UnicodeDecodeError, ValueError, DatasetGenerationError) as err:  # not text / not JSON lines
        if (cache_error := datasets_cache_error(err, model_args)) is not None:
            raise cache_error from None
        names = " / ".join(f"--{split}_file {path}" for split, path in data_files.items())
        cause = err.__cause__ or err.__context__ or err
        raise TrainingError(f"{names}: not readable as {builder} ({one_line(cause)})") from None
    check_null_texts(raw, data_args, data_files)
    if "validation" not in raw and "train" in raw:
        try:
            raw["validation"] = load_dataset(builder, split=f"train[:{p}%]", **kwargs)
            raw["train"] = load_dataset(builder, split=f"train[{p}%:]", **kwargs)
        except ValueError as err:
            if "corresponds to no data" not in str(err):
                raise
            raise TrainingError(
                f"--train_file {data_args.train_file} has too few rows ({len(raw['train'])}) to hold out "
                f"{p}% for validation: give a --validation_file, more text, or a larger --validation_split_percentage"
            ) from None
    return raw


def datasets_cache_error(err: BaseException, model_args: ModelArguments) -> TrainingError | None:
    """A write into the datasets cache that failed (a full disk, a read-only folder), as one line naming the cache
    (not the data file being read then); None for any other error."""
    for e in _causes(err):
        if isinstance(e, OSError) and (e.errno in (*DISK_FULL, errno.EROFS) or "No space left" in str(e)):
            cache = model_args.cache_dir or datasets.config.HF_DATASETS_CACHE
            return TrainingError(f"could not write the datasets cache {cache}: {write_failure(e)}; free space there, "
                                 "or pass --cache_dir with a folder on another disk")
    return None


def check_data_files(data_args: DataTrainingArguments) -> None:
    """A missing or empty data file: one line naming it (not the datasets library's generation error)."""
    for flag in ("train_file", "validation_file"):
        path = getattr(data_args, flag)
        if path is None:
            continue
        if not os.path.isfile(path):
            raise TrainingError(f"--{flag} {path}: no such file")
        if os.path.getsize(path) == 0 or (os.path.getsize(path) < 1 << 20 and not Path(path).read_bytes().strip()):
            raise TrainingError(f"--{flag} {path} is empty: give a file with text (a line an example for .txt)")
        with open(path, "rb") as f:
            head = f.read(1 << 20)
        try:
            codecs.getincrementaldecoder("utf-8")().decode(head, final=False)  # a character cut at 1 MiB is fine
            binary = b"\x00" in head
        except UnicodeDecodeError:
            binary = True
        if binary:
            raise TrainingError(f"--{flag} {path} is not UTF-8 text (binary data?): give a text, JSON or JSON lines "
                                "file")


def check_null_texts(raw, data_args: DataTrainingArguments, data_files: dict) -> None:
    """A record whose text is null (JSON `null`): one line naming the file and the record, not the tokenizer's
    TypeError. Counted by Arrow without reading the texts; streamed data is checked while tokenising."""
    if data_args.streaming:
        return
    import pyarrow.compute as pc

    column = text_column(raw, data_args)
    for split, dataset in raw.items():
        texts = dataset.data.column(column)
        if texts.null_count:
            first = pc.index(pc.is_null(texts), True).as_py()
            others = f" (and {texts.null_count - 1} more)" if texts.null_count > 1 else ""
            raise TrainingError(
                f"--{split}_file {data_files[split]}: record {first + 1} (counting from 1){others} has no text (its "
                f"{column!r} is null): drop or fill such records"
            )


def pick_block_size(data_args: DataTrainingArguments, tokenizer, config) -> int:
    max_positions = config.max_position_embeddings
    if data_args.block_size is not None and data_args.block_size < 1:
        raise TrainingError(f"--block_size {data_args.block_size}: give a positive number of tokens a block")
    if data_args.block_size is None:
        block_size = min(tokenizer.model_max_length, max_positions, 1024)
        logger.info(f"block_size not given: using {block_size}")
        return block_size
    if data_args.block_size > max_positions:
        logger.warning(
            f"block_size {data_args.block_size} is larger than the model's max_position_embeddings {max_positions}"
        )
    return data_args.block_size


def text_column(raw, data_args: DataTrainingArguments) -> str:
    column_names = list(raw["train" if "train" in raw else "validation"].features)
    column = data_args.text_column_name or ("text" if "text" in column_names else column_names[0])
    if column not in column_names:
        raise TrainingError(f"no column {column!r} in the data (columns: {column_names})")
    return column


def tokenize_and_pack(raw, data_args, training_args, tokenizer, block_size):
    column_names = list(raw["train" if "train" in raw else "validation"].features)
    column = text_column(raw, data_args)
    eos = tokenizer.eos_token_id
    if data_args.append_eos and eos is None:
        raise TrainingError("--append_eos needs a tokenizer with an eos token")
    tok_logger = hf_logging.get_logger("transformers.tokenization_utils_base")

    def tokenize(examples, indices):
        missing = [i for i, text in enumerate(examples[column]) if not isinstance(text, str)]
        if missing:
            source = data_args.train_file or data_args.validation_file or data_args.dataset_name
            raise TrainingError(
                f"{source}: record {indices[missing[0]] + 1} of a streamed split has no text (its {column!r} is "
                f"{examples[column][missing[0]]!r}): drop or fill such records"
            )
        level = tok_logger.level
        tok_logger.setLevel(logging.ERROR)  # long texts are split into blocks below: no length warning
        try:
            out = tokenizer(examples[column])
        finally:
            tok_logger.setLevel(level)
        if data_args.append_eos:
            out["input_ids"] = [ids + [eos] for ids in out["input_ids"]]
            out["attention_mask"] = [mask + [1] for mask in out["attention_mask"]]
        return out

    def group_texts(examples):
        concatenated = {k: list(chain(*examples[k])) for k in examples}
        total = (len(concatenated["input_ids"]) // block_size) * block_size  # the remainder is dropped
        result = {k: [t[i : i + block_size] for i in range(0, total, block_size)] for k, t in concatenated.items()}
        result["labels"] = [ids.copy() for ids in result["input_ids"]]  # the model shifts labels itself
        return result

    def map_kwargs(desc):
        if data_args.streaming:  # an IterableDataset maps lazily: no processes, cache or progress bar
            return {}
        return dict(
            num_proc=data_args.preprocessing_num_workers, load_from_cache_file=not data_args.overwrite_cache, desc=desc
        )

    with training_args.main_process_first(desc="tokenisation"):
        tokenized = raw.map(
            tokenize, batched=True, with_indices=True, remove_columns=column_names, **map_kwargs("Tokenising")
        )
    with training_args.main_process_first(desc="packing into blocks"):
        packed = tokenized.map(group_texts, batched=True, **map_kwargs(f"Packing into blocks of {block_size}"))
    return packed


def limit(dataset, n, streaming):
    if n is None:
        return dataset
    if streaming:
        return dataset.take(n)
    return dataset.select(range(min(len(dataset), n)))


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints and divergence
# ----------------------------------------------------------------------------------------------------------------
def checkpoint_problem(path) -> tuple[str, str] | None:
    """Why the Trainer checkpoint `path` cannot be resumed from, as (tag, reason), or None when it can:
    * "incomplete": no readable `trainer_state.json` (Trainer writes it last: the write was interrupted);
    * "corrupt": a weights file that safetensors cannot read (truncated, garbage), or an optimizer / scheduler /
      RNG state that is not a whole torch zip archive (its central directory, at the end, is missing);
    * "nonfinite": weights that hold NaN or inf (a run that diverged before this guard existed);
    * "unloadable": an RNG, scheduler or gradient-scaler state that `torch.load(weights_only=True)` refuses, with the
      globals Trainer allows (it holds objects of other kinds: written by other versions, or planted).
    Reads every weight once (safetensors, memory-mapped); FSDP's sharded folders are checked for their state only."""
    import zipfile

    from safetensors import SafetensorError, safe_open

    try:
        json.loads(Path(path, "trainer_state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "incomplete", "no readable trainer_state.json: its write was interrupted"
    for state in sorted(p for pattern in ("*.pt", "*.pth", "*.bin") for p in Path(path).glob(pattern)):
        try:
            with zipfile.ZipFile(state):
                pass
        except (OSError, zipfile.BadZipFile) as err:
            return "corrupt", f"{state.name} is truncated or unreadable ({one_line(err)})"
    if (refused := refused_state(path)) is not None:
        return "unloadable", refused
    bad, total = [], 0
    for weights in sorted(Path(path).glob("*.safetensors")):
        try:
            with safe_open(str(weights), framework="pt") as f:
                for key in f.keys():
                    tensor = f.get_tensor(key)
                    total += 1
                    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                        bad.append(key)
        except (OSError, SafetensorError, RuntimeError, ValueError) as err:
            return "corrupt", f"{weights.name} is truncated or unreadable ({one_line(err)})"
    if bad:
        return "nonfinite", f"{len(bad)} of {total} weight tensors hold NaN or inf (first: {bad[0]})"
    return None


WEIGHTS_ONLY_STATES = ("rng_state*.pth", "scheduler.pt", "scaler.pt")  # small: loaded whole to check them


def refused_state(path) -> str | None:
    """Why `torch.load(weights_only=True)` refuses a state file of the checkpoint `path` that Trainer loads so on
    resuming (the RNG, scheduler and scaler states, with Trainer's allowed numpy globals), or None."""
    from transformers.trainer_pt_utils import safe_globals

    for state in sorted(p for pattern in WEIGHTS_ONLY_STATES for p in Path(path).glob(pattern)):
        try:
            with safe_globals():
                torch.load(state, map_location="cpu", weights_only=True)
        except Exception as err:  # pickle.UnpicklingError, RuntimeError, ...: whatever stops Trainer's load
            text = str(err)
            detail = re.search(r"WeightsUnpickler error: (.*?)(?: was not an allowed global|\n|$)", text)
            return (f"torch.load(weights_only=True) refuses {state.name} "
                    f"({detail.group(1).strip() if detail else one_line(err)})")
    return None


def newest_complete_checkpoint(output_dir, set_aside: bool = False) -> str | None:
    """The newest checkpoint of `output_dir` that can be resumed from (`checkpoint_problem`), warning about each
    newer one that cannot; with `set_aside` (the main process) those are renamed `TAG-checkpoint-N` (TAG:
    incomplete, corrupt, nonfinite, unloadable), so that neither this run nor a later one picks them, and Trainer
    does not keep them instead of good ones when it rotates checkpoints (--save_total_limit)."""
    for checkpoint in reversed(sort_checkpoints(output_dir)):  # newest first (by step)
        problem = checkpoint_problem(checkpoint)
        if problem is None:
            return checkpoint
        tag, reason = problem
        aside = Path(output_dir) / f"{tag}-{Path(checkpoint).name}"
        note = f"{checkpoint} is {'incomplete' if tag == 'incomplete' else 'not resumable'} ({reason})"
        if set_aside and not aside.exists():
            os.replace(checkpoint, aside)
            note += f"; renamed {aside.name}"
        logger.warning(f"{note}; resuming from an earlier checkpoint if there is one")
    return None


def resume_checkpoint(training_args, data_args) -> str | None:
    """The checkpoint this run resumes from: --resume_from_checkpoint (a path, or true/last for the newest), else
    the newest in --output_dir unless --overwrite_output_dir; only a complete one (see `newest_complete_checkpoint`)."""
    requested = training_args.resume_from_checkpoint
    if not training_args.do_train:
        return None
    set_aside = training_args.process_index == 0
    if isinstance(requested, str) and requested.lower() not in ("true", "last"):
        if not os.path.isdir(requested):
            raise TrainingError(f"--resume_from_checkpoint {requested}: no such checkpoint directory")
        problem = checkpoint_problem(requested)
        if problem is not None:
            tag, reason = problem
            what = "is incomplete" if tag == "incomplete" else "cannot be resumed from"
            raise TrainingError(
                f"--resume_from_checkpoint {requested} {what} ({reason}): pass an earlier checkpoint, or 'last' "
                "for the newest usable one"
            )
        return requested
    if requested is not None or (os.path.isdir(training_args.output_dir) and not data_args.overwrite_output_dir):
        found = newest_complete_checkpoint(training_args.output_dir, set_aside) if os.path.isdir(
            training_args.output_dir) else None
        if found is None and requested is not None:
            raise TrainingError(f"--resume_from_checkpoint {requested}: no usable checkpoint in "
                                f"{training_args.output_dir}")
        if found is not None and requested is None:
            logger.warning(f"checkpoint found, resuming from {found} (--overwrite_output_dir: start afresh)")
        return found
    return None


class StopOnNonFinite(TrainerCallback):
    """Stops training with a clear error at the first optimizer step whose gradients hold NaN or inf (the run
    diverged; the loss is then NaN too, although Trainer logs NaN losses as the running mean, e.g. 0): before the
    step is applied, so neither the weights nor any later checkpoint become non-finite. Under fp16 loss scaling the
    scaler skips overflowing steps itself; the final save is then guarded by `check_finite`."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if model is None or getattr(self.trainer.accelerator, "scaler", None) is not None:
            return
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not grads:  # DeepSpeed keeps them to itself
            return
        grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]  # FSDP2: this process's shards
        norm = torch.nn.utils.get_total_norm(grads, error_if_nonfinite=False).float()
        bad = (~torch.isfinite(norm)).float()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)  # every process stops together
        if bad.item():
            raise TrainingError(
                f"training diverged at step {state.global_step + 1}: the gradient norm is {norm.item()}; stopped "
                f"before the step was applied, nothing of it was saved. Lower "
                f"--learning_rate (now {args.learning_rate:g}), keep --max_grad_norm on, or resume from a checkpoint"
            )


    def on_step_end(self, args, state, control, model=None, **kwargs):
        """Before a checkpoint is written (Trainer saves right after this callback, when `should_save`): its
        weights must be finite. A step can make them NaN or inf from finite gradients (an infinite learning rate,
        an overflow in the update); such a checkpoint would be resumed from, and fail, on every later run."""
        if not control.should_save or model is None:
            return
        bad = non_finite_weights(model)
        flag = torch.tensor(float(bool(bad)))
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            flag = flag.to(args.device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)  # every process stops together
        if flag.item():
            first = f" (first: {bad[0]})" if bad else " (in another process's shard)"
            raise TrainingError(
                f"training diverged at step {state.global_step}: after the update {len(bad)} weight tensor(s) hold "
                f"NaN or inf{first}; checkpoint-{state.global_step} was not written (earlier checkpoints are kept). "
                f"Lower --learning_rate (now {args.learning_rate:g}) and resume from a checkpoint or start afresh"
            )


def non_finite_weights(model) -> list[str]:
    """The names of the parameters of `model` (this process's shards under FSDP) that hold NaN or inf."""
    bad = []
    for name, p in model.named_parameters():
        data = p.to_local() if hasattr(p, "to_local") else p
        if data.numel() and not bool(torch.isfinite(data.detach()).all()):
            bad.append(name)
    return bad


def check_finite(model, what: str) -> None:
    """A model with NaN or inf weights is never saved as the result of the run."""
    bad = non_finite_weights(model)
    if bad:
        raise TrainingError(
            f"not saving {what}: {len(bad)} weight tensor(s) hold NaN or inf (first: {bad[0]}); training diverged: "
            "lower --learning_rate and train again (checkpoints written before, if any, are kept)"
        )


class CheckpointTrainer(DCFormerTrainer):
    """`DCFormerTrainer` (Trainer keeping DCFormer's model card on `--push_to_hub`); a checkpoint whose write fails
    (a full disk, a folder turned read-only: an OSError, safetensors' I/O error or torch.save's RuntimeError) ends the
    run with one line naming it, and the half-written `checkpoint-N` is removed (after any other error too), so that
    no later run takes it for one."""

    def _save_checkpoint(self, model, trial):
        folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        existed = folder.exists()
        try:
            super()._save_checkpoint(model, trial)
        except Exception as err:
            reason = write_failure(err, folder.parent)  # before the partial checkpoint frees its space
            removed = ""
            if self.args.should_save and not existed and folder.exists():
                shutil.rmtree(folder, ignore_errors=True)
                removed = "; the partial checkpoint was removed"
            if reason is None and not isinstance(err, OSError):
                raise  # no failed write: the error as it is
            raise TrainingError(
                f"could not write checkpoint {folder}: {reason or one_line(err)}{removed}; earlier checkpoints are "
                "kept: free space (or lower --save_total_limit) and run again to resume"
            ) from None


# ----------------------------------------------------------------------------------------------------------------
# Several processes: say so when fewer run than were asked for
# ----------------------------------------------------------------------------------------------------------------
MULTI_CPU_ROUTES = (
    "`accelerate launch --config_file $(dcformer-train --print-accelerate-config multi_cpu_gloo) "
    "examples/train_clm.py ... --use_cpu` or `torchrun --nproc_per_node N examples/train_clm.py ... --use_cpu` "
    "(see docs/training.md)"
)


def launcher_command() -> list[str]:
    """The command line of the process that started this one (e.g. `accelerate launch ...`), [] if unreadable."""
    try:
        import psutil  # a dependency of accelerate

        return psutil.Process(os.getppid()).cmdline()
    except Exception:
        return []


def num_processes_option(argv: list[str]) -> int | None:
    """The value of `--num_processes N` (or `--num-processes`, `=N`) in a launcher's command line, if there."""
    for i, arg in enumerate(argv):
        name, _, value = arg.partition("=")
        if name not in ("--num_processes", "--num-processes"):
            continue
        if not value and i + 1 < len(argv):
            value = argv[i + 1]
        return int(value) if value.isdigit() else None
    return None


def process_count_warning(env, world_size: int, launcher_argv: list[str]) -> str | None:
    """A warning when fewer processes run than the launcher was asked for, else None. torchrun (and accelerate's
    multi-process launchers) set WORLD_SIZE. `accelerate launch --cpu --num_processes N`, or a MULTI_CPU config
    without an MPI hostfile, starts a single process without WORLD_SIZE; it sets ACCELERATE_USE_CPU, and
    MASTER_ADDR only when given more than one process; N is read from its command line (`launcher_argv`)."""
    if env.get("WORLD_SIZE", "").isdigit():
        asked = int(env["WORLD_SIZE"])
        if world_size >= asked:
            return None
        return (
            f"the launcher asked for {asked} processes (WORLD_SIZE={asked}) but this run has {world_size}; for "
            f"several processes on CPUs use {MULTI_CPU_ROUTES}"
        )
    if "ACCELERATE_USE_CPU" in env and "MASTER_ADDR" in env and world_size == 1:
        asked = num_processes_option(launcher_argv)
        if asked is not None and asked <= world_size:
            return None
        asked_text = f"{asked} processes" if asked else "several processes"
        return (
            f"accelerate launch was asked for {asked_text} but started only this one: with --cpu (or a MULTI_CPU "
            f"config without an MPI hostfile) accelerate runs a single process. For several processes on CPUs use "
            f"{MULTI_CPU_ROUTES}"
        )
    return None


# ----------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------
def check_training_args(training_args) -> None:
    """TrainingArguments values that Trainer would accept and act on wrongly (or fail on later with a traceback), and
    what the model needs by default."""
    if training_args.max_steps == 0 or training_args.max_steps < -1:
        raise TrainingError(
            f"--max_steps {training_args.max_steps}: give a positive number of optimizer steps (or leave it out and "
            "train --num_train_epochs)"
        )
    counts = [("per_device_train_batch_size", training_args.do_train), ("per_device_eval_batch_size",
              training_args.do_eval), ("gradient_accumulation_steps", training_args.do_train)]
    for name, used in counts:
        if used and getattr(training_args, name) < 1:
            raise TrainingError(f"--{name} {getattr(training_args, name)}: give a positive number")
    if not math.isfinite(training_args.learning_rate) or training_args.learning_rate < 0:
        raise TrainingError(f"--learning_rate {training_args.learning_rate}: give a finite number, 0 or more")
    if training_args.ddp_find_unused_parameters is None:
        # Every parameter of a DCFormer takes part in every forward pass (tests/test_train_faults.py checks it with
        # a config that uses every weight), so DDP need not search the graph for unused ones (the search costs a
        # traversal a step and makes DDP warn that it found none). --ddp_find_unused_parameters true restores it.
        training_args.ddp_find_unused_parameters = False


def check_output_dir(output_dir: str) -> None:
    """The output folder can be created and written into (not read-only, not a file, not on a read-only mount):
    one line naming it, before any work, instead of a traceback at the first save."""
    try:
        os.makedirs(output_dir, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-check-", dir=output_dir)
        os.close(fd)
        os.remove(probe)
    except OSError as err:
        reason = os.strerror(err.errno) if err.errno else one_line(err)
        raise TrainingError(f"--output_dir {output_dir} is not writable ({reason}): choose another folder") from None


def parse_args(argv=None):
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 1 and argv[0].endswith((".json", ".yaml", ".yml")):
        loader = parser.parse_json_file if argv[0].endswith(".json") else parser.parse_yaml_file
        return loader(os.path.abspath(argv[0]))
    return parser.parse_args_into_dataclasses(args=argv)


def main(argv=None):
    # Every flag is checked before the settings are printed: a refusal is one line, not one after ~160.
    model_args, data_args, training_args = parse_args(argv)
    if model_args.model_name_or_path is None and model_args.config_name is None:
        raise TrainingError("Need --model_name_or_path (a model to fine-tune) or --config_name (a preset to train).")
    check_training_args(training_args)
    if data_args.dataset_name is None:
        check_data_files(data_args)
    if training_args.push_to_hub and is_offline_mode():
        raise TrainingError("--push_to_hub: the Hub cannot be reached in offline mode (HF_HUB_OFFLINE=1): unset it, or "
                            "train without --push_to_hub and upload --output_dir afterwards with `hf upload`")
    on_cpu = training_args.device.type == "cpu"
    if training_args.deepspeed and on_cpu and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise TrainingError(
            "DeepSpeed with several CPU processes does not work through accelerate (it sees world size 1 in each "
            "process and DeepSpeed's batch-size check fails): run DeepSpeed on GPUs, or a single process on the CPU."
        )

    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    if training_args.should_log:
        hf_logging.set_verbosity_info()  # the default of training_args.log_level is passive
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    datasets.utils.logging.disable_propagation()  # datasets has its own handler: print once
    hf_logging.set_verbosity(log_level)
    hf_logging.enable_default_handler()
    hf_logging.enable_explicit_format()

    # A previous run in output_dir is resumed unless asked otherwise (from its newest complete checkpoint).
    resume_from = resume_checkpoint(training_args, data_args)
    if training_args.process_index == 0 and (training_args.do_train or training_args.should_save):
        check_output_dir(training_args.output_dir)

    # Information; with several processes each says which it is at warning level, the one level a replica shows.
    say = logger.warning if training_args.world_size > 1 else logger.info
    say(
        f"process rank {training_args.process_index} of {training_args.world_size}, device {training_args.device}, "
        f"distributed {training_args.parallel_mode.value}, mixed precision "
        f"{'bf16' if training_args.bf16 else 'fp16' if training_args.fp16 else 'no'}"
    )
    fewer_processes = process_count_warning(os.environ, training_args.world_size, launcher_command())
    if fewer_processes:
        logger.warning(fewer_processes)
    if training_args.fp16 and on_cpu:
        logger.warning(
            "--fp16 on CPU: accelerate has no fp16 autocast on the CPU and trains in fp32; use --bf16 there."
        )
    logger.info(f"training parameters {training_args}")

    set_seed(training_args.seed)

    try:
        raw = load_raw_datasets(data_args, model_args)
    except OSError as err:
        raise datasets_cache_error(err, model_args) or err from None
    config = load_config(model_args)

    def training_texts():
        split = raw["train"] if "train" in raw else raw["validation"]
        column = text_column(raw, data_args)
        for example in split:
            yield example[column]

    tokenizer = load_tokenizer(model_args, training_texts, resume_from)
    model = build_model(model_args, config, tokenizer)
    block_size = pick_block_size(data_args, tokenizer, model.config)
    try:
        packed = tokenize_and_pack(raw, data_args, training_args, tokenizer, block_size)
    except Exception as err:  # the datasets library's own errors wrap the OSError of a full cache
        if (cache_error := datasets_cache_error(err, model_args)) is None:
            raise
        raise cache_error from None

    train_dataset = eval_dataset = None
    if training_args.do_train:
        if "train" not in packed:
            raise TrainingError("--do_train needs a training split (--train_file or --dataset_name)")
        train_dataset = limit(packed["train"], data_args.max_train_samples, data_args.streaming)
        if not data_args.streaming and len(train_dataset) == 0:
            raise TrainingError(f"the training data gives no full block of {block_size} tokens: lower --block_size")
    if training_args.do_eval:
        if "validation" not in packed:
            raise TrainingError("--do_eval needs a validation split")
        eval_dataset = limit(packed["validation"], data_args.max_eval_samples, data_args.streaming)
        if not data_args.streaming and len(eval_dataset) == 0:
            raise TrainingError(
                f"the validation data gives no full block of {block_size} tokens: lower --block_size, give a larger "
                "--validation_file or raise --validation_split_percentage"
            )

    try:
        trainer = CheckpointTrainer(
            model=model,
            args=training_args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=tokenizer,
            data_collator=default_data_collator,  # blocks are all block_size long: no padding
        )
    except HubUploadError as err:  # --push_to_hub: the repository could not be created (offline, no token, ...)
        raise TrainingError(
            f"--push_to_hub: creating {err.failure}; nothing was trained. Run again once the Hub is reachable, or "
            f"without --push_to_hub and upload --output_dir after training with `{err.command}`"
        ) from None
    trainer.add_callback(StopOnNonFinite(trainer))

    fsdp_requested = bool(training_args.fsdp) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if fsdp_requested and not trainer.is_fsdp_enabled:
        logger.warning(
            "FSDP was asked for, but accelerate enables FSDP only on accelerators (GPU, XPU, NPU, ...): on the CPU it "
            "trains with plain DDP (every process holds the whole model)."
        )

    upload_error = None  # --push_to_hub: the final upload failed (the output folder is complete)
    if training_args.do_train:
        train_result = trainer.train(resume_from_checkpoint=resume_from)
        # A model that generates: Trainer turns the cache off (TrainingArguments.use_cache) while training.
        trainer.model.config.use_cache = True
        if trainer.is_fsdp_enabled:  # sharded checkpoints while training, one loadable model at the end
            trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
        check_finite(trainer.model, f"the final model to {training_args.output_dir}")
        with final_writes(training_args.output_dir, "save the final model to"):
            try:
                trainer.save_model()  # tokenizer, model (safetensors, config); with --push_to_hub, the upload
            except HubUploadError as err:  # the folder is complete; said at the end, after the metrics and state
                upload_error = err
        metrics = train_result.metrics
        if not data_args.streaming:
            metrics["train_samples"] = len(train_dataset)
        trainer.log_metrics("train", metrics)
        with final_writes(training_args.output_dir, "write the training metrics and state into"):
            trainer.save_metrics("train", metrics)
            trainer.save_state()

    if training_args.do_eval:
        logger.info("*** Evaluate ***")
        metrics = trainer.evaluate()
        if not data_args.streaming:
            metrics["eval_samples"] = len(eval_dataset)
        try:
            metrics["perplexity"] = math.exp(metrics["eval_loss"])
        except OverflowError:
            metrics["perplexity"] = float("inf")
        trainer.log_metrics("eval", metrics)
        with final_writes(training_args.output_dir, "write the evaluation metrics into"):
            trainer.save_metrics("eval", metrics)
        if trainer.is_world_process_zero():
            print(f"eval_loss = {metrics['eval_loss']:.4f}  perplexity = {metrics['perplexity']:.2f}", flush=True)

    if upload_error is not None:
        raise upload_error
    return trainer


@contextlib.contextmanager
def final_writes(output_dir: str, what: str):
    """A failed write inside (a full disk: an OSError, safetensors' or torch.save's error) is one line naming
    `output_dir`, saying the result there is incomplete; other errors pass as they are."""
    try:
        yield
    except HubUploadError:
        raise
    except Exception as err:
        reason = write_failure(err, output_dir)
        if reason is None and not isinstance(err, OSError):
            raise
        raise TrainingError(
            f"could not {what} {output_dir}: {reason or one_line(err)}; what is there is incomplete (the checkpoints "
            "written before are kept): free space and run again to resume from the last one"
        ) from None


def accelerate_configs() -> list[str]:
    """The names of the accelerate configs installed with the package (`fsdp`, `multi_cpu_gloo`, ...)."""
    return sorted(path.stem for path in ACCELERATE_DIR.glob("*.yaml"))


def accelerate_config_path(name: str) -> Path:
    """The installed accelerate config `name` (`fsdp` or `fsdp.yaml`), or a DeepSpeed JSON (`ds_zero3.json`)."""
    path = ACCELERATE_DIR / (name if name.endswith((".yaml", ".json")) else f"{name}.yaml")
    if not path.is_file():
        names = accelerate_configs() + sorted(p.name for p in ACCELERATE_DIR.glob("*.json"))
        raise TrainingError(f"--print-accelerate-config {name}: no such config; the configs are: {', '.join(names)}")
    return path


def cli(argv=None) -> int:
    """The console script `dcformer-train`: `main`, with bad input and diverged runs said in one line (exit 2).
    `--print-accelerate-config NAME` prints the path of an installed accelerate config instead (`list`: the names)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["--print-accelerate-config"] or (argv and argv[0].startswith("--print-accelerate-config=")):
            name = argv[0].partition("=")[2] or (argv[1] if len(argv) > 1 else "list")
            if name == "list":
                print("\n".join(accelerate_configs()))
            else:
                print(accelerate_config_path(name))
            return 0
        main(argv)
    except TrainingError as err:  # bad input or a diverged run: one line, not a traceback
        print(f"error: {err}", file=sys.stderr)
        return 2
    except HubUploadError as err:  # --push_to_hub: only the upload failed, the output folder is complete
        print(f"error: {err.for_command_line()}", file=sys.stderr)
        return 3
    return 0


def _mp_fn(index):  # for xla_spawn (TPUs)
    main()


if __name__ == "__main__":
    sys.exit(cli())
