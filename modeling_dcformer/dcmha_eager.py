"""The reference DCMHA: `compose`, the one Python definition of the Compose maths (docs/spec.md), and the "eager"
backend running it chunk by chunk; "compiled" compiles the same stages, the C and Triton kernels are tested against
this file and the tests' float64 oracle.

Layouts (time last, so that the generated loops of the compiled stages vectorise along the keys):
    scores         [B, G, M, T, S]   heads split into G groups of M
    query_terms    [B, G, 2I+1, M, T] one slot's factors of the queries: rows w1 (0..I-1), w2 (I..2I-1), dd (2I)
    key_terms      [B, G, 2I+1, M, S] the same for the keys, or None (query-wise composition)
"""

from functools import partial

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from .dcmha_base import DCMHABackend, DCMHAChunk, DCMHAInputs, join_chunks, packed, visible_keys


def compose_hidden(scores: torch.Tensor, query_terms: torch.Tensor, key_terms: torch.Tensor | None,
                   rank: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The low-rank hidden values of `compose`: hq[i,t,s] = sum_n A[n,t,s] qw1[t,i,n] and
    hk[i,t,s] = sum_n A[n,t,s] kw1[s,i,n], each [B, G, I, T, S] (hk None without key terms).
    A sum of M products (M is static): elementwise work that Inductor vectorises along the keys."""
    hidden_q = hidden_k = None
    for n in range(scores.shape[2]):
        a = scores[:, :, n].unsqueeze(2)  # [B, G, 1, T, S]
        term = a * query_terms[:, :, :rank, n].unsqueeze(-1)
        hidden_q = term if hidden_q is None else hidden_q + term
        if key_terms is not None:
            term = a * key_terms[:, :, :rank, n].unsqueeze(-2)
            hidden_k = term if hidden_k is None else hidden_k + term
    return hidden_q, hidden_k


def compose(scores: torch.Tensor, query_terms: torch.Tensor, key_terms: torch.Tensor | None, rank: int,
            hidden: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
    """Compose the heads of `scores` (A, [B, G, M, T, S]) with one slot's factors (layouts: module docstring):

        out[m,t,s] = A[m,t,s] (1 + qdd[t,m] + kdd[s,m])
                   + sum_i hq[i,t,s] qw2[t,i,m] + sum_i hk[i,t,s] kw2[s,i,m]

    with the hidden values hq, hk of `compose_hidden` (computed here unless given as `hidden`). Without key terms
    (query-wise) the key-wise terms are absent. Heads mix within a group; positions never mix."""
    I = rank
    hidden_q, hidden_k = compose_hidden(scores, query_terms, key_terms, rank) if hidden is None else hidden
    out = scores * (1 + query_terms[:, :, 2 * I].unsqueeze(-1))
    for i in range(I):
        out = out + query_terms[:, :, I + i].unsqueeze(-1) * hidden_q[:, :, i].unsqueeze(2)
    if key_terms is not None:
        out = out + scores * key_terms[:, :, 2 * I].unsqueeze(-2)
        for i in range(I):
            out = out + key_terms[:, :, I + i].unsqueeze(-2) * hidden_k[:, :, i].unsqueeze(2)
    return out


def stage_hidden(raw: torch.Tensor, query_terms: torch.Tensor, key_terms: torch.Tensor | None, scale: float,
                 rank: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """First stage of a Compose: the hidden values of `raw * scale` ([B, G, M, c, s])."""
    return compose_hidden(raw * scale, query_terms, key_terms, rank)


def stage_apply(raw: torch.Tensor, query_terms: torch.Tensor, key_terms: torch.Tensor | None, hidden_q: torch.Tensor,
                hidden_k: torch.Tensor | None, q_pos: torch.Tensor, k_pos: torch.Tensor,
                key_padding_mask: torch.Tensor | None, window_size: int | None, scale: float, fill: float | None,
                rank: int) -> torch.Tensor:
    """Second stage: the Compose of `raw * scale` finished, the keys a query cannot see set to `fill` (None: left as
    they are; the mask is computed from the positions, never read from memory). Returns [B, N, c, s]."""
    B, G, M, c, s = raw.shape
    out = compose(raw * scale, query_terms, key_terms, rank, hidden=(hidden_q, hidden_k)).view(B, G * M, c, s)
    if fill is not None:
        out = out.masked_fill(~visible_keys(q_pos, k_pos, window_size, key_padding_mask), fill)
    return out


def compose_step(raw, query_terms, key_terms, mask: tuple, scale: float, fill: float | None, rank: int):
    """One Compose step of a chunk, before or after the softmax: `stage_hidden`, then `stage_apply` (`mask`: their
    q_pos, k_pos, key_padding_mask, window_size). "compiled" runs these stages compiled, with written-out gradients."""
    hidden = stage_hidden(raw, query_terms, key_terms, scale, rank)
    return stage_apply(raw, query_terms, key_terms, *hidden, *mask, scale, fill, rank)


def chunk_visible_keys(chunk: DCMHAChunk) -> torch.Tensor:
    return visible_keys(chunk.query_pos, chunk.key_pos, chunk.window_size, chunk.key_padding_mask)


def chunk_probabilities(chunk: DCMHAChunk, compose_fn=compose_step) -> torch.Tensor:
    """The attention probabilities [B, N, c, s] (fp32) of one chunk of queries against the keys it may see: q.k,
    Compose (pre slot), mask, softmax, Compose (post slot); keys a query cannot see get 0 (`chunk.value` unused).
    `compose_fn`: `compose_step` or the compiled backend's version of it."""
    q, k = chunk.query, chunk.key
    B, N, c, Dh = q.shape
    s = k.shape[2]
    scale = Dh**-0.5
    pre_fill = torch.finfo(torch.float32).min if chunk.masked else None
    # without padding, masked keys come out of the softmax as exact zeros and Compose keeps them zero
    post_fill = 0.0 if chunk.key_padding_mask is not None else None
    mask = (chunk.query_pos, chunk.key_pos, chunk.key_padding_mask, chunk.window_size)
    if chunk.query_terms is None:  # plain multi-head attention (use_dcmha=False)
        allowed = chunk_visible_keys(chunk) if chunk.masked else None
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
        if allowed is not None:
            scores = scores.masked_fill(~allowed, torch.finfo(torch.float32).min)
        probs = torch.softmax(scores, dim=-1)
        if allowed is not None and post_fill is not None:
            probs = probs.masked_fill(~allowed, post_fill)
        return probs
    G, rank = chunk.num_groups, chunk.rank
    M = N // G
    query_terms, key_terms = chunk.query_terms, chunk.key_terms
    # each slot copied to standard strides: the compiled stages see no strides to specialise on
    pre_q, post_q = packed(query_terms[:, :, 0]), packed(query_terms[:, :, 1])
    pre_k = None if key_terms is None else packed(key_terms[:, :, 0])
    post_k = None if key_terms is None else packed(key_terms[:, :, 1])
    raw = torch.matmul(q, k.transpose(-1, -2)).float().view(B, G, M, c, s)
    scores = compose_fn(raw, pre_q, pre_k, mask, scale, pre_fill, rank)
    probs = torch.softmax(scores, dim=-1).view(B, G, M, c, s)
    return compose_fn(probs, post_q, post_k, mask, 1.0, post_fill, rank)


def attend_chunk(chunk: DCMHAChunk, compose_fn=compose_step) -> torch.Tensor:
    """DCMHA of one chunk of queries against the keys it may see: `chunk_probabilities`, then @ v. Returns the
    output [B, c, N, Dh] (output_attentions calls use `chunk_probabilities` directly:
    `EagerBackend.attend_with_probabilities`)."""
    if chunk.query_terms is None:  # plain attention: SDPA's fused kernel (rows with no visible key: 0)
        allowed = chunk_visible_keys(chunk) if chunk.masked else None
        return F.scaled_dot_product_attention(chunk.query, chunk.key, chunk.value, attn_mask=allowed).transpose(1, 2)
    probs = chunk_probabilities(chunk, compose_fn)
    return torch.matmul(probs.to(chunk.value.dtype), chunk.value).transpose(1, 2)


class EagerBackend(DCMHABackend):
    """"eager": `attend_chunk` with PyTorch ops, one chunk of queries at a time (each chunk only touches the keys it
    can see: O(T x window) on a local layer); with `recompute`, a chunk's intermediates are recomputed in the
    backward pass instead of kept. Runs anywhere, returns the probabilities, and is the reference."""

    name = "eager"
    auto_rank = 0  # "auto"'s last resort: it computes every call
    compose_step = staticmethod(compose_step)

    def __call__(self, inputs: DCMHAInputs, *, output_attentions: bool = False, recompute: bool = False):
        B, N, T, S, Dh = inputs.shapes
        if not inputs.composed and not output_attentions and inputs.plain_causal:
            # plain causal attention over the whole call: one SDPA call, causal by its own flag
            out = F.scaled_dot_product_attention(inputs.query, inputs.key, inputs.value, is_causal=T > 1)
            return out.transpose(1, 2), None
        spans = inputs.chunk_spans()
        if not spans:
            probs = inputs.query.new_zeros(B, N, 0, S, dtype=torch.float32) if output_attentions else None
            return inputs.query.new_zeros(B, 0, N, inputs.value.shape[-1]), probs
        if output_attentions:
            return self.attend_with_probabilities(inputs, spans)
        step, attend = self.compose_step, attend_chunk
        if recompute:  # each chunk's intermediates are recomputed in the backward pass instead of kept
            attend = partial(torch.utils.checkpoint.checkpoint, attend_chunk, use_reentrant=False)
        return join_chunks([attend(inputs.chunk(span), step) for span in spans]), None

    def attend_with_probabilities(self, inputs: DCMHAInputs, spans: list) -> tuple[torch.Tensor, torch.Tensor]:
        """output_attentions: the probabilities of every chunk in one [B, N, T, S] tensor (0 for the keys a chunk does
        not see), and the output computed from that tensor, so that the attentions returned are the ones used (they
        carry the output's gradient, as transformers' eager attention does)."""
        _, _, _, S, _ = inputs.shapes
        rows = []
        for span in spans:
            probs = chunk_probabilities(inputs.chunk(span, with_values=False), self.compose_step)
            _, _, s0, s1 = span
            rows.append(F.pad(probs, (s0, S - s1)))
        probs = rows[0] if len(rows) == 1 else torch.cat(rows, dim=2)
        v = inputs.value
        outputs = [torch.matmul(probs[:, :, t0:t1, s0:s1].to(v.dtype), v[:, :, s0:s1]).transpose(1, 2)
                   for t0, t1, s0, s1 in spans]
        return join_chunks(outputs), probs


EAGER = EagerBackend()
