"""The reference DCMHA: `compose`, the one Python definition of the Compose maths (docs/spec.md), and the "eager"
backend running it chunk by chunk; "compiled" compiles the same stages, the C and Triton kernels are tested against
this file and the tests' float64 oracle.

Layouts (time last, so that the generated loops of the compiled stages vectorise along the keys):
    scores         [B, G, M, T, S]   heads split into G groups of M
    query_terms    [B, G, 2I+1, M, T] one slot's factors of the queries: rows w1 (0..I-1), w2 (I..2I-1), dd (2I)
    key_terms      [B, G, 2I+1, M, S] the same for the keys, or None (query-wise composition)
    pairs          (`pair_terms`) both sides' factors at every (t, s), [B, G, K, 2I+1, M, T, S] with the sides
                   (query, key) on K (K = 1 and S broadcast without key terms), and 1 + qdd + kdd [B, G, M, T, S]
"""

from functools import partial

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from .dcmha_base import DCMHABackend, DCMHAChunk, DCMHAInputs, join_chunks, visible_keys

# "eager" composes the chunks of at most this many queries batched over the heads (`compose`'s `pairs`): a decode
# step, assisted decoding's drafts. Its temporaries are [B, G, K, I, M, c, s]; longer chunks keep the loops.
BATCHED_MAX_QUERIES = 16


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


def compose(scores: torch.Tensor, query_terms: torch.Tensor | None, key_terms: torch.Tensor | None, rank: int,
            hidden: tuple[torch.Tensor, torch.Tensor | None] | None = None,
            pairs: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Compose the heads of `scores` (A, [B, G, M, T, S]) with one slot's factors (layouts: module docstring):

        out[m,t,s] = A[m,t,s] (1 + qdd[t,m] + kdd[s,m])
                   + sum_i hq[i,t,s] qw2[t,i,m] + sum_i hk[i,t,s] kw2[s,i,m]

    Without key terms (query-wise) the key-wise terms are absent. Heads mix within a group; positions never mix.
    Two formulations of these sums, the same numbers to float rounding:
    - per head and rank (default): the hidden values hq, hk of `compose_hidden` (computed here unless given as
      `hidden`), then the loop below; products of [B, G, T, S] slices, which Inductor fuses into one loop over the
      scores (the compiled stages), with no [..., M, T, S] temporary: chunks of many queries;
    - batched (`pairs` = `pair_terms(query_terms, key_terms, S)` given; the factors are then read from it): each
      side's hidden values, then the low-rank terms of both sides, each one product and one sum over the heads, and
      the diagonal: five ops whatever M and I, for eager chunks of few queries (a decode step), where every op is a
      kernel launch."""
    if pairs is not None:
        sides, diagonal = pairs
        hidden_all = (scores[:, :, None, None] * sides[:, :, :, :rank]).sum(4)  # [B, G, K, I, T, S]
        low_rank = (sides[:, :, :, rank : 2 * rank] * hidden_all.unsqueeze(4)).sum((2, 3))  # [B, G, M, T, S]
        return torch.addcmul(low_rank, scores, diagonal)
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


def pair_terms(query_terms: torch.Tensor, key_terms: torch.Tensor | None,
               keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The factors of `compose`'s batched formulation, for one slot or for several at once (any leading dims):
    query_terms [..., 2I+1, M, T] and key_terms [..., 2I+1, M, S] (or None) give both sides at every (t, s),
    [..., K, 2I+1, M, T, S] (K = 2: query, key; K = 1 and S broadcast without key terms), and the diagonal
    1 + qdd + kdd [..., M, T, S]."""
    q = query_terms.unsqueeze(-1)  # [..., 2I+1, M, T, 1]
    diagonal = 1 + q[..., -1, :, :, :]
    if key_terms is None:
        return q.unsqueeze(-5), diagonal
    k = key_terms.unsqueeze(-2)  # [..., 2I+1, M, 1, S]
    shape = (*q.shape[:-1], keys)
    return torch.stack((q.expand(shape), k.expand(shape)), dim=-5), diagonal + k[..., -1, :, :, :]


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
    """One Compose step of a chunk, before or after the softmax: the Compose of `raw * scale`, the keys a query
    cannot see set to `fill` (`mask`: q_pos, k_pos, key_padding_mask, window_size); what `stage_hidden` then
    `stage_apply` compute, each scaling `raw` itself. "compiled" runs those stages compiled, with written-out
    gradients."""
    B, G, M, c, s = raw.shape
    out = compose(raw if scale == 1.0 else raw * scale, query_terms, key_terms, rank).view(B, G * M, c, s)
    if fill is not None:
        q_pos, k_pos, key_padding_mask, window_size = mask
        out = out.masked_fill(~visible_keys(q_pos, k_pos, window_size, key_padding_mask), fill)
    return out


def chunk_visible_keys(chunk: DCMHAChunk) -> torch.Tensor:
    return visible_keys(chunk.query_pos, chunk.key_pos, chunk.window_size, chunk.key_padding_mask)


def grouped_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, N, c, x] @ b [B, Nkv, x, y] -> [B, N, c, y], query head n against key/value head n // (N / Nkv): one
    product per key/value head over its N / Nkv query heads' rows (a's heads viewed as [B, Nkv, N/Nkv * c, x]; a
    copy of a only where its strides do not allow that view), never b copied per query head; b's gradient is then
    the sum over those heads, by the same product. Nkv == N: plain `matmul`."""
    B, N, c, x = a.shape
    groups = b.shape[1]
    if groups == N:
        return torch.matmul(a, b)
    out = torch.matmul(a.reshape(B, groups, (N // groups) * c, x), b)
    return out.view(B, N, c, out.shape[-1])


def raw_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q kᵀ [B, N, c, s] in q's dtype (k [B, Nkv, s, Dh]: `grouped_matmul`)."""
    return grouped_matmul(q, k.transpose(-1, -2))


def scaled_scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """q kᵀ * scale [B, N, c, s] in fp32 (k [B, Nkv, s, Dh]: `grouped_matmul`): in fp32 one product with the scale
    as its alpha; in half precision the product in that dtype, then scaled in fp32 (as the kernels do)."""
    if q.dtype != torch.float32:
        return raw_scores(q, k).float() * scale
    B, N, c, Dh = q.shape
    Nkv, s = k.shape[1], k.shape[2]
    q3, k3 = q.reshape(B * Nkv, (N // Nkv) * c, Dh), k.reshape(B * Nkv, s, Dh)
    return torch.baddbmm(q.new_empty(()), q3, k3.transpose(1, 2), beta=0, alpha=scale).view(B, N, c, s)


def attend_values(probs: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """probs [B, N, c, s] @ value [B, Nkv, s, Dh] (`grouped_matmul`), probs cast to value's dtype: the output
    [B, c, N, Dh] (a view)."""
    return grouped_matmul(probs if value.dtype == probs.dtype else probs.to(value.dtype), value).transpose(1, 2)


def plain_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask=None,
                    is_causal: bool = False) -> torch.Tensor:
    """SDPA's fused kernel, key/value heads shared by groups of query heads where Nkv < N (`enable_gqa`): the
    output [B, T, N, Dh] (a view)."""
    gqa = {"enable_gqa": True} if key.shape[1] != query.shape[1] else {}
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, is_causal=is_causal,
                                          **gqa).transpose(1, 2)


def chunk_probabilities(chunk: DCMHAChunk, compose_fn=compose_step) -> torch.Tensor:
    """The attention probabilities [B, N, c, s] (fp32) of one chunk of queries against the keys it may see: q.k,
    Compose (pre slot), mask, softmax, Compose (post slot); keys a query cannot see get 0 (`chunk.value` unused).
    `compose_fn`: `compose_step` or the compiled backend's version of it; "eager" composes a chunk of at most
    BATCHED_MAX_QUERIES queries batched (`few_query_probabilities`)."""
    q, k = chunk.query, chunk.key
    B, N, c, Dh = q.shape
    s = k.shape[2]
    scale = Dh**-0.5
    if chunk.query_terms is None:  # plain multi-head attention (use_dcmha=False)
        return plain_probabilities(chunk, scale)
    if compose_fn is compose_step and isinstance(c, int) and c <= BATCHED_MAX_QUERIES:  # (a symbolic c: no guard)
        return few_query_probabilities(chunk, scale)
    pre_fill = torch.finfo(torch.float32).min if chunk.masked else None
    # without padding, masked keys come out of the softmax as exact zeros and Compose keeps them zero
    post_fill = 0.0 if chunk.key_padding_mask is not None else None
    mask = (chunk.query_pos, chunk.key_pos, chunk.key_padding_mask, chunk.window_size)
    G, rank = chunk.num_groups, chunk.rank
    M = N // G
    query_terms, key_terms = chunk.query_terms, chunk.key_terms
    pre_k, post_k = (None, None) if key_terms is None else (key_terms[:, :, 0], key_terms[:, :, 1])
    raw = raw_scores(q, k).float().view(B, G, M, c, s)
    scores = compose_fn(raw, query_terms[:, :, 0], pre_k, mask, scale, pre_fill, rank)
    probs = torch.softmax(scores, dim=-1).view(B, G, M, c, s)
    return compose_fn(probs, query_terms[:, :, 1], post_k, mask, 1.0, post_fill, rank)


def plain_probabilities(chunk: DCMHAChunk, scale: float) -> torch.Tensor:
    allowed = chunk_visible_keys(chunk) if chunk.masked else None
    scores = scaled_scores(chunk.query, chunk.key, scale)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, torch.finfo(torch.float32).min)
    probs = torch.softmax(scores, dim=-1)
    if allowed is not None and chunk.key_padding_mask is not None:
        probs = probs.masked_fill(~allowed, 0.0)
    return probs


def few_query_probabilities(chunk: DCMHAChunk, scale: float) -> torch.Tensor:
    """`chunk_probabilities` of a chunk of few queries, composed batched over the heads (`compose`'s `pairs`): the
    factors of both slots paired once, the mask only where the chunk has one."""
    q, k, rank = chunk.query, chunk.key, chunk.rank
    B, N, c, _ = q.shape
    s = k.shape[2]
    shape = (B, chunk.num_groups, N // chunk.num_groups, c, s)
    sides, diagonal = pair_terms(chunk.query_terms, chunk.key_terms, s)  # both slots, on dim 2
    pre, post = ((sides[:, :, slot], diagonal[:, :, slot]) for slot in (0, 1))
    if q.dtype == torch.float32:
        scores = compose(scaled_scores(q, k, scale).view(shape), None, None, rank, pairs=pre).view(B, N, c, s)
    else:  # the product in half precision, composed in fp32 (fp32 factors promote it), then scaled
        raw = raw_scores(q, k).view(shape)
        raw = raw if sides.dtype == torch.float32 else raw.float()
        scores = compose(raw, None, None, rank, pairs=pre).view(B, N, c, s) * scale
    allowed = chunk_visible_keys(chunk) if chunk.masked else None
    if allowed is not None:
        scores = scores.masked_fill(~allowed, torch.finfo(torch.float32).min)
    probs = compose(torch.softmax(scores, dim=-1).view(shape), None, None, rank, pairs=post).view(B, N, c, s)
    if allowed is not None and chunk.key_padding_mask is not None:  # a query that sees no key: a uniform softmax
        probs = probs.masked_fill(~allowed, 0.0)
    return probs


def attend_chunk(chunk: DCMHAChunk, compose_fn=compose_step) -> torch.Tensor:
    """DCMHA of one chunk of queries against the keys it may see: `chunk_probabilities`, then @ v. Returns the
    output [B, c, N, Dh] (output_attentions calls use `chunk_probabilities` directly:
    `EagerBackend.attend_with_probabilities`)."""
    if chunk.query_terms is None:  # plain attention: SDPA's fused kernel (rows with no visible key: 0)
        allowed = chunk_visible_keys(chunk) if chunk.masked else None
        return plain_attention(chunk.query, chunk.key, chunk.value, attn_mask=allowed)
    return attend_values(chunk_probabilities(chunk, compose_fn), chunk.value)


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
            return plain_attention(inputs.query, inputs.key, inputs.value, is_causal=T > 1), None
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
        outputs = [attend_values(probs[:, :, t0:t1, s0:s1], v[:, :, s0:s1]) for t0, t1, s0, s1 in spans]
        return join_chunks(outputs), probs


EAGER = EagerBackend()
