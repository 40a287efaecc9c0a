"""The authors' released checkpoints (Caiyun-AI/DCPythia-6.9B, Caiyun-AI/DCFormer-2.8B) load natively.

Every checkpoint here is built by `tests/released_checkpoint.py` straight from the spec's released key list and
shapes (never from our model), with random non-zero dynamic weights, garbage in the merged copies `dw_m`/`qkw_m`,
identity `pre_proj.w`/`post_proj.w` buffers, local windows smaller than the test sequences, and an `auto_map` to
remote code that does not exist. `released_oracle_logits` below reads those tensors by their released names and
computes the spec's maths in float64 (from `tests/oracle.py` it borrows only the composition and dynamic-weight
functions and the elementwise helpers); our model must match it to 1e-4 in fp32, in prefill and in token-by-token
decoding. The fixtures' scales keep fp32 rounding near 2e-5 while every composition term, and a window one key
wider, move the logits by O(1) (`test_oracle_comparison_can_fail`).
"""

import json
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import modeling_dcformer  # noqa: F401  (registers the auto classes: nothing below needs trust_remote_code)
from modeling_dcformer.conversion import common
from modeling_dcformer.conversion import released as released_converter
from modeling_dcformer import DCFormerConfig, DCFormerForCausalLM, DCPythiaConfig, publishing
from oracle import gelu_exact, layer_norm, oracle_compose, oracle_dynamic_weights, rms_norm, silu, softmax_last
from released_checkpoint import (
    RANK,
    TOKENIZER_FILES,
    body_of,
    released_config,
    released_dir,
    released_state_dict,
    write_released_checkpoint,
)

ROOT = Path(__file__).resolve().parent.parent
ATOL = 1e-4
QK_NORM_EPS = 1e-6
# The official named window patterns (docs/spec.md, windows); None with a window_size means "LG".
PATTERNS = {None: "LG", "LG": "LG", "LGLL": "LGLL", "LGL6": "LGLLLLLL"}


# ------------------------------------------------------------------------------------------------------------
# An independent oracle over the *released* tensor names (docs/spec.md), float64
# ------------------------------------------------------------------------------------------------------------
def oracle_windows(cfg: dict) -> list[int | None]:
    """Per-layer window of a released config: window_size keys on local layers, None on global ones."""
    window = cfg.get("window_size")
    if window is None:
        return [None] * cfg["n_layer"]
    pattern = PATTERNS[cfg.get("window_type")]
    return [window if pattern[i % len(pattern)] == "L" else None for i in range(cfg["n_layer"])]


def rotate_half_prefix(x: torch.Tensor, rot: int, base: float) -> torch.Tensor:
    """GPT-NeoX rotate-half rotary on the first `rot` dims of x [B, N, T, Dh], absolute positions 0..T-1."""
    if rot == 0:
        return x
    T = x.shape[2]
    inv_freq = 1.0 / base ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)  # [rot/2]
    angle = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None, :]  # [T, rot/2]
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)  # [T, rot]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], -1)
    return torch.cat([x_rot * cos + rotated * sin, x_pass], -1)


def oracle_attention(x, sd, prefix, cfg, window, window_offset=0):
    """DCMHA of one layer from the released tensors `prefix + wqkv|wq/wk/wv|wo|dyn_w_proj.*|q_norm|k_norm`.

    `window_offset` widens the window by that many keys (to show the off-by-one of the official prefill mask,
    t - W <= s, would be detected)."""
    B, T, D = x.shape
    N = cfg["n_head"]
    Dh = D // N  # never the config file's stale head_dim
    body = body_of(cfg)
    if prefix + "wqkv.weight" in sd:
        w, b = sd[prefix + "wqkv.weight"], sd.get(prefix + "wqkv.bias")
    else:  # split projections: all queries, then all keys, then all values
        w = torch.cat([sd[f"{prefix}{n}.weight"] for n in ("wq", "wk", "wv")])
        b = torch.cat([sd[f"{prefix}{n}.bias"] for n in ("wq", "wk", "wv")]) if body["bias"] else None
    qkv = x @ w.T + (0 if b is None else b)
    q, k, v = (t.reshape(B, T, N, Dh) for t in qkv.split(D, dim=-1))  # all q | all k | all v
    if cfg.get("use_qk_norm"):
        q = rms_norm(q, sd[prefix + "q_norm.scale"], QK_NORM_EPS)
        k = rms_norm(k, sd[prefix + "k_norm.scale"], QK_NORM_EPS)
    q, k, v = (t.permute(0, 2, 1, 3) for t in (q, k, v))  # [B, N, T, Dh]
    rot = int(Dh * body["rotary_pct"])
    base = float(cfg.get("rope_base", 10000.0))
    q, k = rotate_half_prefix(q, rot, base), rotate_half_prefix(k, rot, base)
    A = q @ k.transpose(-1, -2) / math.sqrt(Dh)  # [B, N, T, S]

    dyn = prefix + "dyn_w_proj."
    slots = oracle_dynamic_weights(x, sd[dyn + "dw1"], sd[dyn + "qkw"], sd[dyn + "dd"], RANK)
    if cfg.get("query_wise"):  # the released code stores all four slots even then: use the query ones
        pre_q, post_q = (slots[0], slots[2]) if len(slots) == 4 else slots
        pre_k = post_k = (None, None, None)
    else:
        pre_q, pre_k, post_q, post_k = slots  # (pre-query, pre-key, post-query, post-key)
    A = oracle_compose(A, *pre_q, *pre_k)
    t_idx, s_idx = torch.arange(T)[:, None], torch.arange(T)[None, :]
    visible = s_idx <= t_idx
    if window is not None:
        visible &= s_idx > t_idx - (window + window_offset)  # t - W < s <= t: W keys, the current one included
    A = A.masked_fill(~visible, float("-inf"))
    P = oracle_compose(softmax_last(A), *post_q, *post_k)
    o = (P @ v).permute(0, 2, 1, 3).reshape(B, T, D)
    return o @ sd[prefix + "wo.weight"].T + sd.get(prefix + "wo.bias", 0)


def released_oracle_logits(cfg: dict, state: dict, input_ids: torch.Tensor, window_offset: int = 0) -> torch.Tensor:
    """Logits [B, T, V] of a released checkpoint (config dict + tensors under the released names), float64."""
    sd = {k: v.to(torch.float64) for k, v in state.items()}
    body = body_of(cfg)
    eps = float(cfg.get("norm_eps", 1e-5 if body["pythia"] else 1e-6))

    def norm(h, name):
        if body["layernorm"]:
            return layer_norm(h, sd[name + ".weight"], sd.get(name + ".bias"), eps)
        return rms_norm(h, sd[name + ".weight"], eps)

    def mlp(h, p):
        if body["gated"]:  # w2(silu(w1 x) * w3 x)
            return (silu(h @ sd[p + "w1.weight"].T) * (h @ sd[p + "w3.weight"].T)) @ sd[p + "w2.weight"].T
        hidden = gelu_exact(h @ sd[p + "w1.weight"].T + sd.get(p + "w1.bias", 0))  # w2(gelu(w1 x))
        return hidden @ sd[p + "w2.weight"].T + sd.get(p + "w2.bias", 0)

    h = sd["tok_embeddings.weight"][input_ids]
    for layer, window in enumerate(oracle_windows(cfg)):
        p = f"layers.{layer}."
        attn = oracle_attention(norm(h, p + "attention_norm"), sd, p + "attention.", cfg, window, window_offset)
        if body["parallel"]:  # x + attn(ln1 x) + mlp(ln2 x)
            h = h + attn + mlp(norm(h, p + "ffn_norm"), p + "feed_forward.")
        else:  # h = x + attn(ln1 x); h + mlp(ln2 h)
            h = h + attn
            h = h + mlp(norm(h, p + "ffn_norm"), p + "feed_forward.")
    h = norm(h, "norm")
    head = sd["output.weight"] if "output.weight" in sd else sd["tok_embeddings.weight"]
    return h @ head.T


def rand_ids(cfg, batch=2, length=13, seed=0):
    return torch.randint(0, cfg["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def load(path, **kwargs):
    """The user's line of the issue: no trust_remote_code, the remote code of auto_map does not even exist."""
    return AutoModelForCausalLM.from_pretrained(str(path), **kwargs).eval()


@torch.no_grad()
def logits_of(model, ids, **kwargs):
    return model(ids, **kwargs).logits


# ------------------------------------------------------------------------------------------------------------
# 1. Config files
# ------------------------------------------------------------------------------------------------------------
def write_config(directory: Path, cfg: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory


def test_dcpythia_model_type_registered():
    assert CONFIG_MAPPING["dcpythia"] is DCPythiaConfig
    assert CONFIG_MAPPING["dcformer"] is DCFormerConfig


CONFIG_CASES = {
    # Every value differs from our defaults and from the body's, so a key that is dropped or swapped shows.
    "dcpythia": dict(
        model_type="dcpythia", dim=96, n_layer=5, n_head=6, intermediate_size=200, vocab_size=123, block_size=80,
        rope_base=1234.0, rotary_pct=0.5, norm_eps=3e-5, use_qk_norm=True, window_size=7, window_type=None,
        query_wise=False, use_parallel_residual=True, use_linear_bias=True, tie_word_embeddings=False,
        bos_token_id=5, eos_token_id=6, pad_token_id=4,
    ),
    "dcpythia-sequential-nobias-LGLL": dict(
        model_type="dcpythia", dim=64, n_layer=6, n_head=8, intermediate_size=100, vocab_size=77, block_size=50,
        rope_base=777.0, rotary_pct=1.0, norm_eps=2e-6, use_qk_norm=False, window_size=3, window_type="LGLL",
        query_wise=True, use_parallel_residual=False, use_linear_bias=False, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    ),
    "dcformer-LG": dict(
        model_type="dcformer", dim=80, n_layer=4, n_head=4, intermediate_size=216, vocab_size=99, block_size=96,
        rope_base=20000.0, norm_eps=3e-6, use_qk_norm=True, window_size=9, window_type="LG", query_wise=False,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ),
    "dcformer-all-global": dict(
        model_type="dcformer", dim=48, n_layer=9, n_head=6, intermediate_size=128, vocab_size=55, block_size=40,
        rope_base=500000.0, norm_eps=4e-6, use_qk_norm=False, window_size=None, window_type=None,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_released_config_translated_field_by_field(tmp_path, case):
    raw = released_config(**CONFIG_CASES[case])
    raw["torch_dtype"] = "float16"
    config = AutoConfig.from_pretrained(write_config(tmp_path / "c", raw))
    pythia = raw["model_type"] == "dcpythia"
    assert type(config) is DCFormerConfig and config.model_type == "dcformer"
    assert config.hidden_size == raw["dim"]
    assert config.num_hidden_layers == raw["n_layer"]
    assert config.num_attention_heads == raw["n_head"]
    assert config.head_dim == raw["dim"] // raw["n_head"] != raw["head_dim"]  # the file's head_dim is stale
    assert config.intermediate_size == raw["intermediate_size"]
    assert config.vocab_size == raw["vocab_size"]
    assert config.max_position_embeddings == raw["block_size"]
    assert config.rope_parameters["rope_theta"] == raw["rope_base"]
    assert config.rope_parameters["partial_rotary_factor"] == raw.get("rotary_pct", 1.0)
    assert config.layer_norm_eps == raw["norm_eps"]
    assert config.qk_norm_eps == 1e-6
    assert config.use_qk_norm is raw["use_qk_norm"]
    assert config.query_wise is raw["query_wise"]
    assert config.use_dcmha is True
    assert config.window_size == raw["window_size"]
    assert config.window_type == raw["window_type"]
    expected_local = [w is not None for w in oracle_windows(raw)]
    assert config.layer_types == ["sliding_attention" if f else "full_attention" for f in expected_local]
    assert config.tie_word_embeddings is raw["tie_word_embeddings"]
    assert config.bos_token_id == raw["bos_token_id"] and config.eos_token_id == raw["eos_token_id"]
    assert config.pad_token_id == raw.get("pad_token_id")
    assert config.dtype == torch.float16
    # body
    assert config.norm_type == ("layernorm" if pythia else "rmsnorm")
    assert config.hidden_act == ("gelu" if pythia else "silu")
    assert config.use_gated_mlp is (not pythia)
    assert config.use_parallel_residual is raw.get("use_parallel_residual", False)
    bias = raw.get("use_linear_bias", False)
    assert config.attention_bias is bias and config.mlp_bias is bias
    # the dynamic-weight generator of the released files: K = 4N, I = 2, one group, 4 (or 2 query-wise) slots
    assert config.dynamic_hidden_size == 4 * raw["n_head"]
    assert config.dynamic_rank == 2 and config.num_head_groups == 1
    # unknown extra keys kept; released-only keys and the remote code dropped
    assert config.custom_extra_key == {"kept": [1, 2, 3]}
    saved = config.to_dict()
    for key in ("dim", "n_layer", "n_head", "n_local_heads", "block_size", "rope_base", "norm_eps", "is_training",
                "q_chunk_size", "use_gradient_checkpointing", "use_linear_bias", "auto_map"):
        assert key not in saved, key
    assert saved["head_dim"] == raw["dim"] // raw["n_head"]  # ours, derived: not the file's stale value
    # the translated config round-trips as our own layout, extra key included
    config.save_pretrained(tmp_path / "ours")
    again = AutoConfig.from_pretrained(tmp_path / "ours")
    assert again.to_dict() == {**saved, "_name_or_path": again.to_dict()["_name_or_path"]}
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["model_type"] == "dcformer"


def test_published_dcpythia_config_gives_the_spec_model(tmp_path):
    """The published DCPythia-6.9B config.json, verbatim; the model it describes, built on the meta device."""
    published = {
        "architectures": ["DCPythia"],
        "auto_map": {"AutoConfig": "configuration_dcpythia.DCPythiaConfig",
                     "AutoModelForCausalLM": "modeling_dcpythia.DCPythia"},
        "block_size": 2048, "bos_token_id": 0, "dim": 4096, "eos_token_id": 0, "head_dim": 128,
        "intermediate_size": 16384, "is_training": False, "model_type": "dcpythia", "n_head": 32, "n_layer": 32,
        "n_local_heads": 32, "norm_eps": 1e-05, "q_chunk_size": 128, "query_wise": False, "rope_base": 10000,
        "rotary_pct": 0.25, "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.33.2",
        "use_dcmha": True, "use_gradient_checkpointing": False, "use_linear_bias": True, "use_parallel_residual": True,
        "use_qk_norm": True, "vocab_size": 50257, "window_size": 256, "window_type": None,
    }
    config = AutoConfig.from_pretrained(write_config(tmp_path / "c", published))
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.head_dim) == (4096, 32, 32, 128)
    assert config.layer_types == ["sliding_attention", "full_attention"] * 16 and config.window_size == 256
    assert config.dtype == torch.float16 and config.use_qk_norm and config.use_parallel_residual
    with torch.device("meta"):
        model = DCFormerForCausalLM(config)
    dyn = sum(p.numel() for n, p in model.named_parameters() if ".dyn_w_proj." in n)
    assert dyn == 85_983_232  # spec: 2,686,976 per layer
    assert model.model.layers[0].self_attn.dyn_w_proj.qkw.shape == (1, 4, 128, 4, 32)


@pytest.mark.parametrize(
    "window_size, window_type, expected",
    [
        (5, None, "LG" * 3),
        (5, "LG", "LG" * 3),
        (5, "LGLL", "LGLLLG"),
        (5, "LGL6", "LGLLLL"),
        (None, None, "GGGGGG"),
        (64, None, "GGGGGG"),  # a window as long as block_size covers every position: global
    ],
)
def test_released_window_keys(tmp_path, window_size, window_type, expected):
    raw = released_config("dcformer", n_layer=6, window_size=window_size, window_type=window_type)
    config = AutoConfig.from_pretrained(write_config(tmp_path / "c", raw))
    assert "".join("L" if t == "sliding_attention" else "G" for t in config.layer_types) == expected
    assert config.window_size == (window_size if "L" in expected else None)


def test_named_pattern_without_window_size_uses_the_official_256(tmp_path):
    raw = released_config("dcformer", n_layer=4, window_size=None, window_type="LGLL", block_size=4096)
    config = AutoConfig.from_pretrained(write_config(tmp_path / "c", raw))
    assert config.window_size == 256
    assert config.layer_types == ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]


@pytest.mark.parametrize(
    "overrides, key",
    [
        (dict(dim=66, n_head=4), "dim"),
        (dict(n_local_heads=2), "n_local_heads"),
        (dict(mgate=True), "mgate"),
        (dict(window_type="XYZ"), "window_type"),
        (dict(n_head=0), "n_head"),
        (dict(n_layer=None), "n_layer"),
    ],
    ids=["dim-not-divisible", "n_local_heads", "mgate", "window_type", "n_head-zero", "n_layer-null"],
)
@pytest.mark.parametrize("model_type", ["dcpythia", "dcformer"])
def test_impossible_released_config_refused(tmp_path, overrides, key, model_type):
    raw = released_config(model_type, **overrides)
    with pytest.raises(ValueError, match=key):
        AutoConfig.from_pretrained(write_config(tmp_path / "c", raw))
    with pytest.raises(ValueError, match=key):
        DCFormerConfig.from_dict(raw)


@pytest.mark.parametrize("trust_remote_code", [None, False, True])
def test_remote_code_of_auto_map_is_never_used(tmp_path, trust_remote_code):
    """The released files' auto_map names remote code (here: modules that do not exist); ours is used whatever
    trust_remote_code says, and nothing is fetched."""
    directory, cfg, _ = released_dir(tmp_path)
    assert "does_not_exist" in json.loads((directory / "config.json").read_text())["auto_map"]["AutoConfig"]
    kwargs = {} if trust_remote_code is None else dict(trust_remote_code=trust_remote_code)
    assert type(AutoConfig.from_pretrained(str(directory), **kwargs)) is DCFormerConfig
    model = AutoModelForCausalLM.from_pretrained(str(directory), **kwargs)
    assert type(model) is DCFormerForCausalLM
    assert not [name for name in sys.modules if "does_not_exist" in name]


def test_dcpythia_model_type_without_released_keys_refused():
    with pytest.raises(ValueError, match="dim, n_layer, n_head"):
        DCPythiaConfig.from_dict({"model_type": "dcpythia", "hidden_size": 64, "num_hidden_layers": 2})


# ------------------------------------------------------------------------------------------------------------
# 2. Released weights give the released function (prefill), every layout
# ------------------------------------------------------------------------------------------------------------
FORWARD_CASES = {
    # name: (model_type, config overrides, state options, file format, shards)
    "dcpythia-qknorm-w4-fused-safetensors": ("dcpythia", dict(), dict(), "safetensors", 1),
    "dcpythia-qknorm-w4-split-bin-3shards-kvcache": ("dcpythia", dict(), dict(split_qkv=True, kv_cache=True), "bin", 3),
    "dcpythia-noqknorm-w3-split-safetensors-2shards": (
        "dcpythia", dict(use_qk_norm=False, window_size=3, n_layer=3), dict(split_qkv=True), "safetensors", 2),
    "dcpythia-sequential-nobias-bin": (
        "dcpythia", dict(use_parallel_residual=False, use_linear_bias=False, rotary_pct=0.25), dict(), "bin", 1),
    "dcformer-LG-qknorm-fused-bin-2shards": ("dcformer", dict(window_type="LG"), dict(), "bin", 2),
    "dcformer-LGLL-noqknorm-split-safetensors-3shards": (
        "dcformer", dict(window_type="LGLL", n_layer=4, use_qk_norm=False, window_size=5), dict(split_qkv=True),
        "safetensors", 3),
    "dcformer-tied-w4-safetensors": ("dcformer", dict(window_type="LG", tie_word_embeddings=True), dict(), "safetensors", 1),
}


@pytest.mark.parametrize("case", list(FORWARD_CASES))
def test_released_checkpoint_matches_oracle(tmp_path, case):
    model_type, overrides, state_kwargs, fmt, shards = FORWARD_CASES[case]
    directory, cfg, state = released_dir(
        tmp_path, model_type=model_type, config_overrides=overrides, fmt=fmt, num_shards=shards, **state_kwargs
    )
    files = sorted(p.name for p in directory.iterdir())
    assert any(name.endswith("." + fmt) for name in files)
    assert (shards > 1) == any(name.endswith(".index.json") for name in files)
    assert cfg["window_size"] < 13 and any(w is not None for w in oracle_windows(cfg))

    model = load(directory)
    assert type(model) is DCFormerForCausalLM and model.dtype == torch.float32
    ids = rand_ids(cfg, batch=2, length=13)
    ours = logits_of(model, ids).double()
    expected = released_oracle_logits(cfg, state, ids)
    torch.testing.assert_close(ours, expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("via", ["from_pretrained", "converter"])
def test_query_wise_release_with_four_slots_matches_oracle(tmp_path, capsys, via):
    """A query-wise release stores the four slots of a full model; only the query slots (0 and 2) are used."""
    cfg = released_config("dcpythia", query_wise=True)
    state = released_state_dict(dict(cfg, query_wise=False), seed=3)
    directory = write_released_checkpoint(tmp_path / "released", cfg, state)
    if via == "converter":
        assert run_cli(capsys, str(directory), str(tmp_path / "native"))[0] == 0
        directory = tmp_path / "native"
    model = load(directory)
    assert model.model.layers[0].self_attn.dyn_w_proj.dw1.shape[2] == 2
    ids = rand_ids(cfg)
    torch.testing.assert_close(logits_of(model, ids).double(), released_oracle_logits(cfg, state, ids), rtol=0, atol=ATOL)


def test_query_wise_edited_into_a_released_config_is_said(tmp_path, caplog):
    """A released config.json edited from query_wise false to true. The released layout stores four
    slots either way (the authors' code allocates four and, when query-wise, reads slots 0 and 2), so the edit cannot
    be told from a query-wise release by the files alone; what can be said is that trained (non-zero) key-wise
    weights are dropped. The load says so once, naming the field and the folder, and computes what the authors' code
    computes with that config."""
    directory, cfg, state = released_dir(tmp_path)  # trained with query_wise=False: four non-zero slots
    raw = json.loads((directory / "config.json").read_text())
    raw["query_wise"] = True
    (directory / "config.json").write_text(json.dumps(raw))
    with caplog.at_level("WARNING"):
        model = load(directory)
    err = caplog.text
    assert f"query_wise is true in the config.json of {directory}" in err, err
    assert "key-wise composition weights" in err and "restore it" in err
    assert err.count("query_wise is true") == 1  # once per checkpoint, not per tensor
    ids = rand_ids(cfg)
    expected = released_oracle_logits(dict(cfg, query_wise=True), state, ids)
    torch.testing.assert_close(logits_of(model, ids).double(), expected, rtol=0, atol=ATOL)
    unedited = released_oracle_logits(cfg, state, ids)
    assert (logits_of(model, ids).double() - unedited).abs().max() > 100 * ATOL  # why it must be said


def test_query_wise_release_with_unused_key_slots_loads_silently(tmp_path, caplog):
    """The other side: a query-wise release whose key-wise slots hold zeros (never trained) drops nothing."""
    cfg = released_config("dcpythia", query_wise=True)
    state = released_state_dict(dict(cfg, query_wise=False), seed=3)
    for key, tensor in state.items():
        if key.endswith("dyn_w_proj.dw1"):  # [D, G, 4, K]
            tensor[:, :, 1::2] = 0
        elif key.endswith("dyn_w_proj.qkw"):  # [G, 4, K, 2I, M]
            tensor[:, 1::2] = 0
        elif key.endswith("dyn_w_proj.dd"):  # [D, G, 4M]
            D, G = tensor.shape[:2]
            tensor.view(D, G, 4, -1)[:, :, 1::2] = 0
    directory = write_released_checkpoint(tmp_path / "released", cfg, state)
    with caplog.at_level("WARNING"):
        model = load(directory)
    assert "query_wise is true" not in caplog.text
    ids = rand_ids(cfg)
    torch.testing.assert_close(logits_of(model, ids).double(), released_oracle_logits(cfg, state, ids), rtol=0, atol=ATOL)


def test_released_intermediate_size_null_uses_the_released_default(tmp_path):
    for name, value in [("null", None), ("missing", ...)]:
        cfg = released_config("dcformer", dim=100, n_head=5, intermediate_size=value)  # `...` leaves the key out
        config = AutoConfig.from_pretrained(write_config(tmp_path / name, cfg))
        assert config.intermediate_size == 512, name  # int(8 * 100 / 3) = 266, rounded up to a multiple of 256


def test_oracle_comparison_can_fail(tmp_path):
    """The released-weights comparison detects the official prefill's off-by-one window (t - W <= s), stale
    merged copies used instead of dw1/qkw/dd, and a model without its composition weights."""
    directory, cfg, state = released_dir(tmp_path)
    ids = rand_ids(cfg, batch=2, length=13)
    ours = logits_of(load(directory), ids).double()
    margin = 100 * ATOL
    assert (ours - released_oracle_logits(cfg, state, ids, window_offset=1)).abs().max() > margin
    no_dyn = {k: (torch.zeros_like(v) if k.endswith(("dw1", "qkw", "dd")) else v) for k, v in state.items()}
    assert (ours - released_oracle_logits(cfg, no_dyn, ids)).abs().max() > margin
    # the stale merged copies dw_m/qkw_m (right sizes, garbage values), read in place of dw1/qkw, would show
    stale = dict(state)
    for layer in range(cfg["n_layer"]):
        a = f"layers.{layer}.attention.dyn_w_proj."
        D, G, C, K = state[a + "dw1"].shape
        stale[a + "dw1"] = state[a + "dw_m"][:, : G * C * K].reshape(D, G, C, K)
        stale[a + "qkw"] = state[a + "qkw_m"].reshape(state[a + "qkw"].shape)
    assert (ours - released_oracle_logits(cfg, stale, ids)).abs().max() > margin


# ------------------------------------------------------------------------------------------------------------
# 3. Local windows in decode
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "model_type, overrides",
    [("dcpythia", dict(window_size=3)), ("dcformer", dict(window_type="LGLL", n_layer=4, window_size=4))],
    ids=["dcpythia-w3", "dcformer-LGLL-w4"],
)
def test_token_by_token_decode_matches_oracle(tmp_path, model_type, overrides):
    directory, cfg, state = released_dir(tmp_path, model_type=model_type, config_overrides=overrides,
                                         split_qkv=True, kv_cache=True)
    model = load(directory)
    ids = rand_ids(cfg, batch=2, length=14, seed=3)
    expected = released_oracle_logits(cfg, state, ids)
    prompt = 2  # shorter than the window: the cache fills, then slides for 12 steps
    with torch.no_grad():
        out = model(ids[:, :prompt], use_cache=True)
        torch.testing.assert_close(out.logits.double(), expected[:, :prompt], rtol=0, atol=ATOL)
        cache = out.past_key_values
        for t in range(prompt, ids.shape[1]):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            torch.testing.assert_close(out.logits[:, 0].double(), expected[:, t], rtol=0, atol=ATOL, msg=f"step {t}")
    # a window one key wider (the official prefill) would not match the decode
    wider = released_oracle_logits(cfg, state, ids, window_offset=1)
    assert (out.logits[:, 0].double() - wider[:, -1]).abs().max() > 100 * ATOL


@pytest.mark.parametrize("chunk", [512, 3])
def test_prefill_longer_than_window_then_decode(tmp_path, chunk):
    """A prompt longer than the window (the prefill crops the local layers' cache), with the attention's query
    chunks larger than the prompt or smaller than the window."""
    directory, cfg, state = released_dir(tmp_path, model_type="dcformer", config_overrides=dict(window_type="LG"))
    model = load(directory, attention_chunk_size=chunk)
    assert model.config.attention_chunk_size == chunk
    ids = rand_ids(cfg, batch=1, length=12, seed=4)
    expected = released_oracle_logits(cfg, state, ids)
    with torch.no_grad():
        out = model(ids[:, :9], use_cache=True)  # 9 > window 4
        torch.testing.assert_close(out.logits.double(), expected[:, :9], rtol=0, atol=ATOL)
        for t in range(9, 12):
            out = model(ids[:, t : t + 1], past_key_values=out.past_key_values, use_cache=True)
            torch.testing.assert_close(out.logits[:, 0].double(), expected[:, t], rtol=0, atol=ATOL)


# ------------------------------------------------------------------------------------------------------------
# 4. fp16 release, as in the line
# ------------------------------------------------------------------------------------------------------------
def test_fp16_release_loads_in_fp16(tmp_path):
    directory, cfg, state = released_dir(tmp_path, dtype=torch.float16, config_overrides=dict(torch_dtype="float16"))
    model = load(directory, dtype=torch.float16)
    assert all(p.dtype == torch.float16 for p in model.parameters())
    ids = rand_ids(cfg, batch=1, length=10)
    ours = logits_of(model, ids)
    assert ours.dtype == torch.float16
    expected = released_oracle_logits(cfg, state, ids)  # float64 maths on the fp16 tensors
    torch.testing.assert_close(ours.double(), expected, rtol=0, atol=5e-2)
    # loaded in fp32, the fp16 tensors give the oracle's logits to fp32 accuracy
    model32 = load(directory, dtype=torch.float32)
    torch.testing.assert_close(logits_of(model32, ids).double(), expected, rtol=0, atol=ATOL)
    # without dtype, the checkpoint's dtype
    assert load(directory).dtype == torch.float16


# ------------------------------------------------------------------------------------------------------------
# 5. Corrupted checkpoints: from_pretrained
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "drop, pattern",
    [
        ("layers.1.attention.dyn_w_proj.dd", r"layers\.1\.\w+\.dyn_w_proj\.dd"),
        ("layers.0.attention.dyn_w_proj.qkw", r"layers\.0\.\w+\.dyn_w_proj\.qkw"),
        ("layers.0.attention.q_norm.scale", r"layers\.0\.\w+\.q_norm"),
        ("output.weight", r"output\.weight|lm_head\.weight"),
    ],
)
def test_missing_tensor_is_an_error_naming_it(tmp_path, drop, pattern):
    cfg = released_config()
    state = released_state_dict(cfg)
    del state[drop]
    directory = write_released_checkpoint(tmp_path / "ckpt", cfg, state, num_shards=2)
    with pytest.raises(ValueError, match=pattern):
        load(directory)


@pytest.mark.parametrize(
    "key, shape, pattern",
    [
        ("layers.1.attention.dyn_w_proj.dd", (64, 1, 17), r"layers\.1\.\w+\.dyn_w_proj\.dd"),
        ("layers.0.attention.dyn_w_proj.dw1", (64, 1, 4, 15), r"layers\.0\.\w+\.dyn_w_proj\.dw1"),
        ("layers.0.attention.wqkv.weight", (192, 65), r"layers\.0\.\w+\.(wqkv|qkv_proj)"),
    ],
)
def test_wrong_shape_is_an_error_naming_key_and_both_shapes(tmp_path, key, shape, pattern):
    cfg = released_config()
    state = released_state_dict(cfg)
    good = tuple(state[key].shape)
    state[key] = torch.zeros(shape)
    directory = write_released_checkpoint(tmp_path / "ckpt", cfg, state, fmt="bin")
    with pytest.raises(ValueError, match=pattern) as err:
        load(directory)
    assert str(shape) in str(err.value) and str(good) in str(err.value)


def test_incomplete_split_qkv_is_an_error(tmp_path):
    cfg = released_config()
    state = released_state_dict(cfg, split_qkv=True)
    del state["layers.0.attention.wk.weight"]
    directory = write_released_checkpoint(tmp_path / "ckpt", cfg, state)
    with pytest.raises(ValueError, match=r"layers\.0\.\w+\.(wk|qkv_proj)"):
        load(directory)


# ------------------------------------------------------------------------------------------------------------
# 6. dcformer-convert-released (conversion/released.py)
# ------------------------------------------------------------------------------------------------------------
def run_cli(capsys, *argv):
    rc = released_converter.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out + out.err


def safetensors_contents(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensors


@pytest.mark.parametrize(
    "model_type, overrides, state_kwargs, fmt, shards",
    [
        ("dcpythia", dict(), dict(split_qkv=True, kv_cache=True), "bin", 3),
        ("dcformer", dict(window_type="LG"), dict(), "safetensors", 2),
        ("dcformer", dict(window_type="LG", tie_word_embeddings=True), dict(split_qkv=True), "safetensors", 1),
    ],
    ids=["dcpythia-split-bin-3shards", "dcformer-fused-safetensors-2shards", "dcformer-tied-split"],
)
def test_converted_directory_is_native_and_identical(tmp_path, capsys, model_type, overrides, state_kwargs, fmt, shards):
    src, cfg, state = released_dir(tmp_path, model_type=model_type, config_overrides=overrides, fmt=fmt,
                                   num_shards=shards, **state_kwargs)
    dst = tmp_path / "out" / "converted"
    rc, log = run_cli(capsys, src, dst)
    assert rc == 0, log
    # our layout: safetensors, our config, tokenizer copied, our remote code and model card, nothing else
    tokenizer_files = {p.name for p in src.iterdir() if p.name.startswith(("tokenizer", "special_tokens"))}
    assert tokenizer_files >= set(TOKENIZER_FILES)
    names = {p.name for p in dst.iterdir()}
    remote_code = {"modeling_dcformer.py", "configuration_dcformer.py", "dcmha.py", "dcmha_base.py",
                   "dcmha_eager.py", "dcmha_compiled.py", "cache_dcformer.py",
                   "checkpoint_checks.py"}  # no kernel, no released format
    assert names == {"config.json", "model.safetensors", "README.md", *remote_code, *tokenizer_files}, names
    saved_cfg = json.loads((dst / "config.json").read_text())
    assert saved_cfg["model_type"] == "dcformer" and saved_cfg["hidden_size"] == cfg["dim"]
    assert saved_cfg["architectures"] == ["DCFormerForCausalLM"]
    assert saved_cfg["auto_map"] == publishing.AUTO_MAP  # ours, not the release's (which pointed at the authors' code)
    for key in ("dim", "n_layer", "n_head", "is_training"):
        assert key not in saved_cfg, key
    assert saved_cfg["custom_extra_key"] == cfg["custom_extra_key"]
    for name in tokenizer_files:
        assert (dst / name).read_bytes() == (src / name).read_bytes(), name
    assert AutoTokenizer.from_pretrained(str(dst))("w5 w7")["input_ids"] == [5, 7]
    tensors = safetensors_contents(dst)
    assert all(k.startswith(("model.", "lm_head.")) for k in tensors), sorted(tensors)
    assert not any(s in k for k in tensors for s in ("dw_m", "qkw_m", "pre_proj", "post_proj", "kv_cache"))
    fused = torch.cat([state[f"layers.0.attention.{n}.weight"] for n in ("wq", "wk", "wv")]) \
        if "layers.0.attention.wq.weight" in state else state["layers.0.attention.wqkv.weight"]
    assert torch.equal(tensors["model.layers.0.self_attn.qkv_proj.weight"], fused)
    assert torch.equal(tensors["model.layers.1.self_attn.dyn_w_proj.qkw"], state["layers.1.attention.dyn_w_proj.qkw"])
    # identical logits to loading the released directory directly, and to the oracle
    ids = rand_ids(cfg, batch=2, length=11)
    converted = logits_of(load(dst), ids)
    assert torch.equal(converted, logits_of(load(src), ids))
    torch.testing.assert_close(converted.double(), released_oracle_logits(cfg, state, ids), rtol=0, atol=ATOL)


def test_save_pretrained_after_released_load_is_the_converters_layout(tmp_path, capsys):
    """A model loaded from the released layout saves our native layout (not the released names back), and the
    same tensors, bit for bit, as the converter writes."""
    src, cfg, state = released_dir(tmp_path, split_qkv=True, kv_cache=True, fmt="bin", num_shards=2)
    model = load(src)
    model.save_pretrained(tmp_path / "saved")
    assert run_cli(capsys, src, tmp_path / "converted")[0] == 0
    saved, converted = safetensors_contents(tmp_path / "saved"), safetensors_contents(tmp_path / "converted")
    assert set(saved) == set(converted) and all(k.startswith(("model.", "lm_head.")) for k in saved)
    for key in saved:
        assert torch.equal(saved[key], converted[key]), key
    ids = rand_ids(cfg)
    assert torch.equal(logits_of(load(tmp_path / "saved"), ids), logits_of(model, ids))


@pytest.mark.parametrize("cast", [None, "bfloat16"])
def test_converter_keeps_or_casts_dtype(tmp_path, capsys, cast):
    src, cfg, state = released_dir(tmp_path, dtype=torch.float16, config_overrides=dict(torch_dtype="float16"),
                                   fmt="bin", num_shards=2)
    dst = tmp_path / "converted"
    rc, log = run_cli(capsys, src, dst, *(["--dtype", cast] if cast else []))
    assert rc == 0, log
    want = torch.float16 if cast is None else torch.bfloat16
    tensors = safetensors_contents(dst)
    assert {t.dtype for t in tensors.values()} == {want}
    assert json.loads((dst / "config.json").read_text())["dtype"] == str(want).removeprefix("torch.")
    model = load(dst)
    assert model.dtype == want
    if cast is None:
        assert torch.equal(tensors["model.layers.0.self_attn.dyn_w_proj.dd"], state["layers.0.attention.dyn_w_proj.dd"])


def test_max_shard_size_writes_several_shards_and_an_index(tmp_path, capsys):
    src, cfg, state = released_dir(tmp_path)
    dst = tmp_path / "converted"
    rc, log = run_cli(capsys, src, dst, "--max-shard-size", "60KB")
    assert rc == 0, log
    shards = sorted(p.name for p in dst.glob("*.safetensors"))
    assert len(shards) >= 3 and "model.safetensors" not in shards
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    tensors = safetensors_contents(dst)
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for file in dst.glob("*.safetensors"):
        assert file.stat().st_size < 60_000 + 10_000  # one shard holds at most max_shard_size of tensors (+ header)
    ids = rand_ids(cfg)
    assert torch.equal(logits_of(load(dst), ids), logits_of(load(src), ids))


def test_converter_refuses_non_empty_destination_unless_overwrite(tmp_path, capsys):
    src, cfg, _ = released_dir(tmp_path)
    dst = tmp_path / "converted"
    dst.mkdir()
    (dst / "precious.txt").write_text("keep me")
    rc, log = run_cli(capsys, src, dst)
    assert rc == 2
    assert "not empty" in log and "--overwrite" in log
    assert sorted(p.name for p in dst.iterdir()) == ["precious.txt"]
    assert (dst / "precious.txt").read_text() == "keep me"

    rc, log = run_cli(capsys, src, dst, "--overwrite")
    assert rc == 0, log
    assert not (dst / "precious.txt").exists()
    assert (dst / "model.safetensors").is_file() and (dst / "config.json").is_file()
    assert torch.equal(logits_of(load(dst), rand_ids(cfg)), logits_of(load(src), rand_ids(cfg)))
    # an empty existing directory is fine without --overwrite
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_cli(capsys, src, empty)[0] == 0 and (empty / "model.safetensors").is_file()


@pytest.mark.parametrize("failure", ["wrong-shape", "truncated-file", "interrupted"])
def test_converter_failure_midway_leaves_nothing(tmp_path, capsys, monkeypatch, failure):
    """Output shards are already on disk when the last source shard turns out bad (or the user hits Ctrl-C):
    neither the destination nor a half-written/.partial directory is left, and an existing destination being
    replaced with --overwrite stays as it was."""
    cfg = released_config()
    state = released_state_dict(cfg)
    if failure == "wrong-shape":
        state["norm.weight"] = torch.ones(cfg["dim"] + 1)  # one of the last keys: in the last source shard
    src = write_released_checkpoint(tmp_path / "src", cfg, state, num_shards=3, interleave=False)
    if failure == "truncated-file":
        shard = src / "model-00003-of-00003.safetensors"
        shard.write_bytes(shard.read_bytes()[:-1000])
    written = []
    real_flush = common.ShardWriter.flush

    def flush(self):
        real_flush(self)
        written.append(sorted(p.name for p in self.directory.iterdir()))
        if failure == "interrupted" and len(written) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(common.ShardWriter, "flush", flush)
    out = tmp_path / "out"
    out.mkdir()
    dst = out / "converted"
    if failure == "wrong-shape":
        rc, log = run_cli(capsys, src, dst, "--max-shard-size", "20KB")
        assert rc == 2 and "norm.weight" in log and str((cfg["dim"] + 1,)) in log, log
    elif failure == "truncated-file":  # the CLI reports a corrupt shard in one line, exit 2, no traceback
        rc, log = run_cli(capsys, src, dst, "--max-shard-size", "20KB")
        assert rc == 2 and log.strip().splitlines()[-1].startswith("error: "), log
    else:
        with pytest.raises(BaseException):
            released_converter.convert(str(src), str(dst), max_shard_size="20KB")
    assert written and written[0], "the failure should come after output shards were written"
    assert list(out.iterdir()) == []  # no destination, no half-written or .partial directory

    dst.mkdir()
    (dst / "old.txt").write_text("old")
    written.clear()
    with pytest.raises(BaseException):
        released_converter.convert(str(src), str(dst), overwrite=True, max_shard_size="20KB")
    assert written
    assert [p.name for p in out.iterdir()] == ["converted"]
    assert [p.name for p in dst.iterdir()] == ["old.txt"] and (dst / "old.txt").read_text() == "old"


@pytest.mark.parametrize(
    "corrupt, pattern",
    [
        ("missing", r"layers\.1\.\w+\.dyn_w_proj\.dd"),
        ("wrong-shape", r"layers\.1\.attention\.dyn_w_proj\.dd.*\(64, 1, 17\).*\(64, 1, 16\)"),
        ("unknown-key", r"layers\.0\.attention\.mystery\.weight"),
        ("non-identity-pre_proj", r"layers\.1\.attention\.dyn_w_proj\.pre_proj\.w.*identity"),
        ("non-identity-post_proj", r"layers\.0\.attention\.dyn_w_proj\.post_proj\.w.*identity"),
        ("incomplete-split", r"layers\.0\.attention\.\*\.weight.*wq.*wv"),
    ],
)
def test_converter_refuses_corrupted_checkpoint(tmp_path, capsys, corrupt, pattern):
    cfg = released_config()
    state = released_state_dict(cfg, split_qkv=corrupt == "incomplete-split")
    key = "layers.1.attention.dyn_w_proj.dd"
    if corrupt == "missing":
        del state[key]
    elif corrupt == "wrong-shape":
        state[key] = torch.zeros(64, 1, 17)
    elif corrupt == "unknown-key":
        state["layers.0.attention.mystery.weight"] = torch.zeros(3)
    elif corrupt == "non-identity-pre_proj":
        state["layers.1.attention.dyn_w_proj.pre_proj.w"] = state["layers.1.attention.dyn_w_proj.pre_proj.w"] * 1.5
    elif corrupt == "non-identity-post_proj":
        w = torch.eye(4)[None].clone()
        w[0, 0, 1] = 0.25
        state["layers.0.attention.dyn_w_proj.post_proj.w"] = w
    elif corrupt == "incomplete-split":
        del state["layers.0.attention.wk.weight"]
    src = write_released_checkpoint(tmp_path / "src", cfg, state, num_shards=2)
    dst = tmp_path / "converted"
    rc, log = run_cli(capsys, src, dst)
    assert rc == 2
    assert "error:" in log
    assert re.search(pattern, log), log
    assert not dst.exists()


def test_converter_missing_source_is_an_error(tmp_path, capsys):
    rc, log = run_cli(capsys, tmp_path / "no" / "such" / "dir", tmp_path / "dst")
    assert rc == 2 and "does not exist" in log
    empty = tmp_path / "empty-src"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(released_config()))
    rc, log = run_cli(capsys, empty, tmp_path / "dst")
    assert rc == 2 and "no weights" in log
    assert not (tmp_path / "dst").exists()


def test_converter_refuses_a_native_checkpoint(tmp_path, capsys):
    src, _, _ = released_dir(tmp_path)
    native = tmp_path / "native"
    assert run_cli(capsys, src, native)[0] == 0
    rc, log = run_cli(capsys, native, tmp_path / "again")
    assert rc == 2 and "released" in log


# ------------------------------------------------------------------------------------------------------------
# 7. Streaming: peak memory of the converter stays near one shard
# ------------------------------------------------------------------------------------------------------------
# Runs a command as its only child, echoes the child's output and prints the child's peak RSS. The wrapper is a
# small fresh process: Linux carries the peak RSS of a forking parent into the child (and across exec), so a
# child forked straight from pytest would report pytest's own size; the wrapper's children start small.
PEAK_RSS_OF_CHILD = textwrap.dedent(
    """
    import resource, subprocess, sys
    proc = subprocess.run(sys.argv[1:], capture_output=True, text=True)
    if proc.returncode:
        sys.exit(proc.stdout + proc.stderr)
    print(proc.stdout.strip())
    print("PEAK", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)  # Linux: KiB
    """
)
# Prints the baseline (peak RSS after the converter's imports), then acts as a non-streaming loader: every
# shard read at once.
BASELINE_THEN_WHOLE = textwrap.dedent(
    """
    import resource, sys
    from pathlib import Path
    import torch, transformers, modeling_dcformer, modeling_dcformer.conversion.released
    from safetensors.torch import load_file
    print("BASELINE", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    sys.stdout.flush()
    shards = sorted(Path(sys.argv[1]).glob("*.safetensors"))
    everything = [{k: v.clone() for k, v in load_file(str(p)).items()} for p in shards]
    """
)


def python_child(*args) -> subprocess.Popen:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TQDM_DISABLE="1", OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT)


def tagged_numbers(proc: subprocess.Popen) -> dict[str, int]:
    """The `TAG number` lines of a wrapper's output: the child's BASELINE if it prints one, and its PEAK RSS."""
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    return {tag: int(n) for tag, n in (line.split() for line in out.splitlines() if line.startswith(("PEAK ", "BASELINE ")))}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss units and semantics are Linux's")
def test_converter_streams_shard_by_shard(tmp_path):
    # ~200 MB of fp32 in 8 source shards of ~25 MB: big vocab and hidden size, few layers; no tensor over 13 MB
    cfg = released_config("dcpythia", dim=1024, n_layer=5, n_head=8, intermediate_size=2048, vocab_size=3000,
                          block_size=64, window_size=4)
    state = released_state_dict(cfg)
    total = sum(t.numel() * t.element_size() for t in state.values())
    src = write_released_checkpoint(tmp_path / "src", cfg, state, num_shards=8, interleave=False, tokenizer=False)
    del state
    shard_sizes = [p.stat().st_size for p in src.glob("*.safetensors")]
    assert len(shard_sizes) == 8 and max(shard_sizes) < 32e6 and total > 180e6, (shard_sizes, total)

    dst = tmp_path / "dst"
    converter = python_child("-c", PEAK_RSS_OF_CHILD, sys.executable, "-m", "modeling_dcformer.conversion.released",
                             str(src), str(dst), "--max-shard-size", "24MB")
    # runs alongside (separate process trees, separate measurements)
    reference = python_child("-c", PEAK_RSS_OF_CHILD, sys.executable, "-c", BASELINE_THEN_WHOLE, str(src))
    converter_peak = tagged_numbers(converter)["PEAK"]
    numbers = tagged_numbers(reference)
    baseline, whole_peak = numbers["BASELINE"], numbers["PEAK"]

    outputs = list(dst.glob("*.safetensors"))
    assert len(outputs) >= 8 and all(p.stat().st_size < 24e6 + 1e5 for p in outputs)
    increase = converter_peak - baseline
    # Streaming holds about one source shard and one output shard (and its serialisation) at a time.
    assert increase < 0.4 * total, (increase / 1e6, baseline / 1e6, total / 1e6)
    # The measurement can fail: a loader holding every shard at once shows at least the whole model.
    assert whole_peak - baseline > 0.9 * total, ((whole_peak - baseline) / 1e6, total / 1e6)


# ------------------------------------------------------------------------------------------------------------
# 8. device_map="auto" (accelerate)
# ------------------------------------------------------------------------------------------------------------
def test_device_map_auto(tmp_path):
    directory, cfg, state = released_dir(tmp_path, model_type="dcformer",
                                         config_overrides=dict(window_type="LG", n_layer=4), num_shards=2, fmt="bin")
    assert DCFormerForCausalLM._no_split_modules == ["DCFormerDecoderLayer"]
    ids = rand_ids(cfg, batch=2, length=11)
    plain = load(directory)
    expected = logits_of(plain, ids)
    torch.testing.assert_close(expected.double(), released_oracle_logits(cfg, state, ids), rtol=0, atol=ATOL)

    model = load(directory, device_map="auto")  # one CPU here: everything on it
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert torch.equal(logits_of(model, ids), expected)

    # A memory budget that splits the model between CPU and disk: accelerate places whole decoder layers
    # (never split: _no_split_modules) and hooks them, and the model computes the same with its cache.
    budget = load(directory, device_map="auto", max_memory={"cpu": "400KB"}, offload_folder=str(tmp_path / "off"))
    placement = budget.hf_device_map
    assert set(placement.values()) == {"cpu", "disk"}, placement
    assert not any(key.startswith("model.layers.") and key.count(".") > 2 for key in placement), placement
    assert torch.equal(logits_of(budget, ids), expected)
    prompt = ids[:, :4]
    generated = budget.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False)
    assert torch.equal(
        generated, plain.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False)
    )
