"""What a checkpoint must agree with its config, checked when `from_pretrained` loads it (travels as remote code).

transformers only logs a report when a checkpoint and its config disagree, which hides a changed function (a config
with `use_qk_norm=False` skips the trained q/k norms). Here each tensor the config leaves unused, lacks or shapes
differently is traced to the config field responsible; integer tensors where floats are meant (transformers would
cast them) and unreadable weight files are one clear error each. Two more, for a local folder: weight files outside
it (a shard index naming "../x" or an absolute path, which transformers follows) are refused before they are read,
and a load whose config.json and weights come from two saves of the folder (`check_same_save`, by the `save_id` of
each save) is an error, not a model.
"""

import json
import os
import re
import struct
from collections import defaultdict
from pathlib import Path

import torch

from .configuration_dcformer import PACKAGE

# Which config field decides whether a (native, "model."-free) tensor exists.
PRESENCE_FIELDS = [
    (re.compile(r"\.self_attn\.(q_norm|k_norm)\."), "use_qk_norm"),
    (re.compile(r"\.self_attn\.dyn_w_proj\."), "use_dcmha"),
    (re.compile(r"\.mlp\.gate_proj\."), "use_gated_mlp"),
    (re.compile(r"\.self_attn\.o_proj\.bias$"), "attention_output_bias (or attention_bias)"),
    (re.compile(r"\.self_attn\.\w+\.bias$"), "attention_bias"),
    (re.compile(r"\.mlp\.\w+\.bias$"), "mlp_bias"),
    (re.compile(r"norm\.bias$"), "norm_type"),
]
# Which config fields decide a tensor's shape.
SHAPE_FIELDS = [
    (re.compile(r"\.self_attn\.dyn_w_proj\."), "query_wise, num_head_groups, dynamic_rank or dynamic_hidden_size"),
    (re.compile(r"\.self_attn\.(q_norm|k_norm)\."), "head_dim (or hidden_size / num_attention_heads)"),
    (re.compile(r"\.self_attn\."), "hidden_size, num_attention_heads, num_key_value_heads or head_dim"),
    (re.compile(r"\.mlp\."), "intermediate_size or hidden_size"),
    (re.compile(r"embed_tokens\.|lm_head\."), "vocab_size or hidden_size"),
    (re.compile(r"norm\."), "hidden_size"),
]
LAYER = re.compile(r"^layers\.(\d+)\.")
OUR_TENSORS = re.compile(r"^(layers\.|embed_tokens\.|norm\.)")
# safetensors' dtype names that are not floating point.
NOT_FLOAT_SAFETENSORS = {"BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64"}


def _first_field(table: list, key: str) -> str:
    """The field of the first pattern in `table` that `key` matches; "" if none does."""
    return next((field for pattern, field in table if pattern.search(key)), "")


def listing(keys: list[str], limit: int = 4) -> str:
    """The first `limit` of `keys`, sorted, and how many more: for one-line messages."""
    keys = sorted(keys)
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def _presence_problem(config, field: str, keys: list[str], unused: bool) -> str:
    """What is wrong with the checkpoint's `keys`, which the config leaves `unused` (else: lacks), by `field`."""
    names, value = listing(keys), getattr(config, field, None)
    if field == "num_hidden_layers" and unused:
        layers = 1 + max(int(LAYER.match(key).group(1)) for key in keys)
        return f"num_hidden_layers is {value} but the checkpoint has at least {layers} layers ({names})"
    if field in ("", "num_hidden_layers"):
        return f"the checkpoint has tensors this config does not use ({names})" if unused else (
            f"the checkpoint lacks tensors the model needs ({names})")
    if field == "norm_type":
        return f"norm_type is {value!r}{' (no bias)' if unused else ''} but the checkpoint has " + (
            f"{'' if unused else 'no '}norm biases ({names})")
    if unused:
        return (f"{field} is {value!r} but the checkpoint has tensors that only a model with {field}={not value!r} "
                f"uses ({names})")
    return f"{field} is {value!r} but the checkpoint lacks the tensors it needs ({names})"


# The composition-slot dimension C of each dynamic weight: dw1 [D, G, C, K], qkw [G, C, K, 2I, M], dd [D, G, C*M].
SLOT_DIMS = {"dw1": 2, "qkw": 1, "dd": 2}


def _slot_count_differs(key: str, ours: tuple, theirs: tuple, config) -> bool:
    """Whether a dynamic weight differs from the model's only by holding 4 slots against 2 (or 2 against 4): `ours`
    is the checkpoint's shape, `theirs` the model's."""
    match = re.search(r"\.dyn_w_proj\.(dw1|qkw|dd)$", key)
    if not match or len(ours) != len(theirs):
        return False
    dim = SLOT_DIMS[match.group(1)]
    ratio = 2 if config.query_wise else 0.5  # checkpoint slots / model slots that query_wise explains
    return ours[:dim] + ours[dim + 1 :] == theirs[:dim] + theirs[dim + 1 :] and ours[dim] == ratio * theirs[dim]


def describe_mismatch(config, source, unexpected=(), missing=(), mismatched=()) -> str | None:
    """A message naming, per config field, the checkpoint's tensors that the config leaves unused (`unexpected`),
    lacks (`missing`) or shapes differently (`mismatched`: (key, checkpoint shape, model shape)); None if nothing
    concerns the DCFormer body (an `lm_head` left over when loading the base model is not a mismatch)."""
    unexpected = [key.removeprefix("model.") for key in unexpected]
    foreign = [key for key in unexpected if not OUR_TENSORS.match(key) and not key.startswith("lm_head.")]
    unexpected = [key for key in unexpected if OUR_TENSORS.match(key)]
    missing = [key.removeprefix("model.") for key in missing]
    problems = []
    if missing and foreign:  # tensors the model does not know, in place of some it needs: name them first
        problems.append(f"the checkpoint has tensors that are not DCFormer's ({listing(foreign)})")
    if {"embed_tokens.weight", "norm.weight"} <= set(missing):
        # neither end of the model: not a checkpoint of it at all, which no config field explains
        problems.append(f"the checkpoint lacks {len(missing)} of the model's tensors ({listing(missing)})")
        missing = []
    for keys, unused in ((unexpected, True), (missing, False)):
        by_field = defaultdict(list)
        for key in keys:  # a layer beyond num_hidden_layers, else the field that decides whether the tensor exists
            layer = LAYER.match(key)
            beyond = layer is not None and int(layer.group(1)) >= config.num_hidden_layers
            by_field["num_hidden_layers" if beyond else _first_field(PRESENCE_FIELDS, key)].append(key)
        problems += [_presence_problem(config, field, keys, unused) for field, keys in by_field.items()]
    mismatched = [(key.removeprefix("model."), tuple(ours), tuple(theirs)) for key, ours, theirs in mismatched]
    slot_keys = [entry for entry in mismatched if _slot_count_differs(*entry, config)]
    other = [entry for entry in mismatched if entry not in slot_keys]
    if slot_keys:
        slots = "all four composition slots" if config.query_wise else "only the two query-wise slots"
        problems.append(
            f"query_wise is {config.query_wise!r} but the checkpoint stores {slots} "
            f"({listing([f'{key} {ours} vs {theirs}' for key, ours, theirs in slot_keys], 2)}, checkpoint vs model)"
        )
    for key, checkpoint_shape, model_shape in other[:6]:
        field = _first_field(SHAPE_FIELDS, key)
        hint = f" (set by {field})" if field else ""
        problems.append(f"{key} has shape {checkpoint_shape} in the checkpoint but {model_shape} in the model{hint}")
    if len(other) > 6:
        problems.append(f"{len(other) - 6} more tensors of the wrong shape")
    return f"checkpoint {str(source)!r} does not match its config: " + "; ".join(problems) if problems else None


# DCFormer's own tensor names: ours ("model." optional, lm_head); the released layout's where the package reads it.
OUR_KEY = r"^(model\.)?(layers\.\d+\.|embed_tokens\.|norm\.)|^lm_head\."
# Tensors no quantizer of transformers replaces (bitsandbytes and torchao quantize nn.Linear weights, with options the
# embeddings and the output head): norms, biases and the dynamic-weight generator's raw parameters dw1/qkw/dd (not
# nn.Linear: they stay in the compute dtype). Integers there are corrupt even in a quantized checkpoint.
ALWAYS_FLOAT = re.compile(r"(norm|layernorm)\.(weight|bias|scale)$|\.bias$|dyn_w_proj\.(dw1|qkw|dd)$")


def integers_meant(key: str, quantized: bool) -> bool:
    """Whether an integer or boolean tensor stored under `key` can be meant: a derived tensor of the released layout
    (such as its boolean causal mask), a quantizer's tensor in a quantized checkpoint (the packed weights and their
    scales, zero points and states; not the norms, biases or dynamic weights), or a tensor outside DCFormer's names,
    which the model does not load (reported as unexpected by `describe_mismatch`)."""
    released = PACKAGE.released  # its derived tensors (a boolean causal mask) are meant; its names are DCFormer's
    if released is not None and released.IGNORED_RE.search(key):
        return True
    if not re.search(OUR_KEY, key) and not (released is not None and released.is_released_key(key)):
        return True
    return quantized and not ALWAYS_FLOAT.search(key)


def non_float_tensors(files: list[Path], quantized: bool = False) -> dict[str, str]:
    """{key: dtype} of the tensors stored with an integer or boolean dtype where floats are meant (see
    `integers_meant`). A file that cannot be read is skipped: transformers' loading reports it."""
    bad = {}
    for path in map(Path, files):
        if path.suffix == ".safetensors":
            try:  # the header: 8 bytes of length, then JSON
                with open(path, "rb") as handle:
                    header = json.loads(handle.read(struct.unpack("<Q", handle.read(8))[0]))
            except (OSError, ValueError, struct.error):
                continue
            bad.update({key: entry["dtype"] for key, entry in header.items() if key != "__metadata__"
                        and entry["dtype"] in NOT_FLOAT_SAFETENSORS and not integers_meant(key, quantized)})
        else:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            bad.update({key: str(tensor.dtype) for key, tensor in state.items() if torch.is_tensor(tensor)
                        and not tensor.is_floating_point() and not integers_meant(key, quantized)})
    return bad


def files_outside(source, files: list) -> list[str]:
    """The weight `files` transformers resolved for the local folder `source` that lie outside it, judged by their
    paths as written (".." and absolute shard names; a symbolic link inside the folder stays the folder owner's, as
    every file of a Hub cache snapshot is); none for a Hub id."""
    if source is None or not os.path.isdir(source):
        return []
    root = os.path.abspath(source)

    def inside(path: str) -> bool:
        try:
            return os.path.commonpath([root, os.path.abspath(path)]) == root
        except ValueError:  # another drive (Windows)
            return False

    return [str(file) for file in files if not inside(file)]


def check_dtypes(source, files: list, quantized: bool = False) -> None:
    """Refuses a checkpoint storing integer or boolean tensors where floats are meant (loading would cast them to
    floats without a word). A quantized checkpoint (`quantized`: transformers loads it with a quantizer) stores its
    quantized weights as integers: those are meant. First, before any of them is read here or by the load: weight
    files outside the local folder `source` (`files_outside`)."""
    outside = files_outside(source, files)
    if outside:
        raise ValueError(f"checkpoint {str(source)!r}: its shard index names weight files outside the folder "
                         f"({listing(outside)}); refused: a shard must be a file of the checkpoint's folder")
    bad = non_float_tensors(files, quantized=quantized)
    if bad:
        names = listing([f"{key} ({dtype})" for key, dtype in bad.items()])
        raise ValueError(f"checkpoint {str(source)!r} stores weights with a non-floating dtype, which loading would "
                         f"cast to floats without meaning: {names}; the file is corrupt or not a DCFormer checkpoint")


SAVE_ID_KEY = "save_id"  # config.json's id of each save by the package; its shard index carries it too


def _saved_id(config_file: Path) -> str | None:
    """The `save_id` the config.json `config_file` holds now; None if none, or no readable file."""
    try:
        content = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return content.get(SAVE_ID_KEY) if isinstance(content, dict) else None


def check_same_save(config, load_config) -> None:
    """Refuses a load of a local folder whose config and weights come from two saves (the folder saved again, whole,
    while a reader without the package's lock read it: the config before, the weights after). `config.save_id` (the
    config the model was built from) must equal the `save_id` of the shard index transformers read
    (`load_config.sharded_metadata`) and of the folder's config.json when this runs; called before and after the
    weights are read, the second call proves them read from the same save (a save never comes back). A save without
    ids (an older one, transformers' own) or a Hub id is not checked: the Hub's files come from one commit."""
    expected = getattr(config, SAVE_ID_KEY, None)
    source = getattr(load_config, "pretrained_model_name_or_path", None)
    if not expected or source is None or not os.path.isdir(source):
        return
    subfolder = (getattr(load_config, "download_kwargs", None) or {}).get("subfolder") or ""
    folder = Path(source, subfolder)
    now = _saved_id(folder / "config.json")
    if now not in (None, expected):
        raise OSError(f"config.json and the weights come from different saves of {folder} (save_id {expected} in the "
                      f"config loaded, {now} in its config.json now): it was saved again during this load, load again "
                      "(a config of another save given on purpose: set its save_id to None)")
    index_id = (getattr(load_config, "sharded_metadata", None) or {}).get(SAVE_ID_KEY)
    if index_id not in (None, expected):
        raise OSError(f"config.json and the weights come from different saves of {folder}: the config loaded has "
                      f"save_id {expected} but its shard index {index_id}; if it was being saved, load again, else "
                      "save the model there again")
