"""The authors' released checkpoint layout (Caiyun-AI/DCPythia-6.9B, Caiyun-AI/DCFormer-2.8B) and its
translation to ours: config keys, state-dict keys, and the derived tensors that are never used.

See `docs/spec.md`, sections "Released configuration keys" and "Released state-dict keys". Installed package only
(`PACKAGE.released` of the flat modules): a save's remote code is in our names and does not carry this module.
"""

import re

from ..configuration_dcformer import DCFormerConfig, is_released_config

# Released config key -> our attribute.
CONFIG_RENAMES = {
    "dim": "hidden_size",
    "n_layer": "num_hidden_layers",
    "n_head": "num_attention_heads",
    "intermediate_size": "intermediate_size",
    "vocab_size": "vocab_size",
    "block_size": "max_position_embeddings",
    "rope_base": "rope_theta",
    "rotary_pct": "partial_rotary_factor",
    "norm_eps": "layer_norm_eps",
    "use_qk_norm": "use_qk_norm",
    "window_size": "window_size",
    "window_type": "window_type",
    "query_wise": "query_wise",
    "use_dcmha": "use_dcmha",
    "use_parallel_residual": "use_parallel_residual",
    "tie_word_embeddings": "tie_word_embeddings",
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "pad_token_id": "pad_token_id",
}
# Keys of the released files that only matter to the authors' training or remote code.
DROPPED_KEYS = (
    "is_training",
    "q_chunk_size",
    "use_gradient_checkpointing",
    "head_dim",  # recomputed as dim // n_head, as the released code does (the file's value may be stale)
    "n_local_heads",  # checked: must equal n_head
    "use_linear_bias",  # -> attention_bias and mlp_bias
    "auto_map",  # the authors' remote code; ours is native
    "architectures",
    "model_type",
)
# Body of each released model_type (docs/spec.md, "Bodies").
BODIES = {
    "dcpythia": dict(
        norm_type="layernorm", use_parallel_residual=True, hidden_act="gelu", use_gated_mlp=False,
        attention_bias=True, mlp_bias=True, partial_rotary_factor=0.25, layer_norm_eps=1e-5,
    ),
    "dcformer": dict(
        norm_type="rmsnorm", use_parallel_residual=False, hidden_act="silu", use_gated_mlp=True,
        attention_bias=False, mlp_bias=False, partial_rotary_factor=1.0, layer_norm_eps=1e-6,
    ),
}
# The official code's named window patterns use a 256-key window whatever window_size says.
OFFICIAL_PATTERN_WINDOW = 256


def translate_released_config(config_dict: dict) -> dict:
    """Released config dict (model_type "dcpythia" or "dcformer") -> kwargs of `DCFormerConfig`.

    Unknown extra keys are kept as they are; impossible values raise a ValueError naming the released key.
    """
    model_type = config_dict.get("model_type", "dcpythia")
    if model_type not in BODIES:
        raise ValueError(f"model_type {model_type!r} is not a released DCFormer type ({', '.join(BODIES)})")
    for key in ("dim", "n_layer", "n_head"):
        value = config_dict.get(key)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"released config key {key!r} must be a positive integer, got {value!r}")
    dim, n_head = config_dict["dim"], config_dict["n_head"]
    if dim % n_head:
        raise ValueError(f"released config: dim ({dim}) is not divisible by n_head ({n_head})")
    n_local_heads = config_dict.get("n_local_heads", -1)
    if n_local_heads not in (-1, None, n_head):
        raise ValueError(
            f"released config: n_local_heads ({n_local_heads}) differs from n_head ({n_head}); grouped-query "
            "attention is not part of any released DCFormer and is not supported"
        )
    if config_dict.get("mgate"):
        raise ValueError("released config: mgate=True (gated MLP chunks) is not supported by this implementation")
    if config_dict.get("intermediate_size") is None:
        # The released code's default: 2/3 of 4 * dim, rounded up to a multiple of 256.
        config_dict = dict(config_dict, intermediate_size=-(-int(8 * dim / 3) // 256) * 256)

    ours = dict(BODIES[model_type])
    if "use_linear_bias" in config_dict:
        ours["attention_bias"] = ours["mlp_bias"] = bool(config_dict["use_linear_bias"])
    for key, value in config_dict.items():
        if key in CONFIG_RENAMES:
            if value is not None or key in ("window_size", "window_type", "pad_token_id"):
                ours[CONFIG_RENAMES[key]] = value
        elif key not in DROPPED_KEYS and not key.startswith("_"):
            ours[key] = value  # unknown extra keys are kept
    if ours.get("window_type") is not None and ours.get("window_size") is None:
        ours["window_size"] = OFFICIAL_PATTERN_WINDOW
    if ours.get("window_size") is not None and ours["window_size"] >= ours.get("max_position_embeddings", 2048):
        ours["window_size"] = None  # a window covering every position is a global layer
    if "rope_theta" not in ours:
        ours["rope_theta"] = 10000.0
    ours["released_model_type"] = model_type
    return ours


def key_renames(use_gated_mlp: bool) -> list[tuple[str, str]]:
    """Renames from a released (prefix-free) key to ours, each (regex, replacement of the matched part),
    applied in turn. The released MLP's `w1` is our `gate_proj` in the gated body and `up_proj` otherwise.
    Keys of the base model then take the prefix `model.` in `DCFormerForCausalLM` (see `native_key`)."""
    return [
        (r"^tok_embeddings", "embed_tokens"),
        (r"attention\.wqkv", "self_attn.qkv_proj"),
        (r"attention\.wo", "self_attn.o_proj"),
        (r"attention\.dyn_w_proj", "self_attn.dyn_w_proj"),
        (r"attention\.q_norm\.scale", "self_attn.q_norm.weight"),
        (r"attention\.k_norm\.scale", "self_attn.k_norm.weight"),
        (r"attention_norm", "input_layernorm"),
        (r"ffn_norm", "post_attention_layernorm"),
        (r"feed_forward\.w1", "mlp.gate_proj" if use_gated_mlp else "mlp.up_proj"),
        (r"feed_forward\.w2", "mlp.down_proj"),
        (r"feed_forward\.w3", "mlp.up_proj"),
        (r"^output", "lm_head"),
    ]


def query_wise_slots(key: str, tensor, heads_per_group: int):
    """The released code stores all four composition slots even when `query_wise` is on; our query-wise model
    keeps only the query slots (pre-query, post-query) = slots 0 and 2. Returns the tensor with those slots,
    or the tensor unchanged if it already has two."""
    if key.endswith("dyn_w_proj.dw1") and tensor.shape[2] == 4:  # [D, G, C, K]
        return tensor[:, :, 0::2].contiguous()
    if key.endswith("dyn_w_proj.qkw") and tensor.shape[1] == 4:  # [G, C, K, 2I, M]
        return tensor[:, 0::2].contiguous()
    if key.endswith("dyn_w_proj.dd") and tensor.shape[2] == 4 * heads_per_group:  # [D, G, C*M]
        D, G, M = tensor.shape[0], tensor.shape[1], heads_per_group
        return tensor.view(D, G, 4, M)[:, :, 0::2].reshape(D, G, 2 * M).contiguous()
    return tensor


# Split q/k/v projections, concatenated (all q, then all k, then all v) into our fused qkv_proj.
SPLIT_QKV = re.compile(r"^layers\.(\d+)\.attention\.(wq|wk|wv)\.(weight|bias)$")
# Derived tensors of the released files: recomputed or ignored, never used (docs/spec.md).
IGNORED = [
    r"dyn_w_proj\.(dw_m|qkw_m)$",  # merged copies, possibly stale
    r"dyn_w_proj\.(pre_proj|post_proj)\.w$",  # identity static weights (checked by the converter)
    r"(^|\.)kv_cache\.",  # decode buffers
    r"(^|\.)freqs_cis$",
    r"(^|\.)causal_mask$",
]
IGNORED_RE = re.compile("|".join(f"(?:{p})" for p in IGNORED))


def native_key(released_key: str, use_gated_mlp: bool) -> str | None:
    """Our `DCFormerForCausalLM` key for a released key; None for an ignored derived tensor. Split wq/wk/wv
    keys are returned unchanged (the caller concatenates them). Raises KeyError for any other key."""
    if IGNORED_RE.search(released_key):
        return None
    if SPLIT_QKV.match(released_key):
        return released_key
    key = released_key
    for pattern, replacement in key_renames(use_gated_mlp):
        key = re.sub(pattern + r"(?!\w)", replacement, key, count=1)
    if not re.fullmatch(RELEASED_KEY, released_key):
        raise KeyError(released_key)
    return key if key.startswith("lm_head.") else "model." + key


def is_released_key(key: str) -> bool:
    """Whether `key` names a tensor of the released layout (a derived tensor of `IGNORED` excepted)."""
    return bool(re.fullmatch(RELEASED_KEY, key) or SPLIT_QKV.match(key))


# Every key of the released layout (besides the split q/k/v and the ignored derived tensors).
RELEASED_KEY = (
    r"tok_embeddings\.weight|output\.weight|norm\.(weight|bias)"
    r"|layers\.\d+\.(attention\.(wqkv|wo)\.(weight|bias)|attention\.dyn_w_proj\.(dw1|qkw|dd)"
    r"|attention\.(q_norm|k_norm)\.scale|(attention_norm|ffn_norm)\.(weight|bias)"
    r"|feed_forward\.w[123]\.(weight|bias))"
)


_registered_body: tuple | None = None


def key_wise_slots_used(key: str, tensor, heads_per_group: int) -> bool:
    """Whether the key-wise slots (1 and 3) of a released 4-slot dynamic weight hold anything but zeros."""
    if key.endswith("dyn_w_proj.dw1"):  # [D, G, C, K]
        dropped = tensor[:, :, 1::2]
    elif key.endswith("dyn_w_proj.qkw"):  # [G, C, K, 2I, M]
        dropped = tensor[:, 1::2]
    else:  # dd [D, G, C*M]
        D, G = tensor.shape[:2]
        dropped = tensor.reshape(D, G, 4, heads_per_group)[:, :, 1::2]
    return bool(dropped.count_nonzero())


def warn_dropped_key_slots(key: str, tensor, config) -> None:
    """A released config.json saying `query_wise: true` over four stored slots whose key-wise ones are non-zero.

    It cannot be refused: the released layout stores all four composition slots whatever `query_wise` says (the
    authors' code allocates four and, when query-wise, reads only the query slots 0 and 2), so a model trained
    query-wise and a config.json edited from false to true hold the same kind of files, and the file's own value is
    the only record there is. Both load as the authors' code computes them. The key-wise weights this drops are said
    once per checkpoint, so an edit that changes the function is not silent."""
    from transformers.utils import logging

    if not key_wise_slots_used(key, tensor, config.heads_per_group):
        return
    source = getattr(config, "_name_or_path", "") or "the checkpoint"
    logging.get_logger(__name__).warning_once(
        f"query_wise is true in the config.json of {source}, so the key-wise composition weights it stores (slots 1 "
        "and 3 of the dynamic weights dw1, qkw, dd: non-zero) are not used; if that config.json was edited from query_wise: false, restore it: "
        "this loads a different function"
    )


def register_released_layout(model_type: str, use_gated_mlp: bool) -> None:
    """Teach transformers' load-time weight conversion the released key names for a body, so that
    `from_pretrained` reads released checkpoints directly (called before each load; registered again only when the
    body changes: the released MLP's `w1` is our `gate_proj` in the gated body and `up_proj` otherwise). Only
    released names match these patterns; ours load unchanged. A query-wise model keeps the query slots of a released
    4-slot dynamic weight (the conversion reads the model's config)."""
    global _registered_body
    if _registered_body == (model_type, use_gated_mlp):
        return
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping
    from transformers.core_model_loading import Concatenate, ConversionOps, WeightConverter, WeightRenaming

    class QueryWiseSlots(ConversionOps):
        """Keeps the query slots of a released 4-slot dynamic weight for a query-wise model."""

        def convert(self, input_dict, source_patterns, target_patterns, config=None, **kwargs):
            (tensors,) = input_dict.values()
            tensor = tensors[0] if isinstance(tensors, list) else tensors
            # only for the released layout (its config carries `released_model_type`): a native checkpoint with four
            # slots under a query-wise config is a mismatch, reported by name (checkpoint_checks.py)
            if config is not None and config.query_wise and getattr(config, "released_model_type", None):
                kept = query_wise_slots(target_patterns[0], tensor, config.heads_per_group)
                if kept.numel() < tensor.numel():
                    warn_dropped_key_slots(target_patterns[0], tensor, config)
                tensor = kept
            return {target_patterns[0]: tensor}

    mapping = [WeightRenaming(source, target) for source, target in key_renames(use_gated_mlp)]
    mapping.append(
        WeightConverter(
            [r"attention\.wq", r"attention\.wk", r"attention\.wv"], "self_attn.qkv_proj", operations=[Concatenate(dim=0)]
        )
    )
    for name in ("dw1", "qkw", "dd"):
        mapping.append(WeightConverter(rf"dyn_w_proj\.{name}", f"dyn_w_proj.{name}", operations=[QueryWiseSlots()]))
    register_checkpoint_conversion_mapping(model_type, mapping, overwrite=True)
    _registered_body = (model_type, use_gated_mlp)


def check_query_wise(config, source, hub_kwargs: dict) -> None:
    """A query-wise `config` given for a released checkpoint, whose layout stores four composition slots either way:
    only the checkpoint's own config tells whether its key-wise slots were trained (then a query-wise model would
    drop them)."""
    if config.query_wise and getattr(config, "released_model_type", None):
        if not DCFormerConfig.from_pretrained(source, **hub_kwargs).query_wise:
            raise ValueError(
                f"query_wise is True but checkpoint {str(source)!r} was trained with query_wise=False: a query-wise "
                "model would drop its key-wise composition weights; load it with its own config"
            )


class DCPythiaConfig(DCFormerConfig):
    """model_type "dcpythia" of the released Caiyun-AI/DCPythia-6.9B: loading such a config gives the
    equivalent `DCFormerConfig` (our names, model_type "dcformer")."""

    model_type = "dcpythia"

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        config_dict = dict(config_dict)
        config_dict.setdefault("model_type", "dcpythia")
        if not is_released_config(config_dict):
            raise ValueError("a model_type 'dcpythia' config must carry the released keys dim, n_layer, n_head")
        return DCFormerConfig.from_dict(config_dict, **kwargs)
