"""Builders of tiny checkpoints in the authors' *released* layout (Caiyun-AI/DCPythia-6.9B, Caiyun-AI/DCFormer-2.8B).

Everything here is written from `docs/spec.md` ("Released configuration keys", "Released state-dict keys",
"Bodies") and from the authors' published config files -- never from our model's state dict or config class, so
that a renaming or shape mistake in `modeling_dcformer` cannot be copied into the fixtures. Nothing in this file
imports `modeling_dcformer`.

    cfg = released_config("dcpythia", window_size=4)         # the released config.json as a dict
    state = released_state_dict(cfg, seed=0)                 # released tensor names and shapes
    write_released_checkpoint(tmp_path / "ckpt", cfg, state, fmt="bin", num_shards=3)

Notation (spec): D dim, N heads, Dh = D / N, G = 1 head group, M = N / G, C = 4 slots, K = 4 N, I = 2.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

RANK = 2  # I: rank of each low-rank dynamic term in every released model
SLOTS = 4  # C: (pre-query, pre-key, post-query, post-key)
GROUPS = 1  # G: every released model composes all heads together

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

# auto_map of the released files, pointing at remote code that does not exist here: loading must never need it.
BOGUS_AUTO_MAP = {
    "AutoConfig": "configuration_dcpythia_does_not_exist.DCPythiaConfig",
    "AutoModelForCausalLM": "modeling_dcpythia_does_not_exist.DCPythia",
}


def released_config(
    model_type: str = "dcpythia",
    *,
    dim: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    intermediate_size: int = 96,
    vocab_size: int = 101,
    block_size: int = 64,
    window_size: int | None = 4,
    window_type: str | None = None,
    use_qk_norm: bool = True,
    query_wise: bool = False,
    tie_word_embeddings: bool = False,
    **overrides,
) -> dict:
    """A config.json of the released layout, as a dict.

    "dcpythia" (GPT-NeoX body) carries every key of the published DCPythia-6.9B file (`rotary_pct`,
    `use_linear_bias`, `use_parallel_residual`, ...); "dcformer" (LLaMA body, DCFormer++) carries the keys of the
    published DCFormer file, which has no `rotary_pct` / `use_linear_bias` / `use_parallel_residual`. Both carry a
    deliberately stale `head_dim`, the training-only keys, an unknown extra key (`custom_extra_key`) and an auto_map
    to remote code that does not exist. `overrides` replace or add keys; a value of `...` (Ellipsis) deletes one.
    """
    cfg = {
        "architectures": ["DCPythia" if model_type == "dcpythia" else "DCFormer"],
        "auto_map": dict(BOGUS_AUTO_MAP),
        "model_type": model_type,
        "dim": dim,
        "n_layer": n_layer,
        "n_head": n_head,
        "n_local_heads": n_head,
        "head_dim": 128,  # stale on purpose: the released code recomputes dim // n_head
        "intermediate_size": intermediate_size,
        "vocab_size": vocab_size,
        "block_size": block_size,
        "use_qk_norm": use_qk_norm,
        "window_size": window_size,
        "window_type": window_type,
        "query_wise": query_wise,
        "use_dcmha": True,
        "tie_word_embeddings": tie_word_embeddings,
        "is_training": False,
        "q_chunk_size": 128,
        "use_gradient_checkpointing": False,
        "custom_extra_key": {"kept": [1, 2, 3]},
        "torch_dtype": "float32",
        "transformers_version": "4.33.2",
    }
    if model_type == "dcpythia":
        cfg.update(
            bos_token_id=0, eos_token_id=0, rope_base=500.0, rotary_pct=0.5, norm_eps=1e-5,
            use_linear_bias=True, use_parallel_residual=True,
        )
    elif model_type == "dcformer":
        cfg.update(
            bos_token_id=1, eos_token_id=2, rope_base=500.0, norm_eps=1e-6, mgate=False, mgate_dim=44,
            prefill_pad=True,
        )
    else:
        raise ValueError(model_type)
    cfg.update(overrides)
    return {key: value for key, value in cfg.items() if value is not ...}


def body_of(cfg: dict) -> dict:
    """The released body's flags (spec, "Bodies"), read from a released config dict."""
    pythia = cfg.get("model_type", "dcpythia") == "dcpythia"
    return dict(
        pythia=pythia,
        bias=bool(cfg.get("use_linear_bias", pythia)),
        parallel=bool(cfg.get("use_parallel_residual", pythia)),
        layernorm=pythia,  # DCPythia: LayerNorm with bias; DCFormer++: RMSNorm, weight only
        gated=not pythia,  # DCFormer++: SwiGLU w2(silu(w1 x) * w3 x)
        rotary_pct=float(cfg.get("rotary_pct", 0.25 if pythia else 1.0)),
    )


def released_state_dict(
    cfg: dict,
    *,
    seed: int = 0,
    dyn_std: float = 0.3,
    split_qkv: bool = False,
    derived: bool = True,
    kv_cache: bool = False,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Random tensors under the released names and shapes (spec, "Released state-dict keys").

    Ordinary weights are N(0, 1/fan_in) (norm scales near 1, biases small but non-zero) so activations stay
    O(1). The dynamic-weight generator is scaled so that every composition term moves the result by O(1) without
    swamping it: dw1 and dd are N(0, 1/D), so the pre-activations of gelu and tanh are N(0, 1) (tanh(dd) is then
    about +-0.6, gelu's output O(1)); qkw is N(0, dyn_std^2) (0.3: w2 entries about 0.8, each low-rank term about
    as large as the identity term). Larger scales make the composed scores reach 50 and the logits so
    ill-conditioned that fp32 rounding alone exceeds 1e-4; smaller ones hide composition bugs. `split_qkv` stores wq/wk/wv instead of the fused wqkv. `derived` adds the derived tensors
    the released files carry: garbage merged copies `dw_m`/`qkw_m` (stale: they must never be used) and the
    identity static buffers `pre_proj.w`/`post_proj.w` [G, M, M]. `kv_cache` adds garbage decode buffers.
    """
    gen = torch.Generator().manual_seed(seed)
    D, N, L = cfg["dim"], cfg["n_head"], cfg["n_layer"]
    V, F_ = cfg["vocab_size"], cfg["intermediate_size"]
    Dh, M = D // N, N // GROUPS
    K = 4 * N
    C = 2 if cfg.get("query_wise") else SLOTS
    body = body_of(cfg)

    def randn(*shape, std=1.0, mean=0.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * std + mean

    def lin(out_f, in_f):
        return randn(out_f, in_f, std=1.0 / math.sqrt(in_f))

    def norm(prefix):
        sd[f"{prefix}.weight"] = randn(D, std=0.1, mean=1.0)
        if body["layernorm"]:
            sd[f"{prefix}.bias"] = randn(D, std=0.1)

    dw_std = 1.0 / math.sqrt(D)
    sd: dict[str, torch.Tensor] = {"tok_embeddings.weight": randn(V, D, std=2.0 / math.sqrt(D))}
    for layer in range(L):
        p = f"layers.{layer}."
        a = p + "attention."
        wqkv = lin(3 * D, D)  # rows: all queries, then all keys, then all values
        bqkv = randn(3 * D, std=0.1)
        if split_qkv:
            for i, name in enumerate(("wq", "wk", "wv")):
                sd[f"{a}{name}.weight"] = wqkv[i * D : (i + 1) * D].clone()
                if body["bias"]:
                    sd[f"{a}{name}.bias"] = bqkv[i * D : (i + 1) * D].clone()
        else:
            sd[a + "wqkv.weight"] = wqkv
            if body["bias"]:
                sd[a + "wqkv.bias"] = bqkv
        sd[a + "wo.weight"] = lin(D, D)
        if body["bias"]:
            sd[a + "wo.bias"] = randn(D, std=0.1)
        dw1 = randn(D, GROUPS, C, K, std=dw_std)
        qkw = randn(GROUPS, C, K, 2 * RANK, M, std=dyn_std)
        dd = randn(D, GROUPS, C * M, std=dw_std)
        sd[a + "dyn_w_proj.dw1"] = dw1
        sd[a + "dyn_w_proj.qkw"] = qkw
        sd[a + "dyn_w_proj.dd"] = dd
        if derived:
            # The released merge_weights(): dw_m = [dw1 flattened | dd] ([D, G*C*K + C*M]); qkw_m = qkw as
            # [C, K, 2I*M]. Here they are the right shapes but stale garbage: a loader that trusted them breaks.
            sd[a + "dyn_w_proj.dw_m"] = randn(D, GROUPS * C * K + C * M, std=5.0)
            sd[a + "dyn_w_proj.qkw_m"] = randn(C, K, 2 * RANK * M, std=5.0)
            eye = torch.eye(M).expand(GROUPS, M, M).contiguous()
            sd[a + "dyn_w_proj.pre_proj.w"] = eye.clone()
            sd[a + "dyn_w_proj.post_proj.w"] = eye.clone()
        if kv_cache:
            S = cfg["block_size"]
            sd[a + "kv_cache.k_cache"] = randn(1, N, S, Dh, std=3.0)
            sd[a + "kv_cache.v_cache"] = randn(1, N, S, Dh, std=3.0)
            sd[a + "kv_cache.kw_cache"] = randn(1, S, 2, N, N, std=3.0)
        if cfg.get("use_qk_norm"):
            sd[a + "q_norm.scale"] = randn(Dh, std=0.2, mean=1.0)
            sd[a + "k_norm.scale"] = randn(Dh, std=0.2, mean=1.0)
        norm(p + "attention_norm")
        norm(p + "ffn_norm")
        f = p + "feed_forward."
        sd[f + "w1.weight"] = lin(F_, D)
        sd[f + "w2.weight"] = lin(D, F_)
        if body["gated"]:
            sd[f + "w3.weight"] = lin(F_, D)
        if body["bias"]:
            sd[f + "w1.bias"] = randn(F_, std=0.1)
            sd[f + "w2.bias"] = randn(D, std=0.1)
    norm("norm")
    if not cfg.get("tie_word_embeddings"):
        sd["output.weight"] = lin(V, D)
    return {k: v.to(dtype) for k, v in sd.items()}


def _save(tensors: dict[str, torch.Tensor], path: Path, fmt: str) -> None:
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    elif fmt == "bin":
        torch.save(tensors, str(path))
    else:
        raise ValueError(fmt)


def shard_names(fmt: str, num_shards: int) -> list[str]:
    stem, ext = ("model", "safetensors") if fmt == "safetensors" else ("pytorch_model", "bin")
    if num_shards == 1:
        return [f"{stem}.{ext}"]
    return [f"{stem}-{i + 1:05d}-of-{num_shards:05d}.{ext}" for i in range(num_shards)]


def write_released_checkpoint(
    directory: str | Path,
    cfg: dict,
    state: dict[str, torch.Tensor],
    *,
    fmt: str = "safetensors",
    num_shards: int = 1,
    interleave: bool = True,
    tokenizer: bool = True,
) -> Path:
    """Write a released-layout checkpoint directory: config.json, weights, tokenizer.

    fmt: "safetensors" or "bin" (torch.save). num_shards > 1 writes `model-0000i-of-0000n.safetensors` (or
    `pytorch_model-...bin`) plus the transformers index json. With `interleave` the keys are dealt round-robin,
    so one layer's tensors (and split wq/wk/wv) straddle shards; otherwise shards are contiguous runs of keys
    of about equal byte size.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    names = shard_names(fmt, num_shards)
    keys = list(state)
    if num_shards == 1:
        groups = [keys]
    elif interleave:
        groups = [keys[i::num_shards] for i in range(num_shards)]
    else:
        # each tensor goes to the shard its middle byte falls in: contiguous shards of about total / num_shards
        total = sum(t.numel() * t.element_size() for t in state.values())
        groups, offset = [[] for _ in range(num_shards)], 0
        for key in keys:
            size = state[key].numel() * state[key].element_size()
            groups[min(num_shards - 1, int((offset + size / 2) * num_shards / total))].append(key)
            offset += size
        if not all(groups):
            raise ValueError(f"some of the {num_shards} shards would be empty: tensors too large for that many")
    weight_map = {}
    for name, group in zip(names, groups):
        _save({k: state[k] for k in group}, directory / name, fmt)
        weight_map.update({k: name for k in group})
    if num_shards > 1:
        index_name = "model.safetensors.index.json" if fmt == "safetensors" else "pytorch_model.bin.index.json"
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / index_name).write_text(json.dumps(index, indent=2) + "\n")
    if tokenizer:
        write_tokenizer(directory, cfg["vocab_size"])
    return directory


def write_tokenizer(directory: str | Path, vocab_size: int) -> list[str]:
    """A word-level tokenizer with `vocab_size` entries, built locally with `tokenizers` and saved through
    `PreTrainedTokenizerFast.save_pretrained` (tokenizer.json + tokenizer_config.json). Returns the file names."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<unk>", "<|pad|>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for i in range(len(specials), vocab_size):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<unk>",
        pad_token="<|pad|>",
    )
    directory = Path(directory)
    fast.save_pretrained(str(directory))
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(("tokenizer", "special_tokens")))


def released_dir(tmp_path, name="released", *, model_type="dcpythia", config_overrides=None, fmt="safetensors",
                 num_shards=1, seed=0, dtype=torch.float32, **state_kwargs):
    """Shortcut: config + random state + files in `tmp_path / name`. Returns (directory, cfg, state). The config's
    `torch_dtype` follows `dtype` unless `config_overrides` says otherwise."""
    cfg = released_config(model_type, **{"torch_dtype": str(dtype).removeprefix("torch."), **(config_overrides or {})})
    state = released_state_dict(cfg, seed=seed, dtype=dtype, **state_kwargs)
    directory = write_released_checkpoint(Path(tmp_path) / name, cfg, state, fmt=fmt, num_shards=num_shards)
    return directory, cfg, state
