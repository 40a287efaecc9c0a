"""The authors' released checkpoint layout (Caiyun-AI/DCPythia-6.9B, Caiyun-AI/DCFormer-2.8B) and its
translation to ours: config keys, state-dict keys, and the derived tensors that are never used.

See `shared/DCMHA.md`, sections "Released configuration keys" and "Released state-dict keys".
"""

import re

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
# Body of each released model_type (DCMHA.md, "Bodies").
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


def is_released_config(config_dict: dict) -> bool:
    """A config in the authors' key names (`dim`, `n_layer`, `n_head`) rather than ours."""
    return "dim" in config_dict and "n_layer" in config_dict and "hidden_size" not in config_dict


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
    if "intermediate_size" not in config_dict:
        raise ValueError("released config: intermediate_size is missing")

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


def state_dict_renames(use_gated_mlp: bool) -> list[tuple[str, str]]:
    """(regex on a released key, replacement giving our key in `DCFormerForCausalLM`), prefix-free keys."""
    layer = r"^layers\.(\d+)\."
    ours = r"model.layers.\1."
    return [
        (r"^tok_embeddings\.weight$", "model.embed_tokens.weight"),
        (layer + r"attention\.wqkv\.(weight|bias)$", ours + r"self_attn.qkv_proj.\2"),
        (layer + r"attention\.wo\.(weight|bias)$", ours + r"self_attn.o_proj.\2"),
        (layer + r"attention\.dyn_w_proj\.(dw1|qkw|dd)$", ours + r"self_attn.dyn_w_proj.\2"),
        (layer + r"attention\.(q_norm|k_norm)\.scale$", ours + r"self_attn.\2.weight"),
        (layer + r"attention_norm\.(weight|bias)$", ours + r"input_layernorm.\2"),
        (layer + r"ffn_norm\.(weight|bias)$", ours + r"post_attention_layernorm.\2"),
        (layer + r"feed_forward\.w1\.(weight|bias)$", ours + (r"mlp.gate_proj.\2" if use_gated_mlp else r"mlp.up_proj.\2")),
        (layer + r"feed_forward\.w2\.(weight|bias)$", ours + r"mlp.down_proj.\2"),
        (layer + r"feed_forward\.w3\.(weight|bias)$", ours + r"mlp.up_proj.\2"),
        (r"^norm\.(weight|bias)$", r"model.norm.\1"),
        (r"^output\.weight$", "lm_head.weight"),
    ]


# Split q/k/v projections, concatenated (all q, then all k, then all v) into our fused qkv_proj.
SPLIT_QKV = re.compile(r"^layers\.(\d+)\.attention\.(wq|wk|wv)\.(weight|bias)$")
# Derived tensors of the released files: recomputed or ignored, never used (DCMHA.md).
IGNORED = [
    r"dyn_w_proj\.(dw_m|qkw_m)$",  # merged copies, possibly stale
    r"dyn_w_proj\.(pre_proj|post_proj)\.w$",  # identity static weights (checked by the converter)
    r"(^|\.)kv_cache\.",  # decode buffers
    r"(^|\.)freqs_cis$",
    r"(^|\.)causal_mask$",
]
IGNORED_RE = re.compile("|".join(f"(?:{p})" for p in IGNORED))


def native_key(released_key: str, use_gated_mlp: bool) -> str | None:
    """Our key for a released key; None for an ignored derived tensor. Split wq/wk/wv keys are returned
    unchanged (the caller concatenates them). Raises KeyError for a key that is neither."""
    if IGNORED_RE.search(released_key) or SPLIT_QKV.match(released_key):
        return None if IGNORED_RE.search(released_key) else released_key
    for pattern, replacement in state_dict_renames(use_gated_mlp):
        if re.match(pattern, released_key):
            return re.sub(pattern, replacement, released_key)
    raise KeyError(released_key)
