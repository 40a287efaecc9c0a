"""DCFormer: a causal LM whose attention is DCMHA (Dynamically Composable Multi-Head Attention).

Xiao, Meng, Li, Yuan, "Improving Transformers with Dynamically Composable Multi-Head Attention", ICML 2024.
The maths follows `shared/DCMHA.md`; this file is self-contained (torch + transformers + the config next to
it) so that it can travel to the Hub as remote code.

Layout of one attention layer (`DCFormerAttention`):
    qkv_proj            fused [q; k; v] projection, all queries then all keys then all values
    q_norm, k_norm      optional per-head RMSNorm (qk-norm)
    dyn_w_proj          the composition weights' generator: dw1 [D, G, C, K], qkw [G, C, K, 2I, M], dd [D, G, C*M]
    o_proj              output projection
"""

import importlib.util
import os
import shutil
from collections.abc import Callable

import torch
import torch.nn.functional as F
import torch.fx.experimental._config
import torch.utils.checkpoint
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer
from transformers.generation import GenerationMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import PreTrainedModel
from transformers.utils import logging

from .configuration_dcformer import DCFormerConfig
from .cpu_kernel import MAX_RANK as KERNEL_MAX_RANK
from .cpu_kernel import compose_softmax_compose
from .cpu_kernel import load as load_cpu_kernel
from .released_format import IGNORED as RELEASED_IGNORED_KEYS
from .triton_kernel import dcmha_triton
from .triton_kernel import unsupported as triton_unsupported
from .released_format import key_renames, query_wise_slots

logger = logging.get_logger(__name__)

DW_RMS_EPS = 1e-6  # eps of the RMS normalisation of the dynamic w1 factors (spec, step 5)


# ----------------------------------------------------------------------------------------------------------------
# Norms, rotary embedding, MLP
# ----------------------------------------------------------------------------------------------------------------
class DCFormerRMSNorm(nn.Module):
    """RMSNorm with a learned scale, computed in fp32."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x).to(dtype)


class DCFormerLayerNorm(nn.LayerNorm):
    """LayerNorm computed in fp32 whatever the parameter dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps).to(x.dtype)


def make_norm(config: DCFormerConfig) -> nn.Module:
    if config.norm_type == "rmsnorm":
        return DCFormerRMSNorm(config.hidden_size, eps=config.layer_norm_eps)
    return DCFormerLayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class DCFormerRotaryEmbedding(nn.Module):
    """Rotary embedding over the first `partial_rotary_factor * head_dim` dims (GPT-NeoX "rotate half")."""

    def __init__(self, config: DCFormerConfig):
        super().__init__()
        self.config = config
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        self.rope_type = config.rope_parameters["rope_type"]
        rope_init_fn: Callable = self.compute_default_rope_parameters
        if self.rope_type != "default":
            rope_init_fn = ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = rope_init_fn(config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(config: DCFormerConfig, device=None, **kwargs) -> tuple[torch.Tensor, float]:
        base = config.rope_parameters["rope_theta"]
        dim = int(config.head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim))
        return inv_freq, 1.0

    @torch.no_grad()
    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling  # fp32, [B, T, rot]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, N, T, Dh]; cos/sin: [B, T, rot] (fp32). Rotates the first `rot` dims, in fp32."""
    rot = cos.shape[-1]
    if rot == 0:
        return x
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x_rot, x_pass = x[..., :rot].float(), x[..., rot:]
    x_rot = x_rot * cos + rotate_half(x_rot) * sin
    return torch.cat((x_rot.to(x.dtype), x_pass), dim=-1)


class DCFormerMLP(nn.Module):
    """`down(act(up x))`, or SwiGLU-style `down(act(gate x) * up x)` when `use_gated_mlp`."""

    def __init__(self, config: DCFormerConfig):
        super().__init__()
        self.use_gated_mlp = config.use_gated_mlp
        if self.use_gated_mlp:
            self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_gated_mlp:
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(self.act_fn(self.up_proj(x)))


# ----------------------------------------------------------------------------------------------------------------
# DCMHA
# ----------------------------------------------------------------------------------------------------------------
class DynamicWeightProjection(nn.Module):
    """Generates the composition weights of every position from the attention input x (spec, step 5).

    Parameters keep the released names and shapes: dw1 [D, G, C, K], qkw [G, C, K, 2I, M], dd [D, G, C*M].
    `forward` returns the terms of every slot packed as [B, T, G, C, 2I+1, M]: rows 0..I-1 are w1
    (RMS-normalised over M), rows I..2I-1 are w2, and row 2I is the diagonal (tanh).
    """

    def __init__(self, config: DCFormerConfig):
        super().__init__()
        D, G, M = config.hidden_size, config.num_head_groups, config.heads_per_group
        C, K, I = config.num_composition_slots, config.dynamic_hidden_size, config.dynamic_rank
        self.num_groups, self.num_slots, self.rank, self.heads_per_group = G, C, I, M
        self.dw1 = nn.Parameter(torch.empty(D, G, C, K))
        self.qkw = nn.Parameter(torch.empty(G, C, K, 2 * I, M))
        self.dd = nn.Parameter(torch.empty(D, G, C * M))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        G, C, I, M = self.num_groups, self.num_slots, self.rank, self.heads_per_group
        K = self.dw1.shape[-1]
        # plain matrix products (einsum's dispatch costs more than the products at a decode step)
        h = F.gelu(x.reshape(B * T, D) @ self.dw1.to(x.dtype).view(D, G * C * K))  # [BT, GCK]
        w = torch.bmm(h.view(B * T, G * C, K).transpose(0, 1), self.qkw.to(x.dtype).view(G * C, K, 2 * I * M))
        w = w.transpose(0, 1).reshape(B, T, G, C, 2 * I, M).float()  # [B, T, G, C, 2I, M]
        w1, w2 = w[..., :I, :], w[..., I:, :]
        w1 = w1 * torch.rsqrt(w1.pow(2).mean(-1, keepdim=True) + DW_RMS_EPS)
        diag = torch.tanh((x.reshape(B * T, D) @ self.dd.to(x.dtype).view(D, G * C * M)).float())
        return torch.cat((w1, w2, diag.view(B, T, G, C, 1, M)), dim=4)


def compose(
    scores: torch.Tensor,
    query_terms: torch.Tensor,
    key_terms: torch.Tensor | None,
    rank: int,
) -> torch.Tensor:
    """Compose heads of `scores` ([B, G, M, T, S], fp32) for one slot pair.

    query_terms: [B, T, G, 2I+1, M] (w1, w2, dd of the query slot, indexed by t);
    key_terms:   [B, S, G, 2I+1, M] (of the key slot, indexed by s) or None for query-wise composition.
        out[m,t,s] = A[m,t,s] (1 + qdd[t,m] + kdd[s,m])
                   + sum_i (sum_n A[n,t,s] qw1[t,i,n]) qw2[t,i,m] + sum_i (sum_n A[n,t,s] kw1[s,i,n]) kw2[s,i,m]
    """
    I = rank
    qw1, qw2, qdd = query_terms[..., :I, :], query_terms[..., I : 2 * I, :], query_terms[..., 2 * I, :]
    diag = 1 + qdd.permute(0, 2, 3, 1).unsqueeze(-1)  # [B, G, M, T, 1]
    if key_terms is not None:
        kdd = key_terms[..., 2 * I, :]
        diag = diag + kdd.permute(0, 2, 3, 1).unsqueeze(-2)  # [B, G, M, T, S]
    out = scores * diag
    hidden = torch.einsum("bgnts,btgin->bgits", scores, qw1)
    out = out + torch.einsum("bgits,btgim->bgmts", hidden, qw2)
    if key_terms is not None:
        kw1, kw2 = key_terms[..., :I, :], key_terms[..., I : 2 * I, :]
        hidden = torch.einsum("bgnts,bsgin->bgits", scores, kw1)
        out = out + torch.einsum("bgits,bsgim->bgmts", hidden, kw2)
    return out


def compose_one_query(
    scores: torch.Tensor,
    query_terms: torch.Tensor,
    key_terms: torch.Tensor | None,
    rank: int,
) -> torch.Tensor:
    """`compose` for a single query (T = 1, a decode step), in few ops: the query-wise terms fold into one M x M
    matrix per group, diag(1 + qdd) + qw2^T qw1, applied with one matmul; the key-wise terms are per-key
    products and sums over the M heads. Same arguments, same result."""
    I = rank
    qt = query_terms[:, 0]  # [B, G, 2I+1, M]
    qw1, qw2, qdd = qt[:, :, :I], qt[:, :, I : 2 * I], qt[:, :, 2 * I]
    mix = qw2.transpose(-1, -2) @ qw1 + torch.diag_embed(1 + qdd)  # [B, G, M, M]: out_m = sum_n mix[m, n] A_n
    out = (mix @ scores.squeeze(3)).unsqueeze(3)  # [B, G, M, 1, S]
    if key_terms is not None:
        kt = key_terms.permute(0, 2, 3, 4, 1)  # [B, G, 2I+1, M, S]
        kw1, kw2, kdd = kt[:, :, :I], kt[:, :, I : 2 * I], kt[:, :, 2 * I]
        a = scores.squeeze(3)  # [B, G, M, S]
        hidden = (a.unsqueeze(2) * kw1).sum(3, keepdim=True)  # [B, G, I, 1, S]
        out = out + (a * kdd + (kw2 * hidden).sum(2)).unsqueeze(3)
    return out


def compose_pointwise(
    scores: torch.Tensor,
    query_terms: torch.Tensor,
    key_terms: torch.Tensor | None,
    rank: int,
) -> torch.Tensor:
    """`compose` written as broadcast products and sums over heads, for torch.compile: it fuses all of it into
    one pass over the scores, each (t, s) reading its N scores once. Same arguments, same result. Eager
    PyTorch would build [B, G, I, M, T, S] temporaries here: use `compose` there."""
    I = rank
    qt = query_terms.permute(0, 2, 3, 4, 1)  # [B, G, 2I+1, M, T]
    qw1, qw2, qdd = qt[:, :, :I], qt[:, :, I : 2 * I], qt[:, :, 2 * I]
    hidden = (scores.unsqueeze(2) * qw1.unsqueeze(-1)).sum(3)  # [B, G, I, T, S]
    out = scores * (1 + qdd.unsqueeze(-1)) + (qw2.unsqueeze(-1) * hidden.unsqueeze(3)).sum(2)
    if key_terms is not None:
        kt = key_terms.permute(0, 2, 3, 4, 1)  # [B, G, 2I+1, M, S]
        kw1, kw2, kdd = kt[:, :, :I], kt[:, :, I : 2 * I], kt[:, :, 2 * I]
        hidden = (scores.unsqueeze(2) * kw1.unsqueeze(-2)).sum(3)
        out = out + scores * kdd.unsqueeze(-2) + (kw2.unsqueeze(-2) * hidden.unsqueeze(3)).sum(2)
    return out


def attend_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_terms: torch.Tensor | None,
    key_terms: torch.Tensor | None,
    allowed: torch.Tensor,
    rank: int,
    num_groups: int,
    pointwise: bool = False,
    need_probs: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """DCMHA for one chunk of queries against the keys it can see.

    q: [B, N, c, Dh]; k, v: [B, N, s, Dh]; query_terms: [B, c, G, Cq, 2I+1, M] (pre-query, post-query slots)
    or None; key_terms: [B, s, G, Ck, 2I+1, M] (pre-key, post-key) or None; allowed: bool, broadcastable to
    [B, N, c, s], or None when every query sees every key. `pointwise` composes with `compose_pointwise` (for
    torch.compile) instead of `compose`.
    Returns the output [B, c, N, Dh] and the composed probabilities [B, N, c, s] (fp32; None unless
    `need_probs`).
    """
    B, N, c, Dh = q.shape
    s = k.shape[2]
    if query_terms is None and not need_probs:  # plain multi-head attention: SDPA's fused kernel
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(1, 2), None  # empty rows: 0
    G, M = num_groups, N // num_groups
    compose_fn = compose_pointwise if pointwise else compose_one_query if c == 1 else compose
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * Dh**-0.5  # [B, N, c, s]
    if query_terms is not None:
        scores = compose_fn(
            scores.view(B, G, M, c, s),
            query_terms[:, :, :, 0],
            key_terms[:, :, :, 0] if key_terms is not None else None,
            rank,
        ).view(B, N, c, s)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, torch.finfo(torch.float32).min)
    probs = torch.softmax(scores, dim=-1)
    if query_terms is not None:
        probs = compose_fn(
            probs.view(B, G, M, c, s),
            query_terms[:, :, :, 1],
            key_terms[:, :, :, 1] if key_terms is not None else None,
            rank,
        ).view(B, N, c, s)
        if allowed is not None:
            probs = probs.masked_fill(~allowed, 0.0)  # rows with no visible key (padding) stay finite
    out = torch.matmul(probs.to(v.dtype), v).transpose(1, 2)
    return out, (probs if need_probs else None)


def compose_hidden(scores: torch.Tensor, w1: torch.Tensor, key_wise: bool) -> torch.Tensor:
    """The low-rank hidden values of Compose: sum_n A[n,t,s] w1[i,n] (w1 of the query at t, or of the key at s
    when `key_wise`). scores: [B, G, M, T, S]; w1: [B, G, I, M, T or S] (time last). Returns [B, G, I, T, S].
    Written as a sum of M products (M is static): elementwise work that Inductor vectorises along the keys; as a
    `.sum()` over heads it became a reduction loop twice as slow once the lengths are dynamic."""
    hidden = None
    for n in range(scores.shape[2]):
        w = w1[:, :, :, n].unsqueeze(-2) if key_wise else w1[:, :, :, n].unsqueeze(-1)
        term = scores[:, :, n].unsqueeze(2) * w
        hidden = term if hidden is None else hidden + term
    return hidden


def compose_apply(
    scores: torch.Tensor,
    query_terms: torch.Tensor,
    key_terms: torch.Tensor | None,
    hidden_q: torch.Tensor,
    hidden_k: torch.Tensor | None,
    rank: int,
) -> torch.Tensor:
    """The rest of Compose once the hidden values are known: A (1 + qdd + kdd) + sum_i hidden_i w2_i.
    query_terms: [B, G, 2I+1, M, T], key_terms: [B, G, 2I+1, M, S] (time last)."""
    I = rank
    out = scores * (1 + query_terms[:, :, 2 * I].unsqueeze(-1))
    for i in range(I):
        out = out + query_terms[:, :, I + i].unsqueeze(-1) * hidden_q[:, :, i].unsqueeze(2)
    if key_terms is not None:
        out = out + scores * key_terms[:, :, 2 * I].unsqueeze(-2)
        for i in range(I):
            out = out + key_terms[:, :, I + i].unsqueeze(-2) * hidden_k[:, :, i].unsqueeze(2)
    return out


def visible_keys(
    q_pos: torch.Tensor, k_pos: torch.Tensor, window_size: int | None, key_padding_mask: torch.Tensor | None
) -> torch.Tensor:
    """[1 or B, 1, c, s] bool: the query at absolute position q_pos[t] sees the key at k_pos[s] (causal, within the
    window, and the key is a real token where key_padding_mask [B, s] is given)."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window_size is not None:
        allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window_size)
    allowed = allowed[None, None]
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask[:, None, None, :]
    return allowed


def stage_hidden(
    scores: torch.Tensor, query_terms: torch.Tensor, key_terms: torch.Tensor | None, scale: float, rank: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stage of `attend_chunk_staged`: the hidden values of one Compose, of `scores * scale` ([B, G, M, c, s])."""
    hidden_q = compose_hidden(scores * scale, query_terms[:, :, :rank], key_wise=False)
    hidden_k = None if key_terms is None else compose_hidden(scores * scale, key_terms[:, :, :rank], key_wise=True)
    return hidden_q, hidden_k


def stage_apply(
    scores: torch.Tensor,
    query_terms: torch.Tensor,
    key_terms: torch.Tensor | None,
    hidden_q: torch.Tensor,
    hidden_k: torch.Tensor | None,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    window_size: int | None,
    scale: float,
    fill: float | None,
    rank: int,
) -> torch.Tensor:
    """Stage of `attend_chunk_staged`: one Compose of `scores * scale` finished, its masked entries set to `fill`
    (None: left as they are). Returns [B, N, c, s]."""
    B, G, M, c, s = scores.shape
    out = compose_apply(scores * scale, query_terms, key_terms, hidden_q, hidden_k, rank).view(B, G * M, c, s)
    if fill is not None:
        allowed = visible_keys(q_pos, k_pos, window_size, key_padding_mask)  # from indices: no [c, s] mask read
        out = out.masked_fill(~allowed, fill)
    return out


_compiled_stages: dict = {}
COMPILE_BACKEND = "inductor"  # the tests swap in "aot_eager" (same tracing and autograd, no C++ to build)


def compiled_stage(fn: Callable) -> Callable:
    """`fn` through torch.compile, compiled once per process. Every graph of a stage must be the one its inputs
    select, in the forward pass and in the recomputation of a checkpointed chunk alike; a later, more general
    graph must never shadow an earlier one. So the lengths marked dynamic are dynamic from the first call, and
    nothing else becomes dynamic later: no automatic dynamic shapes (a new batch size, window or scale gets a
    graph specialised to it) and no duck sizing (a chunk with as many queries as keys gets no graph of its own)."""
    if fn not in _compiled_stages:
        compiled = torch.compile(fn, backend=COMPILE_BACKEND)

        def run(*args):
            with (
                torch.fx.experimental._config.patch(use_duck_shape=False),
                torch._dynamo.config.patch(automatic_dynamic_shapes=False, recompile_limit=64),
            ):
                return compiled(*args)

        _compiled_stages[fn] = run
    return _compiled_stages[fn]


def attend_chunk_staged(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_terms: torch.Tensor,
    key_terms: torch.Tensor | None,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    window_size: int | None,
    rank: int,
    num_groups: int,
    need_probs: bool = True,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`attend_chunk` in stages, each one generated code when `compiled` (the "compiled" implementation): the
    same numbers. The matrix products and the softmax run as PyTorch's own kernels; the two Compose steps are
    each two compiled stages, the hidden values (`stage_hidden`) then the rest (`stage_apply`): Inductor writes
    each stage's result once. (One fused kernel re-derived the hidden values for every output head and the
    composed scores in every softmax pass, and its softmax was slower than PyTorch's.)

    Layouts are the ones the generated loops vectorise: query_terms [B, G, Cq, 2I+1, M, c] and key_terms
    [B, G, Ck, 2I+1, M, s] have time last (the key-wise factors are contiguous along the keys). The mask is
    computed inside the stages from the absolute positions q_pos [c] and k_pos [s] (int64), the window and
    key_padding_mask ([B, s] bool, True for real tokens, or None): no [c, s] mask is read from memory, and the
    scaled scores are never written (the stages scale the raw q.k products themselves).
    """
    B, N, c, Dh = q.shape
    s = k.shape[2]
    G, M = num_groups, N // num_groups
    hidden_fn, apply_fn = stage_hidden, stage_apply
    if compiled:
        hidden_fn, apply_fn = compiled_stage(stage_hidden), compiled_stage(stage_apply)
    mask = (q_pos, k_pos, key_padding_mask, window_size)
    # each slot copied to standard strides (a few numbers per token; `.contiguous()` keeps odd strides on size-1
    # dims): the compiled stages see no strides to specialise on
    pre_q, post_q = packed(query_terms[:, :, 0]), packed(query_terms[:, :, 1])
    pre_k = packed(key_terms[:, :, 0]) if key_terms is not None else None
    post_k = packed(key_terms[:, :, 1]) if key_terms is not None else None
    scale = Dh**-0.5
    raw = torch.matmul(q, k.transpose(-1, -2)).float().view(B, G, M, c, s)
    if compiled:  # batch and lengths dynamic from the first call (see `compiled_stage`)
        for tensor in (pre_q, pre_k, post_q, post_k, key_padding_mask):
            mark_dynamic(tensor, 0, -1)
        mark_dynamic(q_pos, 0)
        mark_dynamic(k_pos, 0)
        mark_dynamic(raw, 0, -2, -1)
    hidden = hidden_fn(raw, pre_q, pre_k, scale, rank)
    if compiled:
        for tensor in hidden:
            mark_dynamic(tensor, 0, -2, -1)
    scores = apply_fn(raw, pre_q, pre_k, *hidden, *mask, scale, torch.finfo(torch.float32).min, rank)
    probs = torch.softmax(scores, dim=-1).view(B, G, M, c, s)
    if compiled:
        mark_dynamic(probs, 0, -2, -1)
    hidden = hidden_fn(probs, post_q, post_k, 1.0, rank)
    if compiled:
        for tensor in hidden:
            mark_dynamic(tensor, 0, -2, -1)
    # rows with no visible key (padding) are zeroed; without padding, masked keys are exactly 0 already
    probs = apply_fn(probs, post_q, post_k, *hidden, *mask, 1.0, 0.0 if key_padding_mask is not None else None, rank)
    out = torch.matmul(probs.to(v.dtype), v).transpose(1, 2)
    return out, (probs if need_probs else None)


def packed(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` with standard (row-major) strides."""
    return tensor.clone(memory_format=torch.contiguous_format)


def mark_dynamic(tensor: torch.Tensor | None, *dims: int) -> None:
    """Mark dims of a compiled stage's argument dynamic (batch, query and key lengths: one compilation serves
    every chunk); the others (heads, head size, ranks) stay static, so that the generated loops over them are
    unrolled and vectorised."""
    if tensor is not None:
        for dim in dims:
            torch._dynamo.maybe_mark_dynamic(tensor, dim % tensor.dim())  # a negative dim would be ignored


# "auto" compiles an attention call whose chunks compute at least this many scores in all (heads x queries x
# keys each chunk sees): below it, eager ops are as fast and no compilation is paid.
AUTO_COMPILE_MIN_SCORES = 1 << 20
# Local layers take chunks of at most max(LOCAL_CHUNK_MIN, window // 2) queries: a chunk of c queries touches
# c + window - 1 keys, so the scores computed are within 1.5x of the window band (3x with c = 512, window 256).
LOCAL_CHUNK_MIN = 64
_compile_failed = False


def compile_supported(device: torch.device) -> bool:
    """Whether torch.compile's default backend can generate code for `device` here."""
    if device.type == "cpu":
        return any(shutil.which(cxx) for cxx in (os.environ.get("CXX", "g++"), "g++", "c++", "clang++"))
    if device.type == "cuda":
        return importlib.util.find_spec("triton") is not None
    return False


def compiled_attend_chunk(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The "compiled" implementation of a chunk: `attend_chunk_staged` (same arguments) with compiled stages."""
    return attend_chunk_staged(*args, compiled=True, **kwargs)


def disable_auto_compile(err: Exception) -> None:
    """After torch.compile failed once, "auto" stays eager in this process."""
    global _compile_failed
    _compile_failed = True
    logger.warning(
        f"torch.compile of the DCMHA attention failed ({type(err).__name__}: {str(err)[:200]}); "
        'dcmha_implementation="auto" falls back to "eager" (same numbers, slower)'
    )


def run_chunk(chunk_fn: Callable, args: tuple, kwargs: dict, recompute: bool):
    """One chunk, its intermediates recomputed in the backward pass when `recompute`."""
    if recompute:
        return torch.utils.checkpoint.checkpoint(chunk_fn, *args, use_reentrant=False, **kwargs)
    return chunk_fn(*args, **kwargs)


def kernel_unsupported(query: torch.Tensor, tensors: tuple, query_terms: torch.Tensor | None, rank: int) -> str | None:
    """Why the "kernel" implementation (`cpu_kernel`) cannot compute an attention call, or None when it can.
    `tensors`: every input of the call (query, key, value, the factors): none may need a gradient."""
    if query_terms is None:
        return "no composition (use_dcmha=False)"
    if query.device.type != "cpu":
        return f"it runs on CPU, not on {query.device.type}"
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return "it computes no gradients (training, or inputs that require grad)"
    if rank > KERNEL_MAX_RANK:
        return f"it supports dynamic_rank <= {KERNEL_MAX_RANK}"
    return None


_kernel_failed = False


def kernel_buildable() -> bool:
    """Whether the CPU kernel is built or can be (the first call builds it); a failure is warned about once."""
    global _kernel_failed
    if _kernel_failed:
        return False
    try:
        load_cpu_kernel()
        return True
    except RuntimeError as err:
        _kernel_failed = True
        logger.warning(f'the DCMHA CPU kernel cannot be built ({str(err)[:300]}); "auto" does without it')
        return False


def triton_problem(query: torch.Tensor, query_terms: torch.Tensor | None, rank: int, output_attentions: bool):
    """Why the "triton" implementation (`triton_kernel`) cannot compute an attention call, or None when it can.
    Without composition (use_dcmha=False) there is nothing for it to do: plain attention runs as with "eager"."""
    if query_terms is None:
        return None
    if output_attentions:
        return "it does not return the attention probabilities (output_attentions=True)"
    return triton_unsupported(query.device, rank)


def resolve_dcmha_implementation(
    implementation: str,
    device: torch.device,
    num_scores: int,
    kernel_problem: str | None = "not asked",
    triton_problem: str | None = "not asked",
) -> str:
    """The implementation an attention call computing `num_scores` scores (heads x queries x keys) runs with;
    `kernel_problem`, `triton_problem`: why the call cannot use the CPU kernel (`kernel_unsupported`) or the
    Triton kernels (`triton_problem`), None if it can."""
    if torch.compiler.is_compiling():
        return "pointwise"  # already inside torch.compile: the enclosing graph fuses the pointwise form
    for name, problem in (("kernel", kernel_problem), ("triton", triton_problem)):
        if implementation == name and problem is not None:
            raise ValueError(
                f'dcmha_implementation="{name}" cannot compute this attention: {problem}. '
                'Use "auto" (the CPU kernel where it applies, "compiled" or "eager" elsewhere).'
            )
    if implementation == "auto":
        if kernel_problem is None and device.type == "cpu" and kernel_buildable():
            return "kernel"
        big = num_scores >= AUTO_COMPILE_MIN_SCORES
        implementation = "compiled" if big and not _compile_failed and compile_supported(device) else "eager"
    return implementation


def chunk_spans(
    T: int, S: int, chunk_size: int, query_start: int, key_start: int, window_size: int | None
) -> list[tuple[int, int, int, int]]:
    """(t0, t1, s0, s1) for each chunk of `chunk_size` queries: queries [t0, t1) and the keys [s0, s1) they can
    see (indices into the call's queries and keys; the first query is the token at absolute index query_start,
    the first key at key_start)."""
    spans = []
    for t0 in range(0, T, chunk_size):
        t1 = min(T, t0 + chunk_size)
        first, last = query_start + t0, query_start + t1 - 1  # absolute indices of the chunk's queries
        s1 = min(S, last - key_start + 1)
        s0 = max(0, first - window_size + 1 - key_start) if window_size is not None else 0
        spans.append((t0, t1, s0, s1))
    return spans


def time_last(terms: torch.Tensor | None) -> torch.Tensor | None:
    """Composition factors [B, T, G, C, 2I+1, M] laid out time-last, [B, G, C, 2I+1, M, T] (contiguous)."""
    return None if terms is None else terms.permute(0, 2, 3, 4, 5, 1).contiguous()


def kernel_inputs(
    query_terms: torch.Tensor, key_terms: torch.Tensor | None, key_padding_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The factors and the padding as the CPU and Triton kernels take them: fp32 time-last factors
    [B, G, 2, 2I+1, M, T or S] and a uint8 [B, S] padding mask (or None)."""
    qt = time_last(query_terms.float())
    kt = None if key_terms is None else time_last(key_terms.float())
    pad = None if key_padding_mask is None else key_padding_mask.to(torch.uint8).contiguous()
    return qt, kt, pad


def join_chunks(outputs: list[torch.Tensor]) -> torch.Tensor:
    """The chunks' outputs [B, c, N, Dh] along the queries; a single chunk (a decode step) is returned as it is."""
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)


def dcmha_attention_kernel(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_terms: torch.Tensor,
    key_terms: torch.Tensor | None,
    query_start: int,
    key_start: int,
    key_padding_mask: torch.Tensor | None,
    window_size: int | None,
    rank: int,
    num_groups: int,
    chunk_size: int,
    probs_all: torch.Tensor | None = None,
) -> torch.Tensor:
    """`dcmha_attention` with the CPU kernel (forward only): per chunk, q.k into one buffer reused by every chunk,
    `cpu_kernel.compose_softmax_compose` in place on it, then the product with v. Same arguments; `probs_all`
    ([B, N, T, S] or None) receives the composed probabilities. Returns the output [B, T, N, Dh]."""
    B, N, T, Dh = query.shape
    S = key.shape[2]
    q = query.reshape(B * N, T, Dh)  # views where they can be (batch 1): the matrix products take strides
    k = key.reshape(B * N, S, Dh)
    v = value.reshape(B * N, S, Dh)
    qt, kt, pad = kernel_inputs(query_terms, key_terms, key_padding_mask)
    spans = chunk_spans(T, S, chunk_size, query_start, key_start, window_size)
    if not spans:
        return query.new_zeros(B, 0, N, Dh)
    buffer = torch.empty(max(B * N * (t1 - t0) * (s1 - s0) for t0, t1, s0, s1 in spans), dtype=torch.float32)
    outputs = []
    for t0, t1, s0, s1 in spans:
        c, s = t1 - t0, s1 - s0
        scores = buffer[: B * N * c * s].view(B * N, c, s)
        if q.dtype == torch.float32:
            torch.bmm(q[:, t0:t1], k[:, s0:s1].transpose(1, 2), out=scores)
        else:  # products in the model's dtype, then fp32, as in `attend_chunk`
            scores.copy_(torch.bmm(q[:, t0:t1], k[:, s0:s1].transpose(1, 2)))
        compose_softmax_compose(
            scores.view(B, N, c, s), qt, t0, kt, s0, pad, query_start + t0, key_start + s0, window_size,
            Dh**-0.5, rank, num_groups,
        )  # fmt: skip
        outputs.append(torch.bmm(scores.to(v.dtype), v[:, s0:s1]).view(B, N, c, Dh).transpose(1, 2))
        if probs_all is not None:
            probs_all[:, :, t0:t1, s0:s1] = scores.view(B, N, c, s)
    return join_chunks(outputs)


def dcmha_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_terms: torch.Tensor | None,
    key_terms: torch.Tensor | None,
    query_start: int,
    key_start: int,
    key_padding_mask: torch.Tensor | None,
    window_size: int | None,
    rank: int,
    num_groups: int,
    chunk_size: int,
    output_attentions: bool = False,
    recompute: bool = False,
    implementation: str = "eager",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal (optionally windowed) DCMHA over query chunks.

    query: [B, N, T, Dh]; key/value: [B, N, S, Dh].
    query_terms: [B, T, G, Cq, 2I+1, M] (slots pre-query, post-query) or None (plain MHA);
    key_terms: [B, S, G, Ck, 2I+1, M] (slots pre-key, post-key) or None (query-wise / plain).
    query_start, key_start: absolute token index (past tokens included) of the first query and the first key;
    the queries and the keys are consecutive tokens.
    key_padding_mask: [B, S] bool, True where the key is a real token, or None.
    A query at index i sees a key at index j when j <= i (and j > i - window_size on a local layer) and the
    key is not padding. Each chunk of queries only touches the keys it can see, so a
    chunk's largest tensors are [B, N, chunk, visible keys]: O(T * window) on a local layer. With
    `recompute`, a chunk's intermediates are not kept for the backward pass but recomputed there, so
    training memory holds one chunk's [B, N, chunk, keys] tensors at a time.
    `implementation`: "eager", "compiled" or "auto" (see `DCFormerConfig.dcmha_implementation`), chosen per
    chunk by `resolve_dcmha_implementation`.
    Returns the attention output [B, T, N, Dh] and, if asked, the composed probabilities [B, N, T, S].
    """
    B, N, T, Dh = query.shape
    S = key.shape[2]
    if query_terms is None and not output_attentions and window_size is None and key_padding_mask is None:
        # plain causal attention (use_dcmha=False): one SDPA call, causal by its own flag, no mask built
        if T == 1 or (T == S and query_start == key_start):
            out = F.scaled_dot_product_attention(query, key, value, is_causal=T > 1)
            return out.transpose(1, 2), None
    if window_size is not None:
        chunk_size = min(chunk_size, max(LOCAL_CHUNK_MIN, window_size // 2))
    # the scores of the whole call (heads x queries x keys each chunk sees) decide "auto", not one chunk's
    keys_seen = S if window_size is None else min(S, chunk_size + window_size - 1)
    kernel_problem = kernel_unsupported(query, (query, key, value, query_terms, key_terms), query_terms, rank)
    triton_why = triton_problem(query, query_terms, rank, output_attentions) if implementation == "triton" else None
    impl = resolve_dcmha_implementation(implementation, query.device, N * T * keys_seen, kernel_problem, triton_why)
    if impl == "triton" and query_terms is not None:  # the whole call at once: no chunks, no [N, T, S] tensor
        qt, kt, pad = kernel_inputs(query_terms, key_terms, key_padding_mask)
        return dcmha_triton(query, key, value, qt, kt, pad, query_start, key_start, window_size, rank, num_groups), None
    outputs = []
    probs_all = query.new_zeros(B, N, T, S, dtype=torch.float32) if output_attentions else None
    if impl == "kernel":
        args = (query, key, value, query_terms, key_terms, query_start, key_start, key_padding_mask, window_size)
        return dcmha_attention_kernel(*args, rank, num_groups, chunk_size, probs_all), probs_all
    kwargs = dict(need_probs=output_attentions)
    recompute = recompute and not output_attentions
    compiled = impl == "compiled" and query_terms is not None
    if compiled:  # once per call: the layouts of `attend_chunk_staged`, which the chunks slice
        staged = (
            query.contiguous(),
            key.contiguous(),
            value.contiguous(),
            time_last(query_terms),  # [B, G, Cq, 2I+1, M, T]
            time_last(key_terms),
            torch.arange(query_start, query_start + T, device=query.device),
            torch.arange(key_start, key_start + S, device=query.device),
        )
    elif impl == "pointwise":
        kwargs["pointwise"] = True
    for t0, t1, s0, s1 in chunk_spans(T, S, chunk_size, query_start, key_start, window_size):
        first, last = query_start + t0, query_start + t1 - 1  # absolute indices of the chunk's queries
        out = None
        if compiled:
            q, k, v, qt, kt, q_pos, k_pos = staged
            args = (
                q[:, :, t0:t1],
                k[:, :, s0:s1],
                v[:, :, s0:s1],
                qt[..., t0:t1],
                None if kt is None else kt[..., s0:s1],
                q_pos[t0:t1],
                k_pos[s0:s1],
                None if key_padding_mask is None else packed(key_padding_mask[:, s0:s1]),  # no strides to guard
                window_size,
                rank,
                num_groups,
            )
            try:
                out, probs = run_chunk(compiled_attend_chunk, args, kwargs, recompute)
            except Exception as err:  # "auto" only: a machine where torch.compile cannot build its kernels
                if implementation != "auto":
                    raise
                disable_auto_compile(err)
                compiled = False
        if out is None:
            # every query of the chunk sees every key of [s0, s1) (a decode step, for one): no mask to apply
            sees_all = key_start + s1 - 1 <= first and (
                window_size is None or key_start + s0 > last - window_size
            )
            if sees_all and key_padding_mask is None:
                allowed = None
            else:
                q_idx = torch.arange(first, last + 1, device=query.device)
                k_idx = torch.arange(key_start + s0, key_start + s1, device=query.device)
                pad = None if key_padding_mask is None else key_padding_mask[:, s0:s1]
                allowed = visible_keys(q_idx, k_idx, window_size, pad)
            args = (
                query[:, :, t0:t1],
                key[:, :, s0:s1],
                value[:, :, s0:s1],
                None if query_terms is None else query_terms[:, t0:t1],
                None if key_terms is None else key_terms[:, s0:s1],
                allowed,
                rank,
                num_groups,
            )
            out, probs = run_chunk(attend_chunk, args, kwargs, recompute)
        if probs_all is not None:
            probs_all[:, :, t0:t1, s0:s1] = probs
        outputs.append(out)
    return join_chunks(outputs), probs_all


class DCFormerAttention(nn.Module):
    """Dynamically Composable Multi-Head Attention (spec, "One DCMHA layer")."""

    def __init__(self, config: DCFormerConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.window_size = config.window_size if config.layer_types[layer_idx] == "sliding_attention" else None
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=config.attention_bias)
        if config.use_qk_norm:
            self.q_norm = DCFormerRMSNorm(self.head_dim, eps=config.qk_norm_eps)
            self.k_norm = DCFormerRMSNorm(self.head_dim, eps=config.qk_norm_eps)
        if config.use_dcmha:
            self.dyn_w_proj = DynamicWeightProjection(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        query_start: int = 0,
        padding_mask: torch.Tensor | None = None,
        past_key_values: "DCFormerCache | None" = None,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T, D = hidden_states.shape
        N, Dh = self.num_heads, self.head_dim
        qkv = self.qkv_proj(hidden_states).view(B, T, 3, N, Dh)
        query, key, value = qkv.unbind(2)
        if self.config.use_qk_norm:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # [B, N, T, Dh]
        cos, sin = position_embeddings
        query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)

        query_terms = key_terms = None
        if self.config.use_dcmha:
            terms = self.dyn_w_proj(hidden_states)  # [B, T, G, C, 2I+1, M]
            if self.config.query_wise:  # slots (pre-query, post-query)
                query_terms, key_terms = terms, None
            else:  # slots (pre-query, pre-key, post-query, post-key)
                query_terms, key_terms = terms[:, :, :, 0::2], terms[:, :, :, 1::2]

        key_start = query_start
        if past_key_values is not None:
            key, value, key_terms, key_start = past_key_values.update_dcmha(
                key, value, key_terms, self.layer_idx, self.window_size
            )
        key_padding_mask = None if padding_mask is None else padding_mask[:, key_start : key_start + key.shape[2]]
        out, probs = dcmha_attention(
            query,
            key,
            value,
            query_terms,
            key_terms,
            query_start,
            key_start,
            key_padding_mask,
            self.window_size,
            rank=self.config.dynamic_rank,
            num_groups=self.config.num_head_groups,
            chunk_size=self.config.attention_chunk_size,
            output_attentions=output_attentions,
            recompute=self.config.attention_recompute and self.training and torch.is_grad_enabled(),
            implementation=self.config.dcmha_implementation,
        )
        return self.o_proj(out.reshape(B, T, D)), probs


class DCFormerDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: DCFormerConfig, layer_idx: int):
        super().__init__()
        self.use_parallel_residual = config.use_parallel_residual
        self.input_layernorm = make_norm(config)
        self.post_attention_layernorm = make_norm(config)
        self.self_attn = DCFormerAttention(config, layer_idx)
        self.mlp = DCFormerMLP(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        query_start: int = 0,
        padding_mask: torch.Tensor | None = None,
        past_key_values: "DCFormerCache | None" = None,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        attn_output, probs = self.self_attn(
            self.input_layernorm(hidden_states),
            position_embeddings=position_embeddings,
            query_start=query_start,
            padding_mask=padding_mask,
            past_key_values=past_key_values,
            output_attentions=output_attentions,
        )
        if self.use_parallel_residual:
            hidden_states = hidden_states + attn_output + self.mlp(self.post_attention_layernorm(hidden_states))
        else:
            hidden_states = hidden_states + attn_output
            hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states, probs


# ----------------------------------------------------------------------------------------------------------------
# Cache
# ----------------------------------------------------------------------------------------------------------------
class DCFormerLayerLength:
    """What both DCFormer cache layers share: they count the tokens seen, and fill through `update_dcmha`."""

    cumulative_length: int

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError("DCFormer layers update their cache through DCFormerCache.update_dcmha")

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0


class DCFormerCacheLayer(DCFormerLayerLength, DynamicLayer):
    """One layer's cache: keys and values [B, N, S, Dh] and each key's composition factors
    [B, S, G, Ck, 2I+1, M] (w1, w2 and the diagonal of the pre- and post-key slots: 10 N numbers a key with
    I = 2, never N x N matrices). A local layer keeps only the last `window_size - 1` keys between steps."""

    def __init__(self, window_size: int | None = None):
        super().__init__()
        self.window_size = window_size
        self.is_sliding = window_size is not None
        self.is_croppable = window_size is None
        self.key_terms: torch.Tensor | None = None
        self.cumulative_length = 0

    def update_dcmha(self, key, value, key_terms):
        if not self.is_initialized:
            self.lazy_initialization(key, value)
            # copies where they are views (the values of the fused q/k/v projection, two of the four factor
            # slots): a view would keep its whole base tensor alive for as long as the cache
            self.keys, self.values = key.contiguous(), value.contiguous()
            self.key_terms = None if key_terms is None else key_terms.contiguous()
        else:
            self.keys = torch.cat([self.keys, key], dim=-2)
            self.values = torch.cat([self.values, value], dim=-2)
            if key_terms is not None:
                self.key_terms = torch.cat([self.key_terms, key_terms], dim=1)
        self.cumulative_length += key.shape[-2]
        full = (self.keys, self.values, self.key_terms)
        if self.window_size is not None and self.keys.shape[-2] > self.window_size - 1:
            keep = self.window_size - 1
            self.keys = self.keys[..., self.keys.shape[-2] - keep :, :]
            self.values = self.values[..., self.values.shape[-2] - keep :, :]
            if self.key_terms is not None:
                self.key_terms = self.key_terms[:, self.key_terms.shape[1] - keep :]
        return full

    def reset(self) -> None:
        super().reset()
        self.key_terms = None
        self.cumulative_length = 0

    def get_max_length(self) -> int:
        return -1 if self.window_size is None else self.window_size - 1

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0:
            return
        if self.window_size is not None:
            raise ValueError("A local (sliding-window) DCFormer cache layer cannot be cropped: dropped keys are gone")
        super().crop(tokens_to_remove)
        if tokens_to_remove < 0 and self.is_initialized:
            if self.key_terms is not None:
                self.key_terms = self.key_terms[:, :tokens_to_remove]
            self.cumulative_length = self.keys.shape[-2]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.key_terms is not None and self.get_seq_length() > 0:
            self.key_terms = self.key_terms.index_select(0, beam_idx.to(self.key_terms.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.key_terms is not None and self.get_seq_length() > 0:
            self.key_terms = self.key_terms.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.key_terms is not None and self.get_seq_length() > 0:
            self.key_terms = self.key_terms[indices, ...]


class DCFormerStaticCacheLayer(DCFormerLayerLength, CacheLayerMixin):
    """One layer's cache in buffers of `max_cache_len` tokens allocated at the first step: each step writes its
    keys, values and key composition factors in place (no copy of what is already cached, unlike the growing
    `DCFormerCacheLayer`) and attends to views of the filled part (on a local layer, its window)."""

    is_compileable = False  # the views grow with the cache: the attention's shapes are not static
    is_sliding = False

    def __init__(self, max_cache_len: int, window_size: int | None = None):
        super().__init__()
        self.max_cache_len = max_cache_len
        self.window_size = window_size
        self.key_terms: torch.Tensor | None = None
        self.cumulative_length = 0

    def lazy_initialization(self, key_states, value_states, key_terms=None) -> None:
        B, N, _, Dh = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_zeros(B, N, self.max_cache_len, Dh)
        self.values = value_states.new_zeros(B, N, self.max_cache_len, Dh)
        if key_terms is not None:
            self.key_terms = key_terms.new_zeros(B, self.max_cache_len, *key_terms.shape[2:])
        self.is_initialized = True

    def update_dcmha(self, key, value, key_terms):
        if not self.is_initialized:
            self.lazy_initialization(key, value, key_terms)
        start, end = self.cumulative_length, self.cumulative_length + key.shape[-2]
        if end > self.max_cache_len:
            raise ValueError(
                f"the static DCFormer cache holds max_cache_len={self.max_cache_len} tokens; this step would need "
                f"{end}: make it longer (generate's max_cache_len, or max_new_tokens)"
            )
        self.keys[:, :, start:end] = key
        self.values[:, :, start:end] = value
        if key_terms is not None:
            self.key_terms[:, start:end] = key_terms
        self.cumulative_length = end
        first = 0 if self.window_size is None else max(0, start - self.window_size + 1)  # what the step can see
        terms = None if self.key_terms is None else self.key_terms[:, first:end]
        return self.keys[:, :, first:end], self.values[:, :, first:end], terms

    def get_max_length(self) -> int:
        return self.max_cache_len

    def get_max_cache_shape(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        self.cumulative_length = 0  # the buffers stay: the next sequence overwrites them

    def crop(self, tokens_to_remove: int) -> None:
        """Keep the first `tokens_to_remove` tokens (or drop the last -`tokens_to_remove` when negative), as
        `DynamicLayer.crop` does."""
        if tokens_to_remove < 0:
            self.cumulative_length = max(0, self.cumulative_length + tokens_to_remove)
        elif tokens_to_remove < self.cumulative_length:
            self.cumulative_length = tokens_to_remove

    def _select(self, fn) -> None:
        if self.is_initialized:
            self.keys, self.values = fn(self.keys), fn(self.values)
            if self.key_terms is not None:
                self.key_terms = fn(self.key_terms)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(lambda t: t[indices, ...])


class DCFormerCache(Cache):
    """Cache of a DCFormer model: one `DCFormerCacheLayer` per layer (growing; local layers keep only their window),
    or with `max_cache_len` one `DCFormerStaticCacheLayer` per layer (buffers of that many tokens, written in place:
    `generate(..., cache_implementation="static")`)."""

    def __init__(self, config: DCFormerConfig, max_cache_len: int | None = None):
        windows = [config.window_size if kind == "sliding_attention" else None for kind in config.layer_types]
        if max_cache_len is None:
            layers = [DCFormerCacheLayer(window) for window in windows]
        else:
            if not isinstance(max_cache_len, int) or max_cache_len < 1:
                raise ValueError(f"max_cache_len must be a positive integer, got {max_cache_len!r}")
            layers = [DCFormerStaticCacheLayer(max_cache_len, window) for window in windows]
        super().__init__(layers=layers)

    def update_dcmha(self, key, value, key_terms, layer_idx: int, window_size: int | None):
        """Append this step's keys, values and key composition terms; returns what the step attends to:
        (keys, values, key_terms, key_start) with key_start the absolute token index of the first key."""
        layer = self.layers[layer_idx]
        keys, values, terms = layer.update_dcmha(key, value, key_terms)
        total = layer.cumulative_length
        return keys, values, terms, total - keys.shape[-2]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_seq_length() if self.layers else 0


# ----------------------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------------------
class DCFormerPreTrainedModel(PreTrainedModel):
    config_class = DCFormerConfig
    config: DCFormerConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DCFormerDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    # DCMHA is computed by this file's own attention; no flash/SDPA/flex kernel can compose heads.
    _supports_flash_attn = False
    _supports_sdpa = False
    _supports_flex_attn = False
    _supports_attention_backend = False
    _can_compile_fullgraph = False
    # Derived tensors of the authors' released checkpoints: never used (see released_format.py).
    _keys_to_ignore_on_load_unexpected = RELEASED_IGNORED_KEYS

    def __init__(self, config: DCFormerConfig, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        register_released_layout(config)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """`PreTrainedModel.from_pretrained`, refusing checkpoints with missing tensors (transformers would
        initialise them randomly and only warn). Loads our layout and the authors' released one alike."""
        want_info = kwargs.get("output_loading_info", False)
        allow_mismatch = kwargs.get("ignore_mismatched_sizes", False)
        kwargs["output_loading_info"] = kwargs["ignore_mismatched_sizes"] = True
        model, info = super().from_pretrained(*args, **kwargs)
        source = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        if info["mismatched_keys"] and not allow_mismatch:
            shapes = "; ".join(
                f"{key}: checkpoint {tuple(ckpt)} vs model {tuple(ours)}" for key, ckpt, ours in info["mismatched_keys"]
            )
            raise ValueError(f"checkpoint {source!r} has tensors of the wrong shape: {shapes}")
        if info["missing_keys"] and not want_info:
            raise ValueError(f"checkpoint {source!r} lacks tensors the model needs: {sorted(info['missing_keys'])}")
        return (model, info) if want_info else model

    def save_pretrained(
        self,
        save_directory,
        *args,
        save_original_format: bool = False,
        remote_code: bool = True,
        model_card: bool | dict = True,
        **kwargs,
    ):
        """Always saves our native layout (transformers would otherwise revert the load-time renaming of the
        released layout). The directory is ready to share (see `hub.py`): it also gets the remote code with an
        `auto_map` in config.json, so it loads with `trust_remote_code=True` where this package is not installed
        (`remote_code=False`: not), and a model card README.md (`model_card`: True, False, or a dict of
        `hub.write_model_card` options such as `license`, `base_model`, `eval_results`; a README.md this package
        did not generate is kept). `push_to_hub=True` (with `repo_id`, `private`, `token`, `commit_message`,
        `create_pr`) uploads the directory afterwards."""
        from .hub import check_save_directory, finish_save, save_model_directory

        hub_keys = ("push_to_hub", "repo_id", "private", "token", "commit_message", "commit_description", "create_pr")
        hub_kwargs = {key: kwargs.pop(key) for key in hub_keys if key in kwargs}
        check_save_directory(save_directory)  # a file: an error (transformers logs it and saves nothing)
        parent_save = super().save_pretrained

        def write(directory):
            parent_save(directory, *args, save_original_format=save_original_format, **kwargs)

        on_this_rank = self.should_save_on_this_rank(args[0] if args else kwargs.get("is_main_process", True))
        if on_this_rank and getattr(self, "_tp_size", None) is None:  # written beside, then swapped in (hub.py)
            options = dict(remote_code=remote_code, model_card=model_card, **hub_kwargs)
            return save_model_directory(self, save_directory, write, **options)
        write(save_directory)
        if on_this_rank:
            finish_save(self, save_directory, remote_code=remote_code, model_card=model_card, **hub_kwargs)

    def push_to_hub(self, repo_id: str, **kwargs):
        """Upload the model to the Hub repository `repo_id` in one commit: weights, config, the remote code and a
        model card. Takes transformers' options (`commit_message`, `commit_description`, `private`, `token`,
        `revision`, `create_pr`, `max_shard_size`, `tags`) and `license` (default "apache-2.0"), `base_model`,
        `eval_results` (lm-eval results: a dict or a results JSON file), `remote_code`, `overwrite_model_card`
        (a README.md on the Hub that this package did not generate is kept unless True). Returns the `CommitInfo`."""
        from .hub import push_model

        return push_model(self, repo_id, **kwargs)

    def _init_weights(self, module):
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, DynamicWeightProjection):
            init.normal_(module.dw1, mean=0.0, std=std)
            init.normal_(module.qkw, mean=0.0, std=std)
            init.normal_(module.dd, mean=0.0, std=std)


def register_released_layout(config: DCFormerConfig) -> None:
    """Teach transformers' load-time weight conversion the authors' released key names for this body
    (their MLP's `w1` is our `gate_proj` in the gated body and `up_proj` otherwise), so that `from_pretrained`
    reads released checkpoints directly. Only released names match these patterns; ours load unchanged."""
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping
    from transformers.core_model_loading import Concatenate, ConversionOps, WeightConverter, WeightRenaming

    class QueryWiseSlots(ConversionOps):
        """Keeps the query slots of a released 4-slot dynamic weight for a query-wise model."""

        def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
            (tensors,) = input_dict.values()
            tensor = tensors[0] if isinstance(tensors, list) else tensors
            return {target_patterns[0]: query_wise_slots(target_patterns[0], tensor, config.heads_per_group)}

    mapping = [WeightRenaming(source, target) for source, target in key_renames(config.use_gated_mlp)]
    mapping.append(
        WeightConverter(
            [r"attention\.wq", r"attention\.wk", r"attention\.wv"], "self_attn.qkv_proj", operations=[Concatenate(dim=0)]
        )
    )
    if config.query_wise:
        for name in ("dw1", "qkw", "dd"):
            mapping.append(WeightConverter(rf"dyn_w_proj\.{name}", f"dyn_w_proj.{name}", operations=[QueryWiseSlots()]))
    register_checkpoint_conversion_mapping(config.model_type, mapping, overwrite=True)


def positions_from_padding(attention_mask: torch.Tensor, past_length: int, length: int) -> torch.Tensor:
    """Position ids of the last `length` tokens from a 2D padding mask covering past and present tokens:
    real tokens are numbered 0, 1, ... in each row whatever the padding before them."""
    positions = attention_mask.long().cumsum(-1) - 1
    positions = positions.clamp(min=0)
    return positions[:, past_length : past_length + length]


class DCFormerModel(DCFormerPreTrainedModel):
    def __init__(self, config: DCFormerConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [DCFormerDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = make_norm(config)
        self.rotary_emb = DCFormerRotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast | tuple:
        output_attentions = output_attentions if output_attentions is not None else self.config.output_attentions
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if self.gradient_checkpointing and self.training and use_cache:
            logger.warning_once("`use_cache=True` is incompatible with gradient checkpointing; using use_cache=False.")
            use_cache = False
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        B, T = inputs_embeds.shape[:2]
        device = inputs_embeds.device

        if past_key_values is not None and not isinstance(past_key_values, DCFormerCache):
            if past_key_values.get_seq_length() > 0:
                raise TypeError(
                    f"DCFormer needs a DCFormerCache (keys' composition terms are cached too), got a filled "
                    f"{type(past_key_values).__name__}"
                )
            past_key_values = None  # an empty generic cache: replace it with ours
        if use_cache and past_key_values is None:
            past_key_values = DCFormerCache(self.config)
        past_length = past_key_values.get_seq_length() if past_key_values is not None else 0

        padding_mask = None
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise ValueError(
                    f"attention_mask must be a 2D [batch, past + new tokens] padding mask, got shape "
                    f"{tuple(attention_mask.shape)}"
                )
            if attention_mask.shape != (B, past_length + T):
                raise ValueError(
                    f"attention_mask has shape {tuple(attention_mask.shape)} but the batch has {B} rows of "
                    f"{past_length} cached + {T} new tokens"
                )
            padding_mask = attention_mask.to(device=device, dtype=torch.bool)
            if bool(padding_mask.all()):
                padding_mask = None
        if position_ids is None:
            if attention_mask is not None:
                position_ids = positions_from_padding(attention_mask.to(device), past_length, T)
            else:
                position_ids = torch.arange(past_length, past_length + T, device=device).unsqueeze(0).expand(B, T)

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        all_hidden_states = () if output_hidden_states else None
        all_attentions = () if output_attentions else None
        for layer in self.layers:
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
            hidden_states, probs = layer(
                hidden_states,
                position_embeddings=position_embeddings,
                query_start=past_length,
                padding_mask=padding_mask,
                past_key_values=past_key_values,
                output_attentions=output_attentions,
            )
            if output_attentions:
                all_attentions += (probs,)
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden_states += (hidden_states,)

        output = BaseModelOutputWithPast(
            last_hidden_state=hidden_states,
            past_key_values=past_key_values if use_cache else None,
            hidden_states=all_hidden_states,
            attentions=all_attentions,
        )
        return output if return_dict else output.to_tuple()


class DCFormerForCausalLM(DCFormerPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: DCFormerConfig):
        super().__init__(config)
        self.model = DCFormerModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # a DynamicCache cannot hold the keys' composition terms

    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs, generation_mode, batch_size: int, max_cache_length: int, *args, **kwargs
    ):
        """`generate()` starts from a `DCFormerCache` (keys, values and the keys' composition factors): growing, or
        with `cache_implementation="static"` in buffers of `max_cache_len` (else the generation's max length)
        tokens."""
        implementation = generation_config.cache_implementation
        if implementation is not None and implementation not in ("dynamic", "static"):
            raise ValueError(
                f"cache_implementation={implementation!r} is not supported by DCFormer (its cache also holds the "
                'keys\' composition factors): use "dynamic" (the default) or "static"'
            )
        if model_kwargs.get("past_key_values") is not None:
            if implementation is not None:
                raise ValueError("pass either cache_implementation or past_key_values to generate(), not both")
            model_kwargs["past_key_values"]._is_user_defined = True  # as transformers marks a cache it was given
            return
        if generation_config.use_cache is False:
            return
        if implementation == "static":
            length = max(max_cache_length, generation_config.max_cache_len or 0)
            model_kwargs["past_key_values"] = DCFormerCache(self.config, max_cache_len=length)
        else:
            model_kwargs["past_key_values"] = DCFormerCache(self.config)

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast | tuple:
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
        )
        hidden_states = outputs.last_hidden_state
        slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, slice_indices, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        output = CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
        return output if return_dict else output.to_tuple()


__all__ = [
    "DCFormerCache",
    "DCFormerForCausalLM",
    "DCFormerModel",
    "DCFormerPreTrainedModel",
    "compose",
    "dcmha_attention",
]
