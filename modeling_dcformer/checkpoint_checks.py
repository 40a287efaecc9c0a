"""What a checkpoint must agree with its config, checked after `from_pretrained` has loaded it.

transformers only logs a load report when a checkpoint and its config disagree; for DCFormer that report hides
a changed function (a config with `use_qk_norm=False` silently skips the trained q/k norms). Here each tensor the
config leaves unused, lacks or shapes differently is traced back to the config field responsible, and a
tensor stored with an integer or boolean dtype, which transformers would cast to floats without a word, is
refused. Self-contained (standard library, torch, transformers) so that it travels with the remote code.
"""

import json
import os
import re
import struct
from collections import defaultdict
from pathlib import Path

import torch

from .released_format import IGNORED_RE

# Which config field decides whether a (native, "model."-free) tensor exists.
PRESENCE_FIELDS = [
    (re.compile(r"\.self_attn\.(q_norm|k_norm)\."), "use_qk_norm"),
    (re.compile(r"\.self_attn\.dyn_w_proj\."), "use_dcmha"),
    (re.compile(r"\.mlp\.gate_proj\."), "use_gated_mlp"),
    (re.compile(r"\.self_attn\.\w+\.bias$"), "attention_bias"),
    (re.compile(r"\.mlp\.\w+\.bias$"), "mlp_bias"),
    (re.compile(r"norm\.bias$"), "norm_type"),
]
# Which config fields decide a tensor's shape.
SHAPE_FIELDS = [
    (re.compile(r"\.self_attn\.dyn_w_proj\."), "query_wise, num_head_groups, dynamic_rank or dynamic_hidden_size"),
    (re.compile(r"\.self_attn\.(q_norm|k_norm)\."), "hidden_size / num_attention_heads (head_dim)"),
    (re.compile(r"\.self_attn\."), "hidden_size or num_attention_heads"),
    (re.compile(r"\.mlp\."), "intermediate_size or hidden_size"),
    (re.compile(r"embed_tokens\.|lm_head\."), "vocab_size or hidden_size"),
    (re.compile(r"norm\."), "hidden_size"),
]
LAYER = re.compile(r"^layers\.(\d+)\.")
OUR_TENSORS = re.compile(r"^(layers\.|embed_tokens\.|norm\.)")
# safetensors' dtype names that are not floating point.
NOT_FLOAT_SAFETENSORS = {"BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64"}


def _body_key(key: str) -> str:
    return key[len("model.") :] if key.startswith("model.") else key


def _first_field(table: list, key: str) -> str:
    """The field of the first pattern in `table` that `key` matches; "" if none does."""
    return next((field for pattern, field in table if pattern.search(key)), "")


def _presence_field(key: str, config) -> str:
    match = LAYER.match(key)
    if match and int(match.group(1)) >= config.num_hidden_layers:
        return "num_hidden_layers"
    return _first_field(PRESENCE_FIELDS, key)


def _listing(keys: list[str], limit: int = 4) -> str:
    keys = sorted(keys)
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


# The composition-slot dimension C of each dynamic weight: dw1 [D, G, C, K], qkw [G, C, K, 2I, M], dd [D, G, C*M].
SLOT_DIMS = {"dw1": 2, "qkw": 1, "dd": 2}


def _slot_count_differs(key: str, checkpoint_shape, model_shape, config) -> bool:
    """Whether a dynamic weight differs from the model's only by holding 4 slots against 2 (or 2 against 4)."""
    match = re.search(r"\.dyn_w_proj\.(dw1|qkw|dd)$", key)
    if not match or len(checkpoint_shape) != len(model_shape):
        return False
    dim = SLOT_DIMS[match.group(1)]
    ours, theirs = list(checkpoint_shape), list(model_shape)
    ratio = 2 if config.query_wise else 0.5  # checkpoint slots / model slots that query_wise explains
    return ours[:dim] + ours[dim + 1 :] == theirs[:dim] + theirs[dim + 1 :] and ours[dim] == ratio * theirs[dim]


def describe_mismatch(config, source, unexpected=(), missing=(), mismatched=()) -> str | None:
    """A message naming, per config field, the checkpoint's tensors that the config leaves unused (`unexpected`),
    lacks (`missing`) or shapes differently (`mismatched`: (key, checkpoint shape, model shape)); None if nothing
    concerns the DCFormer body (an `lm_head` left over when loading the base model is not a mismatch)."""
    unexpected = [key for key in map(_body_key, unexpected) if OUR_TENSORS.match(key)]
    problems = []
    by_field = defaultdict(list)
    for key in unexpected:
        by_field[_presence_field(key, config)].append(key)
    for field, keys in by_field.items():
        if field == "num_hidden_layers":
            layers = 1 + max(int(LAYER.match(key).group(1)) for key in keys)
            problems.append(
                f"num_hidden_layers is {config.num_hidden_layers} but the checkpoint has at least {layers} layers "
                f"({_listing(keys)})"
            )
        elif field == "norm_type":
            problems.append(f"norm_type is {config.norm_type!r} (no bias) but the checkpoint has norm biases ({_listing(keys)})")
        elif field:
            problems.append(
                f"{field} is {getattr(config, field)!r} but the checkpoint has tensors that only a model with "
                f"{field}={not getattr(config, field)!r} uses ({_listing(keys)})"
            )
        else:
            problems.append(f"the checkpoint has tensors this config does not use ({_listing(keys)})")
    by_field = defaultdict(list)
    for key in map(_body_key, missing):
        by_field[_presence_field(key, config)].append(key)
    for field, keys in by_field.items():
        if field in ("", "num_hidden_layers"):
            problems.append(f"the checkpoint lacks tensors the model needs ({_listing(keys)})")
        elif field == "norm_type":
            problems.append(f"norm_type is {config.norm_type!r} but the checkpoint has no norm biases ({_listing(keys)})")
        else:
            problems.append(
                f"{field} is {getattr(config, field)!r} but the checkpoint lacks the tensors it needs ({_listing(keys)})"
            )
    slot_keys, other = [], []
    for key, checkpoint_shape, model_shape in mismatched:
        key = _body_key(key)
        (slot_keys if _slot_count_differs(key, checkpoint_shape, model_shape, config) else other).append(
            (key, tuple(checkpoint_shape), tuple(model_shape))
        )
    if slot_keys:
        slots = "all four composition slots" if config.query_wise else "only the two query-wise slots"
        problems.append(
            f"query_wise is {config.query_wise!r} but the checkpoint stores {slots} "
            f"({_listing([f'{key} {ours} vs {theirs}' for key, ours, theirs in slot_keys], 2)}, checkpoint vs model)"
        )
    for key, checkpoint_shape, model_shape in other[:6]:
        field = _first_field(SHAPE_FIELDS, key)
        hint = f" (set by {field})" if field else ""
        problems.append(f"{key} has shape {checkpoint_shape} in the checkpoint but {model_shape} in the model{hint}")
    if len(other) > 6:
        problems.append(f"{len(other) - 6} more tensors of the wrong shape")
    if not problems:
        return None
    return f"checkpoint {str(source)!r} does not match its config: " + "; ".join(problems)


def _safetensors_header(path: Path) -> dict:
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    return header


def checkpoint_files(source, *, subfolder: str = "", **hub_kwargs) -> list[Path]:
    """The weight files of `source` (a local directory, or a Hub id whose files are already in the local cache
    after loading); empty when they cannot be found without a download."""
    if source is None:
        return []
    if os.path.isdir(source):
        folder = Path(source, subfolder or "")

        def resolve(name):
            return folder / name if (folder / name).is_file() else None

    else:
        from transformers.utils import cached_file

        options = {k: hub_kwargs[k] for k in ("revision", "cache_dir", "token") if hub_kwargs.get(k) is not None}

        def resolve(name):
            try:
                path = cached_file(
                    str(source), name, subfolder=subfolder or "", local_files_only=True,
                    _raise_exceptions_for_missing_entries=False, **options,
                )
            except Exception:  # noqa: BLE001 - not in the cache: nothing to check here
                return None
            return Path(path) if path else None

    for index_name, single_name in (
        ("model.safetensors.index.json", "model.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model.bin"),
    ):
        if (index := resolve(index_name)) is not None:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return [path for shard in shards if (path := resolve(shard)) is not None]
        if (single := resolve(single_name)) is not None:
            return [single]
    return []


def non_float_tensors(files: list[Path]) -> dict[str, str]:
    """{key: dtype} of the tensors stored with an integer or boolean dtype (derived tensors of the released layout,
    such as its boolean causal mask, excepted)."""
    bad = {}
    for path in files:
        if path.suffix == ".safetensors":
            for key, entry in _safetensors_header(path).items():
                if entry["dtype"] in NOT_FLOAT_SAFETENSORS and not IGNORED_RE.search(key):
                    bad[key] = entry["dtype"]
        else:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            for key, tensor in state.items():
                if torch.is_tensor(tensor) and not tensor.is_floating_point() and not IGNORED_RE.search(key):
                    bad[key] = str(tensor.dtype)
    return bad


def check_dtypes(source, files: list[Path]) -> None:
    bad = non_float_tensors(files)
    if bad:
        listing = _listing([f"{key} ({dtype})" for key, dtype in bad.items()])
        raise ValueError(
            f"checkpoint {str(source)!r} stores weights with a non-floating dtype, which loading would cast to floats "
            f"without meaning: {listing}; the file is corrupt or not a DCFormer checkpoint"
        )
