"""A slow, independent reference implementation of DCMHA and of the DCFormer causal LM.

Written from `docs/spec.md` only: it never imports anything from `modeling_dcformer`. It takes plain tensors
(a module's or a model's state_dict) plus a config object from which it reads only plain numbers and flags.
Everything is spelled out with explicit loops over heads / slots / ranks and small einsums so that it can be
checked by eye against the formulas of the spec. It runs in whatever dtype its inputs have: the tests feed it
float64 copies so that its own rounding error is negligible next to the model's fp32 error.

Shapes (spec notation): B batch, T query length, S key length, P positions, D hidden size, N heads,
Dh = D / N, G head groups, M = N / G heads per group, C composition slots, K dynamic hidden width, I rank.
"""

import math

import torch

DW_RMS_EPS = 1e-6  # spec, step 5: w1 / sqrt(mean(w1^2 over M) + 1e-6)


# ----------------------------------------------------------------------------------------------------------------
# Elementwise functions (written out rather than borrowed)
# ----------------------------------------------------------------------------------------------------------------
def gelu_exact(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def silu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


ACTIVATIONS = {"gelu": gelu_exact, "silu": silu}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)  # biased variance
    out = (x - mean) / torch.sqrt(var + eps) * weight
    return out if bias is None else out + bias


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """nn.Linear convention: weight is [out, in]."""
    out = torch.einsum("...i,oi->...o", x, weight)
    return out if bias is None else out + bias


def softmax_last(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis; -inf entries get probability exactly 0."""
    x = x - x.max(-1, keepdim=True).values
    e = torch.exp(x)
    return e / e.sum(-1, keepdim=True)


# ----------------------------------------------------------------------------------------------------------------
# Windows (spec, "Windows")
# ----------------------------------------------------------------------------------------------------------------
WINDOW_PATTERNS = {None: "LG", "LG": "LG", "LGLL": "LGLL", "LGL6": "LGLLLLLL"}


def oracle_local_layers(window_size: int | None, window_type: str | None, num_layers: int) -> list[bool]:
    """Per-layer "is local" flags: window_size None -> all global; else the named pattern repeated."""
    if window_size is None:
        return [False] * num_layers
    pattern = WINDOW_PATTERNS[window_type]
    return [pattern[layer % len(pattern)] == "L" for layer in range(num_layers)]


def oracle_visible(T: int, window: int | None) -> torch.Tensor:
    """[T, T] bool: query t sees key s iff s <= t and (global or t - window < s)."""
    allowed = torch.zeros(T, T, dtype=torch.bool)
    for t in range(T):
        for s in range(T):
            ok = s <= t
            if window is not None:
                ok = ok and (t - window < s)
            allowed[t, s] = ok
    return allowed


# ----------------------------------------------------------------------------------------------------------------
# Rotary embedding (GPT-NeoX "rotate half" on the first `rot` dims)
# ----------------------------------------------------------------------------------------------------------------
def oracle_rotary(x: torch.Tensor, positions: torch.Tensor, rot: int, base: float) -> torch.Tensor:
    """x: [B, N, T, Dh]; positions: [T]. Pairs dimension j with j + rot/2 for j < rot/2, angle pos * base^(-2j/rot)."""
    if rot == 0:
        return x
    half = rot // 2
    out = x.clone()
    for j in range(half):
        inv_freq = 1.0 / (base ** (2.0 * j / rot))
        angle = positions.to(x.dtype) * inv_freq  # [T]
        cos, sin = torch.cos(angle), torch.sin(angle)
        a, b = x[..., j], x[..., j + half]  # [B, N, T]
        out[..., j] = a * cos - b * sin
        out[..., j + half] = b * cos + a * sin
    return out


# ----------------------------------------------------------------------------------------------------------------
# Compose (spec, "Compose(A) for one slot pair")
# ----------------------------------------------------------------------------------------------------------------
def oracle_compose(A, qw1, qw2, qdd, kw1=None, kw2=None, kdd=None):
    """One Compose with heads mixed within each group.

    A: [B, N, T, S]; qw1, qw2: [B, T, G, I, M]; qdd: [B, T, G, M] (indexed by the query t);
    kw1, kw2: [B, S, G, I, M]; kdd: [B, S, G, M] (indexed by the key s), or all None (query-wise).
    Head m of group g is head g * M + m of A.

        out[m,t,s] = A[m,t,s]
                   + sum_i (sum_n A[n,t,s] qw1[t,i,n]) qw2[t,i,m]
                   + sum_i (sum_n A[n,t,s] kw1[s,i,n]) kw2[s,i,m]
                   + A[m,t,s] qdd[t,m] + A[m,t,s] kdd[s,m]
    """
    B, N, T, S = A.shape
    _, _, G, I, M = qw1.shape
    assert G * M == N, (G, M, N)
    key_wise = kw1 is not None
    out_heads = []
    for g in range(G):
        for m in range(M):
            head = g * M + m
            o = A[:, head]  # [B, T, S], the identity term
            for i in range(I):
                q_mix = sum(A[:, g * M + n] * qw1[:, :, g, i, n][:, :, None] for n in range(M))  # [B, T, S]
                o = o + q_mix * qw2[:, :, g, i, m][:, :, None]
                if key_wise:
                    k_mix = sum(A[:, g * M + n] * kw1[:, :, g, i, n][:, None, :] for n in range(M))
                    o = o + k_mix * kw2[:, :, g, i, m][:, None, :]
            o = o + A[:, head] * qdd[:, :, g, m][:, :, None]
            if key_wise:
                o = o + A[:, head] * kdd[:, :, g, m][:, None, :]
            out_heads.append(o)
    return torch.stack(out_heads, dim=1)


def expand_kv(x, num_heads):
    """Grouped-query attention's keys or values [B, Nkv, S, Dh] as one copy per query head [B, N, S, Dh]: query head
    n reads key/value head n // (N / Nkv)."""
    Nkv = x.shape[1]
    assert num_heads % Nkv == 0, (num_heads, Nkv)
    return torch.stack([x[:, n // (num_heads // Nkv)] for n in range(num_heads)], dim=1)


def oracle_attention(q, k, v, qt, kt, pad, query_start, key_start, window, rank):
    """DCMHA of one layer from the spec (float64 in, float64 out): q [B, N, T, Dh], k/v [B, Nkv, S, Dh] (query head
    n with key/value head n // (N / Nkv)), qt [B, T, G, 2, 2I+1, M], kt [B, S, G, 2, 2I+1, M] or None, pad [B, S]
    bool or None. Returns [B, T, N, Dh]."""
    B, N, T, Dh = q.shape
    k, v = expand_kv(k, N), expand_kv(v, N)
    S = k.shape[2]
    q_pos, k_pos = torch.arange(query_start, query_start + T), torch.arange(key_start, key_start + S)
    allowed = (k_pos[None, :] <= q_pos[:, None]).expand(B, T, S)
    if window is not None:
        allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
    if pad is not None:
        allowed = allowed & pad[:, None, :]
    I = rank

    def slot(terms, j):
        return () if terms is None else (terms[:, :, :, j, :I], terms[:, :, :, j, I : 2 * I], terms[:, :, :, j, 2 * I])

    mask = allowed[:, None]
    pre = oracle_compose(q @ k.transpose(-1, -2) * Dh**-0.5, *slot(qt, 0), *slot(kt, 0))
    probs = torch.softmax(pre.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)  # no visible key: 0
    post = oracle_compose(probs, *slot(qt, 1), *slot(kt, 1)).masked_fill(~mask, 0.0)
    return (post @ v).transpose(1, 2)


# ----------------------------------------------------------------------------------------------------------------
# Dynamic weights (spec, step 5)
# ----------------------------------------------------------------------------------------------------------------
def oracle_dynamic_weights(x, dw1, qkw, dd_w, rank):
    """x: [B, P, D]; dw1: [D, G, C, K]; qkw: [G, C, K, 2I, M]; dd_w: [D, G, C*M].

    Returns a list over the C slots of (w1 [B, P, G, I, M] RMS-normalised over M, w2 [B, P, G, I, M],
    dd [B, P, G, M]).
    """
    D, G, C, K = dw1.shape
    M = qkw.shape[-1]
    assert qkw.shape == (G, C, K, 2 * rank, M), qkw.shape
    assert dd_w.shape == (D, G, C * M), dd_w.shape
    h = gelu_exact(torch.einsum("bpd,dgck->bpgck", x, dw1))
    dd_all = torch.tanh(torch.einsum("bpd,dgj->bpgj", x, dd_w))  # [B, P, G, C*M]
    slots = []
    for c in range(C):
        w = torch.einsum("bpgk,gkjm->bpgjm", h[:, :, :, c], qkw[:, c])  # [B, P, G, 2I, M]
        w1, w2 = w[:, :, :, :rank], w[:, :, :, rank:]
        w1 = w1 / torch.sqrt((w1 * w1).mean(-1, keepdim=True) + DW_RMS_EPS)
        dd = dd_all[..., c * M : (c + 1) * M]
        slots.append((w1, w2, dd))
    return slots


# ----------------------------------------------------------------------------------------------------------------
# One attention layer (spec, "One DCMHA layer")
# ----------------------------------------------------------------------------------------------------------------
def _rope_settings(config):
    rope = config.rope_parameters
    return float(rope["rope_theta"]), float(rope.get("partial_rotary_factor", 1.0))


def oracle_dcmha_layer(x, params, config, window=None, positions=None, return_probs=False):
    """Output of one (DC)MHA self-attention layer.

    x: [B, T, D] (the attention's input, i.e. after the layer's input norm).
    params: the attention module's state_dict as plain tensors, keys `qkv_proj.weight` (+ `.bias`),
        `o_proj.weight` (+ `.bias`), `q_norm.weight`/`k_norm.weight` when config.use_qk_norm, and
        `dyn_w_proj.dw1`/`.qkw`/`.dd` when config.use_dcmha.
    config: read for hidden_size, num_attention_heads, use_qk_norm, qk_norm_eps, rope_parameters, use_dcmha,
        query_wise, dynamic_rank.
    window: None (global layer) or the window size of a local layer.
    positions: [T] rotary positions, default 0..T-1.
    """
    B, T, D = x.shape
    N = config.num_attention_heads
    Nkv = getattr(config, "num_key_value_heads", None) or N
    Dh = getattr(config, "head_dim", None) or D // N
    if positions is None:
        positions = torch.arange(T)

    # 1. fused projection, all queries (N heads) then all keys then all values (Nkv heads each)
    qkv = linear(x, params["qkv_proj.weight"], params.get("qkv_proj.bias"))  # [B, T, (N + 2 Nkv) Dh]
    q, k, v = qkv[..., : N * Dh], qkv[..., N * Dh : (N + Nkv) * Dh], qkv[..., (N + Nkv) * Dh :]
    q = q.reshape(B, T, N, Dh).permute(0, 2, 1, 3)  # [B, N, T, Dh]
    k = expand_kv(k.reshape(B, T, Nkv, Dh).permute(0, 2, 1, 3), N)  # [B, N, T, Dh], a copy per query head
    v = expand_kv(v.reshape(B, T, Nkv, Dh).permute(0, 2, 1, 3), N)

    # 2. qk-norm per head over Dh
    if config.use_qk_norm:
        q = rms_norm(q, params["q_norm.weight"], config.qk_norm_eps)
        k = rms_norm(k, params["k_norm.weight"], config.qk_norm_eps)

    # 3. rotary on the first int(Dh * factor) dims
    base, factor = _rope_settings(config)
    rot = int(Dh * factor)
    q = oracle_rotary(q, positions, rot, base)
    k = oracle_rotary(k, positions, rot, base)

    # 4. scores
    A = torch.einsum("bntd,bnsd->bnts", q, k) / math.sqrt(Dh)

    # 5. dynamic weights; slot order (pre-q, pre-k, post-q, post-k), or (pre-q, post-q) when query-wise
    if config.use_dcmha:
        slots = oracle_dynamic_weights(
            x, params["dyn_w_proj.dw1"], params["dyn_w_proj.qkw"], params["dyn_w_proj.dd"], config.dynamic_rank
        )
        if config.query_wise:
            assert len(slots) == 2
            pre_q, post_q = slots
            pre_k = post_k = (None, None, None)
        else:
            assert len(slots) == 4
            pre_q, pre_k, post_q, post_k = slots

    # 6. pre-compose, mask, softmax, post-compose, P v, o_proj
    if config.use_dcmha:
        A = oracle_compose(A, *pre_q, *pre_k)
    allowed = oracle_visible(T, window)  # [T, S]
    A = A.masked_fill(~allowed, float("-inf"))
    probs = softmax_last(A)
    if config.use_dcmha:
        probs = oracle_compose(probs, *post_q, *post_k)
    o = torch.einsum("bnts,bnsd->bntd", probs, v)  # [B, N, T, Dh]
    o = o.permute(0, 2, 1, 3).reshape(B, T, N * Dh)  # heads concatenated
    out = linear(o, params["o_proj.weight"], params.get("o_proj.bias"))
    return (out, probs) if return_probs else out


# ----------------------------------------------------------------------------------------------------------------
# Whole causal LM (spec, "Bodies")
# ----------------------------------------------------------------------------------------------------------------
def _sub(state, prefix):
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def _norm(x, params, config):
    if config.norm_type == "rmsnorm":
        return rms_norm(x, params["weight"], config.layer_norm_eps)
    if config.norm_type == "layernorm":
        return layer_norm(x, params["weight"], params.get("bias"), config.layer_norm_eps)
    raise ValueError(config.norm_type)


def _mlp(x, params, config):
    act = ACTIVATIONS[config.hidden_act]
    up = linear(x, params["up_proj.weight"], params.get("up_proj.bias"))
    if config.use_gated_mlp:  # w2(act(w1 x) * w3 x), gate_proj = w1, up_proj = w3
        hidden = act(linear(x, params["gate_proj.weight"], params.get("gate_proj.bias"))) * up
    else:  # w2(act(w1 x))
        hidden = act(up)
    return linear(hidden, params["down_proj.weight"], params.get("down_proj.bias"))


def oracle_causal_lm(state, config, input_ids, local_layers=None):
    """Logits [B, T, V] of the whole model from its state_dict (keys as in DCFormerForCausalLM).

    local_layers: per-layer "is local" flags, by default derived from window_size / window_type as the spec says.
    """
    if local_layers is None:
        local_layers = oracle_local_layers(config.window_size, config.window_type, config.num_hidden_layers)
    h = state["model.embed_tokens.weight"][input_ids]
    for layer in range(config.num_hidden_layers):
        p = _sub(state, f"model.layers.{layer}.")
        window = config.window_size if local_layers[layer] else None
        attn = oracle_dcmha_layer(_norm(h, _sub(p, "input_layernorm."), config), _sub(p, "self_attn."), config, window)
        if config.use_parallel_residual:  # x + attn(ln1 x) + mlp(ln2 x)
            h = h + attn + _mlp(_norm(h, _sub(p, "post_attention_layernorm."), config), _sub(p, "mlp."), config)
        else:  # h = x + attn(ln1 x); h + mlp(ln2 h)
            h = h + attn
            h = h + _mlp(_norm(h, _sub(p, "post_attention_layernorm."), config), _sub(p, "mlp."), config)
    h = _norm(h, _sub(state, "model.norm."), config)
    head = state["lm_head.weight"] if "lm_head.weight" in state else state["model.embed_tokens.weight"]
    return linear(h, head)
