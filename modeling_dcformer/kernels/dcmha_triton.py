"""The "triton" DCMHA backend for CUDA: the call in chunks of queries, each chunk's two matrix products by cuBLAS and
everything between them (Compose, mask, softmax, Compose) by Triton kernels, designed like the CPU kernel.

Per chunk of `c` queries against the `s` keys they may see (`DCMHAInputs.chunk_spans`, the chunk size from a memory
budget: `chunk_queries`):

- forward: `A = q kᵀ` (cuBLAS, in the compute dtype, into one buffer); `_fwd_stats`: per query row and head, the
  maximum and the sum of the exponentials of Compose(A) over each block of keys, as partials; `_fwd_probs`: each
  row's log-sum-exp from its partials, then the probabilities composed again, written over A in the compute dtype
  (zeros where a query does not see a key); `out = P' v` (cuBLAS).
- backward, recomputing: `A = q kᵀ` and `dP' = dO vᵀ` (cuBLAS); `_bwd_stats`: D = Σ P dP per row and head, and the
  post-softmax factors' gradients, as partials; `_bwd_grads`: `dA` written over A, `P'` over dP', and the
  pre-softmax factors' gradients as partials; then `dq = dA k`, `dk = dAᵀ q`, `dv = P'ᵀ dO` (cuBLAS) and the
  partials summed (torch). Every program writes its own partials: no atomics, the same numbers on every run.

A program is one warp: `R` query rows of one (batch, head group) against blocks of `BS` keys, every head of the
group in a loop at run time (the head count is an argument, not a constant), so that sums over the heads stay in
each thread and no register holds a value per head: the kernels' registers do not grow with the heads, and the
factors of a head are loaded where they are used. A program visits only the key blocks its rows can see (causal,
windows); rows and keys that a block holds but cannot see are masked, and the rest of the chunk's rectangle is
written with zeros for the products that read it.

Layouts: q [B, N, T, Dh], k and v [B, Nkv, S, Dh] (the last dimension contiguous; Nkv divides N, and query head n
reads key/value head n // (N / Nkv)); the factors time-last and contiguous fp32, the queries' [B, G, 2, 2I+1, M, T]
and the keys' [B, G, 2, 2I+1, M, S] (slots pre and post; rows w1, w2, dd: `DynamicWeightProjection`'s packing); the
key padding [B, S] uint8 (1: a real token). With fewer key/value heads than query heads (grouped-query attention)
the cuBLAS products take a key/value head's N / Nkv query heads as one matrix of their rows (`grouped_matmul`,
`group_rows`: a copy of the chunk's query rows at most), so that keys and values are never copied per query head
and the products of dk and dv sum over a group's heads themselves; the Triton kernels work on the [B, N, c, s]
scores as they are.

Runs on CUDA, or on the CPU in Triton's interpreter (`TRITON_INTERPRET=1` when this module is imported): that is
how the tests check it against the float64 oracle. Triton is optional: without it this module imports, and
`available()` says False.
"""

from __future__ import annotations

import torch

from ..dcmha_base import DCMHABackend, DCMHAInputs, kv_heads_problem
from ..dcmha_eager import grouped_matmul

MAX_RANK = 8  # dynamic_rank supported by the kernels

try:
    import triton
    import triton.language as tl
except ImportError:  # the other implementations do without Triton
    triton = tl = None

# Query rows and keys of one program's block, per pass (a program is one warp). The rows of a block share its key
# factors (loaded once a head for all of them) and the backward pass writes the key factors' gradients as partials
# per block of rows: more rows, fewer factor loads and fewer partials per score. Compiled for sm_90 by Triton 3.6
# (benchmarks/triton_resources.py, implementations.md has the table) none spills; the backward kernels take up to
# 255 registers a thread, which holds eight one-warp programs on an SM, as many as 228 registers would.
FORWARD_TILE = (8, 16)
BACKWARD_TILE = (8, 16)
# How every kernel is launched: one warp a program, and ptxas allowed every register a thread can have (left to
# itself it capped the query-wise backward kernel at 128 and spilled)
LAUNCH = dict(num_warps=1, maxnreg=255)
# Integer arguments that change from chunk to chunk and call to call (where the chunk and the cache start): Triton
# does not specialise a kernel on their values (divisible by 16, equal to 1), so one compile serves every chunk
OFFSETS = ["t0", "s0", "query_pos0", "key_pos0"]
# The transient memory one call's chunks may take (the score buffers and the partials): the chunk size follows it
MEMORY_BUDGET = 512 << 20
# "auto" runs "triton" for calls of at least this many scores (batch x heads x queries x the keys each chunk sees):
# below that (a decoding step) eager ops cost as little as a launch.
AUTO_MIN_SCORES = 1 << 20
AUTO_MIN_CAPABILITY = (8, 0)  # CUDA GPUs from Ampere on: Triton multiplies bf16 only there (tested: Hopper)


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return triton is not None and bool(triton.knobs.runtime.interpret)


def unsupported(device: torch.device, rank: int) -> str | None:
    """Why the Triton kernels cannot run on `device` with `rank`, or None when they can."""
    if triton is None:
        return "Triton is not installed (pip install triton)"
    if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
        return f"it runs on CUDA (or on CPU under TRITON_INTERPRET=1), not on {device.type}"
    if rank > MAX_RANK:
        return f"it supports dynamic_rank <= {MAX_RANK}"
    return None


def available(device: torch.device | str = "cuda") -> bool:
    return unsupported(torch.device(device), 1) is None


def bytes_per_score(dtype: torch.dtype, rank: int, backward: bool) -> float:
    """Transient bytes a chunk holds per (head, query, key) it computes: the score buffer in the compute dtype (two in
    the backward pass: the products and their gradient), and the partials (per key block and row, or per row block
    and key)."""
    size = torch.finfo(dtype).bits // 8
    keys, rows = FORWARD_TILE[1], BACKWARD_TILE[0]
    if not backward:
        return size + 8 / keys
    terms = 2 * (2 * rank + 1)  # the factors of both slots
    return 2 * size + 4 * (1 + terms) / BACKWARD_TILE[1] + 4 * terms / rows


def chunk_queries(batch: int, heads: int, queries: int, keys: int, dtype: torch.dtype, rank: int,
                  budget: int) -> int:
    """Queries a chunk takes so that its transient memory (`bytes_per_score`, in the backward pass, which holds the
    most) stays within `budget`, the call split into chunks of equal size (no small last chunk): a multiple of the
    row tiles, at least one tile, at most `queries`."""
    per_query = batch * heads * max(keys, 1) * bytes_per_score(dtype, rank, backward=True)
    step = max(FORWARD_TILE[0], BACKWARD_TILE[0])
    largest = max(step, int(budget // per_query) // step * step)
    if largest >= queries:
        return queries
    count = -(-queries // largest)  # chunks
    return min(largest, -(-queries // (count * step)) * step)


if triton is not None:

    @triton.jit
    def _scores(a_ptr, base, offs_r, offs_s, c, s, scale):
        """One head's [R, BS] block of a chunk's [c, s] scores (or their gradient) as fp32, times `scale`."""
        mask = (offs_r[:, None] < c) & (offs_s[None, :] < s)
        x = tl.load(a_ptr + base + offs_r[:, None] * s + offs_s[None, :], mask=mask, other=0.0)
        return x.to(tl.float32) * scale

    @triton.jit
    def _store(a_ptr, base, offs_r, offs_s, c, s, value):
        mask = (offs_r[:, None] < c) & (offs_s[None, :] < s)
        tl.store(a_ptr + base + offs_r[:, None] * s + offs_s[None, :], value.to(a_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _ranks(ptr, base, first, offs_i, offs_x, count, I: tl.constexpr, X):
        """Rows first .. first+I-1 of one head's factors ([IP, BX]; `base` is the head's row 0 at the block's first
        position, X the factors' length in time)."""
        mask = (offs_i[:, None] < I) & (offs_x[None, :] < count)
        return tl.load(ptr + base + (first + offs_i[:, None]) * X + offs_x[None, :], mask=mask, other=0.0)

    @triton.jit
    def _diag(ptr, base, I: tl.constexpr, offs_x, count, X):
        """Row 2I (the diagonal) of one head's factors: [BX]."""
        return tl.load(ptr + base + 2 * I * X + offs_x, mask=offs_x < count, other=0.0)

    @triton.jit
    def _visible(offs_r, offs_s, c, s, pad_ptr, pad_base, query_pos0, key_pos0, window,
                 HAS_PAD: tl.constexpr, HAS_WINDOW: tl.constexpr):  # fmt: skip
        """[R, BS] bool: the query at row offs_r sees the key at offs_s (causal, in the window, not padding, both in
        the chunk)."""
        q_pos = query_pos0 + offs_r[:, None]
        k_pos = key_pos0 + offs_s[None, :]
        ok = (offs_r[:, None] < c) & (offs_s[None, :] < s) & (k_pos <= q_pos)
        if HAS_WINDOW:
            ok = ok & (k_pos > q_pos - window)
        if HAS_PAD:
            ok = ok & (tl.load(pad_ptr + pad_base + offs_s, mask=offs_s < s, other=0) != 0)[None, :]
        return ok

    @triton.jit
    def _blocks(r0, c, s, query_pos0, key_pos0, window, HAS_WINDOW: tl.constexpr, R: tl.constexpr,
                BS: tl.constexpr):  # fmt: skip
        """The key blocks [lo, hi) that the rows [r0, r0 + R) can see, and the chunk's number of key blocks."""
        last = query_pos0 + tl.minimum(r0 + R, c) - 1
        hi = tl.minimum(s, last - key_pos0 + 1)
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(0, query_pos0 + r0 - window + 1 - key_pos0)
        return lo // BS, tl.maximum(tl.cdiv(hi, BS), lo // BS), tl.cdiv(s, BS)

    @triton.jit
    def _hidden(a_ptr, a_base, hs, qt_ptr, q_base, kt_ptr, k_base, offs_r, offs_s, offs_i, c, s, T, S, M, scale,
                I: tl.constexpr, IP: tl.constexpr, HAS_KEY: tl.constexpr, R: tl.constexpr, BS: tl.constexpr):  # fmt: skip
        """The low-rank hidden values of a Compose over a block (its input: `scale` times the heads' scores at
        a_base + n * hs): hq[i] = Σ_n x[n] qw1[i, n] and hk[i] = Σ_n x[n] kw1[i, n], each [IP, R, BS]."""
        hq = tl.zeros((IP, R, BS), tl.float32)
        hk = tl.zeros((IP, R, BS), tl.float32)
        for n in range(M):
            x = _scores(a_ptr, a_base + n * hs, offs_r, offs_s, c, s, scale)[None, :, :]
            hq += x * _ranks(qt_ptr, q_base + n * T, 0, offs_i, offs_r, c, I, M * T)[:, :, None]
            if HAS_KEY:
                hk += x * _ranks(kt_ptr, k_base + n * S, 0, offs_i, offs_s, s, I, M * S)[:, None, :]
        return hq, hk

    @triton.jit
    def _compose(x, hq, hk, qt_ptr, q_base, kt_ptr, k_base, offs_r, offs_s, offs_i, c, s, T, S, M,
                 I: tl.constexpr, HAS_KEY: tl.constexpr):  # fmt: skip
        """Compose of one head's block x [R, BS] (q_base, k_base: that head's factors) with the hidden values:
        x (1 + qdd + kdd) + Σ_i qw2[i] hq[i] + Σ_i kw2[i] hk[i]."""
        qw2 = _ranks(qt_ptr, q_base, I, offs_i, offs_r, c, I, M * T)
        out = x * (1.0 + _diag(qt_ptr, q_base, I, offs_r, c, M * T)[:, None]) + tl.sum(qw2[:, :, None] * hq, 0)
        if HAS_KEY:
            kw2 = _ranks(kt_ptr, k_base, I, offs_i, offs_s, s, I, M * S)
            out += x * _diag(kt_ptr, k_base, I, offs_s, s, M * S)[None, :] + tl.sum(kw2[:, None, :] * hk, 0)
        return out

    @triton.jit
    def _back_hidden(g_ptr, g_base, hs, qt_ptr, q_base, kt_ptr, k_base, offs_r, offs_s, offs_i, c, s, T, S, M,
                     I: tl.constexpr, IP: tl.constexpr, HAS_KEY: tl.constexpr, R: tl.constexpr,
                     BS: tl.constexpr):  # fmt: skip
        """The hidden values of a Compose's vector-Jacobian product for the gradients g of its outputs (the heads'
        blocks at g_base + m * hs): gq[i] = Σ_m g[m] qw2[i, m] and gk[i] = Σ_m g[m] kw2[i, m]."""
        gq = tl.zeros((IP, R, BS), tl.float32)
        gk = tl.zeros((IP, R, BS), tl.float32)
        for m in range(M):
            g = _scores(g_ptr, g_base + m * hs, offs_r, offs_s, c, s, 1.0)[None, :, :]
            gq += g * _ranks(qt_ptr, q_base + m * T, I, offs_i, offs_r, c, I, M * T)[:, :, None]
            if HAS_KEY:
                gk += g * _ranks(kt_ptr, k_base + m * S, I, offs_i, offs_s, s, I, M * S)[:, None, :]
        return gq, gk

    @triton.jit
    def _compose_vjp(g, gq, gk, qt_ptr, q_base, kt_ptr, k_base, offs_r, offs_s, offs_i, c, s, T, S, M,
                     I: tl.constexpr, HAS_KEY: tl.constexpr):  # fmt: skip
        """The gradient of a Compose's input for one head n, from the gradient g [R, BS] of its output n and the
        back hidden values: g (1 + qdd + kdd) + Σ_i qw1[i, n] gq[i] + Σ_i kw1[i, n] gk[i]."""
        qw1 = _ranks(qt_ptr, q_base, 0, offs_i, offs_r, c, I, M * T)
        out = g * (1.0 + _diag(qt_ptr, q_base, I, offs_r, c, M * T)[:, None]) + tl.sum(qw1[:, :, None] * gq, 0)
        if HAS_KEY:
            kw1 = _ranks(kt_ptr, k_base, 0, offs_i, offs_s, s, I, M * S)
            out += g * _diag(kt_ptr, k_base, I, offs_s, s, M * S)[None, :] + tl.sum(kw1[:, None, :] * gk, 0)
        return out

    @triton.jit
    def _program(c, s, T, S, t0, s0, G, M, N, I: tl.constexpr, R: tl.constexpr):
        """What a program works on: its first row; its (batch, group) bg; its group's first head among the batch's
        heads, head0 (b * N + g * M); and that head's offsets in a chunk buffer [B, N, c, s], in the query and key
        factors (pre slot, row 0, the chunk's first position) and in the key padding."""
        r0 = tl.program_id(0) * R
        bg = tl.program_id(1)
        b = bg // G
        head0 = b * N + (bg % G) * M
        q_base = bg * 2 * (2 * I + 1) * M * T + t0
        k_base = bg * 2 * (2 * I + 1) * M * S + s0
        return r0, bg, head0, head0 * c * s, q_base, k_base, b * S + s0

    @triton.jit(do_not_specialize=OFFSETS)
    def _fwd_stats(a_ptr, qt_ptr, kt_ptr, pad_ptr, part_ptr, c, s, T, S, t0, s0, G, M, N,
                   query_pos0, key_pos0, window, scale,
                   I: tl.constexpr, IP: tl.constexpr, HAS_KEY: tl.constexpr, HAS_PAD: tl.constexpr,
                   HAS_WINDOW: tl.constexpr, R: tl.constexpr, BS: tl.constexpr):  # fmt: skip
        """Grid (row blocks, B x G). Per visible key block and head: the maximum and the sum of the exponentials of
        the pre-softmax Compose over the block's keys, per row, into part_ptr [B, N, c, key blocks, 2]."""
        r0, bg, head0, a_base, q_base, k_base, pad_base = _program(c, s, T, S, t0, s0, G, M, N, I, R)
        offs_r = r0 + tl.arange(0, R)
        offs_i = tl.arange(0, IP)
        lo, hi, nb = _blocks(r0, c, s, query_pos0, key_pos0, window, HAS_WINDOW, R, BS)
        hs = c * s
        for blk in range(lo, hi):
            offs_s = blk * BS + tl.arange(0, BS)
            ok = _visible(offs_r, offs_s, c, s, pad_ptr, pad_base, query_pos0, key_pos0, window, HAS_PAD, HAS_WINDOW)
            hq, hk = _hidden(a_ptr, a_base, hs, qt_ptr, q_base, kt_ptr, k_base, offs_r, offs_s, offs_i, c, s, T, S,
                             M, scale, I, IP, HAS_KEY, R, BS)  # fmt: skip
            for m in range(M):
                x = _scores(a_ptr, a_base + m * hs, offs_r, offs_s, c, s, scale)
                z = _compose(x, hq, hk, qt_ptr, q_base + m * T, kt_ptr, k_base + m * S, offs_r, offs_s, offs_i,
                             c, s, T, S, M, I, HAS_KEY)  # fmt: skip
                z = tl.where(ok, z, float("-inf"))
                top = tl.max(z, axis=1)
                shift = tl.where(top == float("-inf"), 0.0, top)
                total = tl.sum(tl.exp(z - shift[:, None]), axis=1)
                at = part_ptr + (((head0 + m) * c + offs_r) * nb + blk) * 2
                tl.store(at, top, mask=offs_r < c)
                tl.store(at + 1, total, mask=offs_r < c)

    @triton.jit
    def _log_sum_exp(part_ptr, row_base, offs_r, c, lo, hi, nb, NW: tl.constexpr, R: tl.constexpr):
        """The log-sum-exp of each row from its blocks' partials (+inf for a row that sees no key)."""
        top = tl.full((R,), float("-inf"), tl.float32)
        total = tl.zeros((R,), tl.float32)
        for w0 in range(lo, hi, NW):
            offs_w = w0 + tl.arange(0, NW)
            mask = (offs_r[:, None] < c) & (offs_w[None, :] < hi)
            at = part_ptr + ((row_base + offs_r[:, None]) * nb + offs_w[None, :]) * 2
            pm = tl.load(at, mask=mask, other=float("-inf"))
            ps = tl.load(at + 1, mask=mask, other=0.0)
            new = tl.maximum(top, tl.max(pm, axis=1))
            shift = tl.where(new == float("-inf"), 0.0, new)
            total = total * tl.exp(top - shift) + tl.sum(ps * tl.exp(pm - shift[:, None]), axis=1)
            top = new
        return tl.where(total > 0, top + tl.log(tl.where(total > 0, total, 1.0)), float("inf"))

    @triton.jit
    def _zero_rest(a_ptr, a_base, hs, offs_r, c, s, lo, hi, nb, M, R: tl.constexpr, BS: tl.constexpr):
        """Zeros into the key blocks of the rows' chunk rectangle outside [lo, hi): what no query of theirs sees."""
        zero = tl.zeros((R, BS), tl.float32)
        for blk in range(0, nb):
            if (blk < lo) | (blk >= hi):
                offs_s = blk * BS + tl.arange(0, BS)
                for m in range(M):
                    _store(a_ptr, a_base + m * hs, offs_r, offs_s, c, s, zero)

    @triton.jit
    def _probs(a_ptr, base, lse_ptr, lse_base, hq, hk, qt_ptr, q_base, kt_ptr, k_base, ok, offs_r, offs_s, offs_i,
               c, s, T, S, M, scale, I: tl.constexpr, HAS_KEY: tl.constexpr):  # fmt: skip
        """One head's probabilities over a block: exp(Compose(x) - lse), 0 where the query does not see the key."""
        x = _scores(a_ptr, base, offs_r, offs_s, c, s, scale)
        z = _compose(x, hq, hk, qt_ptr, q_base, kt_ptr, k_base, offs_r, offs_s, offs_i, c, s, T, S, M, I, HAS_KEY)
        lse = tl.load(lse_ptr + lse_base + offs_r, mask=offs_r < c, other=float("inf"))
        return tl.where(ok, tl.exp(z - lse[:, None]), 0.0)

    @triton.jit(do_not_specialize=OFFSETS)
    def _fwd_probs(a_ptr, qt_ptr, kt_ptr, pad_ptr, part_ptr, lse_ptr, c, s, T, S, t0, s0, G, M, N,
                   query_pos0, key_pos0, window, scale,
                   I: tl.constexpr, IP: tl.constexpr, HAS_KEY: tl.constexpr, HAS_PAD: tl.constexpr,
                   HAS_WINDOW: tl.constexpr, R: tl.constexpr, BS: tl.constexpr, NW: tl.constexpr):  # fmt: skip
        """Grid (row blocks, B x G). Each row's log-sum-exp per head (into lse_ptr [B, N, T]), then per visible key
        block the probabilities, composed again, written over the scores (zeros for the keys a query does not see,
        and for the blocks outside the rows' band)."""
        r0, bg, head0, a_base, q_base, k_base, pad_base = _program(c, s, T, S, t0, s0, G, M, N, I, R)
        offs_r = r0 + tl.arange(0, R)
        offs_i = tl.arange(0, IP)
        lo, hi, nb = _blocks(r0, c, s, query_pos0, key_pos0, window, HAS_WINDOW, R, BS)
        hs = c * s
        for m in range(M):
            lse = _log_sum_exp(part_ptr, (head0 + m) * c, offs_r, c, lo, hi, nb, NW, R)
            tl.store(lse_ptr + (head0 + m) * T + t0 + offs_r, lse, mask=offs_r < c)
        tl.debug_barrier()  # the log-sum-exps above are read back below
        post_q, post_k = q_base + (2 * I + 1) * M * T, k_base + (2 * I + 1) * M * S
        for blk in range(lo, hi):
            offs_s = blk * BS + tl.arange(0, BS)
            ok = _visible(offs_r, offs_s, c, s, pad_ptr, pad_base, query_pos0, key_pos0, window, HAS_PAD, HAS_WINDOW)
            hq, hk = _hidden(a_ptr, a_base, hs, qt_ptr, q_base, kt_ptr, k_base, offs_r, offs_s, offs_i, c, s, T, S,
                             M, scale, I, IP, HAS_KEY, R, BS)  # fmt: skip
            pq = tl.zeros((IP, R, BS), tl.float32)
            pk = tl.zeros((IP, R, BS), tl.float32)
            for n in range(M):  # the probabilities, and the hidden values of the post-softmax Compose
                p = _probs(a_ptr, a_base + n * hs, lse_ptr, (head0 + n) * T + t0, hq, hk, qt_ptr, q_base + n * T,
                           kt_ptr, k_base + n * S, ok, offs_r, offs_s, offs_i, c, s, T, S, M, scale, I,
                           HAS_KEY)[None, :, :]  # fmt: skip
                pq += p * _ranks(qt_ptr, post_q + n * T, 0, offs_i, offs_r, c, I, M * T)[:, :, None]
                if HAS_KEY:
                    pk += p * _ranks(kt_ptr, post_k + n * S, 0, offs_i, offs_s, s, I, M * S)[:, None, :]
            for m in range(M):
                p = _probs(a_ptr, a_base + m * hs, lse_ptr, (head0 + m) * T + t0, hq, hk, qt_ptr, q_base + m * T,
                           kt_ptr, k_base + m * S, ok, offs_r, offs_s, offs_i, c, s, T, S, M, scale, I,
                           HAS_KEY)  # fmt: skip
                out = _compose(p, pq, pk, qt_ptr, post_q + m * T, kt_ptr, post_k + m * S, offs_r, offs_s, offs_i,
                               c, s, T, S, M, I, HAS_KEY)  # fmt: skip
                _store(a_ptr, a_base + m * hs, offs_r, offs_s, c, s, tl.where(ok, out, 0.0))
        _zero_rest(a_ptr, a_base, hs, offs_r, c, s, lo, hi, nb, M, R, BS)

    @triton.jit
    def _query_grads(qpart_ptr, bg, slot, m, M, I: tl.constexpr, offs_i, offs_r, c, nb, blk, first, d_w, d_dd):
        """One head's gradients of one slot's query factors over one key block, per row: rank rows first ..
        first+I-1 (d_w: [IP, R]) and, unless d_dd is None, the diagonal ([R]), into the partials qpart_ptr
        [B, G, 2, 2I+1, M, c, key blocks]."""
        head = ((bg * 2 + slot) * (2 * I + 1) * M + m) * c * nb
        rows = M * c * nb
        at = qpart_ptr + head + (first + offs_i[:, None]) * rows + offs_r[None, :] * nb + blk
        tl.store(at, d_w, mask=(offs_i[:, None] < I) & (offs_r[None, :] < c))
        if d_dd is not None:
            tl.store(qpart_ptr + head + 2 * I * rows + offs_r * nb + blk, d_dd, mask=offs_r < c)

    @triton.jit
    def _key_grads(kpart_ptr, bg, slot, m, M, I: tl.constexpr, offs_i, offs_s, s, rb, rbs, first, d_w, d_dd):
        """One head's gradients of one slot's key factors over one block of rows, per key: rank rows first ..
        first+I-1 (d_w: [IP, BS]) and, unless d_dd is None, the diagonal ([BS]), into the partials kpart_ptr
        [B, G, 2, 2I+1, M, row blocks, s]."""
        head = ((bg * 2 + slot) * (2 * I + 1) * M + m) * rbs * s + rb * s
        rows = M * rbs * s
        at = kpart_ptr + head + (first + offs_i[:, None]) * rows + offs_s[None, :]
        tl.store(at, d_w, mask=(offs_i[:, None] < I) & (offs_s[None, :] < s))
        if d_dd is not None:
            tl.store(kpart_ptr + head + 2 * I * rows + offs_s, d_dd, mask=offs_s < s)

    @triton.jit
    def _backward_block(blk, a_ptr, d_ptr, qt_ptr, kt_ptr, pad_ptr, lse_ptr, a_base, q_base, k_base, pad_base, head0,
                        offs_r, offs_i, c, s, T, S, t0, M, query_pos0, key_pos0, window, scale, I: tl.constexpr,
                        IP: tl.constexpr, HAS_KEY: tl.constexpr, HAS_PAD: tl.constexpr, HAS_WINDOW: tl.constexpr,
                        R: tl.constexpr, BS: tl.constexpr):  # fmt: skip
        """What both backward sweeps recompute for the key block `blk` of their rows: its keys (offs_s), which
        scores are visible (ok), and the hidden values of the pre-softmax Compose (hq, hk), of the post-softmax
        Compose of the probabilities (pq, pk) and of its vector-Jacobian product for their gradient, d_ptr
        (gq, gk)."""
        hs = c * s
        post_q, post_k = q_base + (2 * I + 1) * M * T, k_base + (2 * I + 1) * M * S
        offs_s = blk * BS + tl.arange(0, BS)
        ok = _visible(offs_r, offs_s, c, s, pad_ptr, pad_base, query_pos0, key_pos0, window, HAS_PAD, HAS_WINDOW)
        hq, hk = _hidden(a_ptr, a_base, hs, qt_ptr, q_base, kt_ptr, k_base, offs_r, offs_s, offs_i, c, s, T, S, M,
                         scale, I, IP, HAS_KEY, R, BS)  # fmt: skip
        pq, pk = _post_hidden(a_ptr, a_base, hs, lse_ptr, head0 * T + t0, hq, hk, qt_ptr, q_base, kt_ptr, k_base, ok,
                              offs_r, offs_s, offs_i, c, s, T, S, M, scale, I, IP, HAS_KEY, R, BS)  # fmt: skip
        gq, gk = _back_hidden(d_ptr, a_base, hs, qt_ptr, post_q, kt_ptr, post_k, offs_r, offs_s, offs_i, c, s, T, S,
                              M, I, IP, HAS_KEY, R, BS)  # fmt: skip
        return offs_s, ok, hq, hk, pq, pk, gq, gk

    @triton.jit(do_not_specialize=OFFSETS)
    def _bwd_stats(a_ptr, qt_ptr, kt_ptr, pad_ptr, d_ptr, lse_ptr, dpart_ptr, qpart_ptr, kpart_ptr,
                   c, s, T, S, t0, s0, G, M, N, query_pos0, key_pos0, window, scale,
                   I: tl.constexpr, IP: tl.constexpr, HAS_KEY: tl.constexpr, HAS_PAD: tl.constexpr,
                   HAS_WINDOW: tl.constexpr, R: tl.constexpr, BS: tl.constexpr):  # fmt: skip
        """Grid (row blocks, B x G), over the chunk's scores (a_ptr) and the gradient of its composed probabilities
        (d_ptr). Per visible key block and head: Σ_keys P dP per row (dP: the gradient of the probabilities, through
        the post-softmax Compose) into dpart_ptr [B, N, c, key blocks], and the gradients of the post-softmax
        factors as partials (`_query_grads`, `_key_grads`)."""
        r0, bg, head0, a_base, q_base, k_base, pad_base = _program(c, s, T, S, t0, s0, G, M, N, I, R)
        offs_r = r0 + tl.arange(0, R)
        offs_i = tl.arange(0, IP)
        lo, hi, nb = _blocks(r0, c, s, query_pos0, key_pos0, window, HAS_WINDOW, R, BS)
        hs = c * s
        post_q, post_k = q_base + (2 * I + 1) * M * T, k_base + (2 * I + 1) * M * S
        rb, rbs = tl.program_id(0), tl.cdiv(c, R)
        for blk in range(lo, hi):
            offs_s, ok, hq, hk, pq, pk, gq, gk = _backward_block(
                blk, a_ptr, d_ptr, qt_ptr, kt_ptr, pad_ptr, lse_ptr, a_base, q_base, k_base, pad_base, head0, offs_r,
                offs_i, c, s, T, S, t0, M, query_pos0, key_pos0, window, scale, I, IP, HAS_KEY, HAS_PAD, HAS_WINDOW,
                R, BS)  # fmt: skip
            for n in range(M):
                p = _probs(a_ptr, a_base + n * hs, lse_ptr, (head0 + n) * T + t0, hq, hk, qt_ptr, q_base + n * T,
                           kt_ptr, k_base + n * S, ok, offs_r, offs_s, offs_i, c, s, T, S, M, scale, I,
                           HAS_KEY)  # fmt: skip
                g = tl.where(ok, _scores(d_ptr, a_base + n * hs, offs_r, offs_s, c, s, 1.0), 0.0)
                dp = _compose_vjp(g, gq, gk, qt_ptr, post_q + n * T, kt_ptr, post_k + n * S, offs_r, offs_s, offs_i,
                                  c, s, T, S, M, I, HAS_KEY)  # fmt: skip
                tl.store(dpart_ptr + ((head0 + n) * c + offs_r) * nb + blk, tl.sum(p * dp, axis=1), mask=offs_r < c)
                _query_grads(qpart_ptr, bg, 1, n, M, I, offs_i, offs_r, c, nb, blk, 0,
                             tl.sum(p[None, :, :] * gq, axis=2), None)  # fmt: skip
                _query_grads(qpart_ptr, bg, 1, n, M, I, offs_i, offs_r, c, nb, blk, I,
                             tl.sum(g[None, :, :] * pq, axis=2), tl.sum(g * p, axis=1))  # fmt: skip
                if HAS_KEY:
                    _key_grads(kpart_ptr, bg, 1, n, M, I, offs_i, offs_s, s, rb, rbs, 0,
                               tl.sum(p[None, :, :] * gk, axis=1), None)  # fmt: skip
                    _key_grads(kpart_ptr, bg, 1, n, M, I, offs_i, offs_s, s, rb, rbs, I,
                               tl.sum(g[None, :, :] * pk, axis=1), tl.sum(g * p, axis=0))  # fmt: skip

    @triton.jit
    def _post_hidden(a_ptr, a_base, hs, lse_ptr, lse_base, hq, hk, qt_ptr, q_base, kt_ptr, k_base, ok, offs_r, offs_s,
                     offs_i, c, s, T, S, M, scale, I: tl.constexpr, IP: tl.constexpr, HAS_KEY: tl.constexpr,
                     R: tl.constexpr, BS: tl.constexpr):  # fmt: skip
        """The hidden values of the post-softmax Compose: Σ_n p[n] w1[i, n] for the queries' and the keys' post
        factors, the probabilities recomputed from the scores."""
        post_q, post_k = q_base + (2 * I + 1) * M * T, k_base + (2 * I + 1) * M * S
        pq = tl.zeros((IP, R, BS), tl.float32)
        pk = tl.zeros((IP, R, BS), tl.float32)
        for n in range(M):
            p = _probs(a_ptr, a_base + n * hs, lse_ptr, lse_base + n * T, hq, hk, qt_ptr, q_base + n * T, kt_ptr,
                       k_base + n * S, ok, offs_r, offs_s, offs_i, c, s, T, S, M, scale, I, HAS_KEY)[None, :, :]
            pq += p * _ranks(qt_ptr, post_q + n * T, 0, offs_i, offs_r, c, I, M * T)[:, :, None]
            if HAS_KEY:
                pk += p * _ranks(kt_ptr, post_k + n * S, 0, offs_i, offs_s, s, I, M * S)[:, None, :]
        return pq, pk

    @triton.jit
    def _zero_key_partials(kpart_ptr, bg, M, I: tl.constexpr, s, rb, rbs, lo, hi, nb, BS: tl.constexpr):
        """Zeros into this row block's key partials (every head, both slots) for the key blocks outside [lo, hi)."""
        zero = tl.zeros((BS,), tl.float32)
        for blk in range(0, nb):
            if (blk < lo) | (blk >= hi):
                offs_s = blk * BS + tl.arange(0, BS)
                for row in range(2 * (2 * I + 1) * M):
                    base = (bg * 2 * (2 * I + 1) * M + row) * rbs * s + rb * s
                    tl.store(kpart_ptr + base + offs_s, zero, mask=offs_s < s)

    @triton.jit
    def _sum_query_partials(qpart_ptr, dqt_ptr, bg, M, I: tl.constexpr, offs_r, c, T, t0, lo, hi, nb,
                            NW: tl.constexpr, R: tl.constexpr):  # fmt: skip
        """Every query factor's gradient (both slots, every head) of the rows offs_r: its partials over the key
        blocks [lo, hi) summed, into dqt_ptr [B, G, 2, 2I+1, M, T] (each row lies in one chunk: written, not
        added)."""
        for row in range(2 * (2 * I + 1) * M):
            total = tl.zeros((R,), tl.float32)
            for w0 in range(lo, hi, NW):
                offs_w = w0 + tl.arange(0, NW)
                mask = (offs_r[:, None] < c) & (offs_w[None, :] < hi)
                at = qpart_ptr + ((bg * 2 * (2 * I + 1) * M + row) * c + offs_r[:, None]) * nb + offs_w[None, :]
                total += tl.sum(tl.load(at, mask=mask, other=0.0), axis=1)
            tl.store(dqt_ptr + (bg * 2 * (2 * I + 1) * M + row) * T + t0 + offs_r, total, mask=offs_r < c)

    @triton.jit(do_not_specialize=OFFSETS)
    def _bwd_grads(a_ptr, qt_ptr, kt_ptr, pad_ptr, d_ptr, lse_ptr, dpart_ptr, delta_ptr, qpart_ptr, kpart_ptr,
                   dqt_ptr, c, s, T, S, t0, s0, G, M, N, query_pos0, key_pos0, window, scale,
                   I: tl.constexpr, IP: tl.constexpr, HAS_KEY: tl.constexpr, HAS_PAD: tl.constexpr,
                   HAS_WINDOW: tl.constexpr, R: tl.constexpr, BS: tl.constexpr, NW: tl.constexpr):  # fmt: skip
        """Grid (row blocks, B x G). Each row's D = Σ_keys P dP per head from `_bwd_stats`' partials (into delta_ptr
        [B, N, c]); then per visible key block the gradient of the scores, written over them (a_ptr), the composed
        probabilities, written over their gradient (d_ptr), and the gradients of the pre-softmax factors as
        partials; zeros outside the rows' band (also in the key partials, which are summed over row blocks). Last,
        the query factors' gradients of both slots, its rows' partials summed, into dqt_ptr (the call's
        [B, G, 2, 2I+1, M, T])."""
        r0, bg, head0, a_base, q_base, k_base, pad_base = _program(c, s, T, S, t0, s0, G, M, N, I, R)
        offs_r = r0 + tl.arange(0, R)
        offs_i = tl.arange(0, IP)
        lo, hi, nb = _blocks(r0, c, s, query_pos0, key_pos0, window, HAS_WINDOW, R, BS)
        hs = c * s
        for m in range(M):
            delta = tl.zeros((R,), tl.float32)
            for w0 in range(lo, hi, NW):
                offs_w = w0 + tl.arange(0, NW)
                mask = (offs_r[:, None] < c) & (offs_w[None, :] < hi)
                parts = tl.load(dpart_ptr + ((head0 + m) * c + offs_r[:, None]) * nb + offs_w[None, :], mask=mask,
                                other=0.0)  # fmt: skip
                delta += tl.sum(parts, axis=1)
            tl.store(delta_ptr + (head0 + m) * c + offs_r, delta, mask=offs_r < c)
        tl.debug_barrier()  # the sums above are read back below
        post_q, post_k = q_base + (2 * I + 1) * M * T, k_base + (2 * I + 1) * M * S
        rb, rbs = tl.program_id(0), tl.cdiv(c, R)
        for blk in range(lo, hi):
            offs_s, ok, hq, hk, pq, pk, gq, gk = _backward_block(
                blk, a_ptr, d_ptr, qt_ptr, kt_ptr, pad_ptr, lse_ptr, a_base, q_base, k_base, pad_base, head0, offs_r,
                offs_i, c, s, T, S, t0, M, query_pos0, key_pos0, window, scale, I, IP, HAS_KEY, HAS_PAD, HAS_WINDOW,
                R, BS)  # fmt: skip
            zq = tl.zeros((IP, R, BS), tl.float32)  # the back hidden values of the pre-softmax Compose
            zk = tl.zeros((IP, R, BS), tl.float32)
            for m in range(M):
                x = _scores(a_ptr, a_base + m * hs, offs_r, offs_s, c, s, scale)
                dz = _logit_grad(a_ptr, d_ptr, a_base + m * hs, lse_ptr, delta_ptr, head0 + m, t0, hq, hk, gq, gk,
                                 qt_ptr, q_base + m * T, kt_ptr, k_base + m * S, ok, offs_r, offs_s, offs_i, c, s,
                                 T, S, M, scale, I, HAS_KEY)  # fmt: skip
                zq += dz[None, :, :] * _ranks(qt_ptr, q_base + m * T, I, offs_i, offs_r, c, I, M * T)[:, :, None]
                _query_grads(qpart_ptr, bg, 0, m, M, I, offs_i, offs_r, c, nb, blk, I,
                             tl.sum(dz[None, :, :] * hq, axis=2), tl.sum(dz * x, axis=1))  # fmt: skip
                if HAS_KEY:
                    zk += dz[None, :, :] * _ranks(kt_ptr, k_base + m * S, I, offs_i, offs_s, s, I, M * S)[:, None, :]
                    _key_grads(kpart_ptr, bg, 0, m, M, I, offs_i, offs_s, s, rb, rbs, I,
                               tl.sum(dz[None, :, :] * hk, axis=1), tl.sum(dz * x, axis=0))  # fmt: skip
            for n in range(M):
                x = _scores(a_ptr, a_base + n * hs, offs_r, offs_s, c, s, scale)
                dz = _logit_grad(a_ptr, d_ptr, a_base + n * hs, lse_ptr, delta_ptr, head0 + n, t0, hq, hk, gq, gk,
                                 qt_ptr, q_base + n * T, kt_ptr, k_base + n * S, ok, offs_r, offs_s, offs_i, c, s,
                                 T, S, M, scale, I, HAS_KEY)  # fmt: skip
                p = _probs(a_ptr, a_base + n * hs, lse_ptr, (head0 + n) * T + t0, hq, hk, qt_ptr, q_base + n * T,
                           kt_ptr, k_base + n * S, ok, offs_r, offs_s, offs_i, c, s, T, S, M, scale, I,
                           HAS_KEY)  # fmt: skip
                dx = _compose_vjp(dz, zq, zk, qt_ptr, q_base + n * T, kt_ptr, k_base + n * S, offs_r, offs_s, offs_i,
                                  c, s, T, S, M, I, HAS_KEY)  # fmt: skip
                out = _compose(p, pq, pk, qt_ptr, post_q + n * T, kt_ptr, post_k + n * S, offs_r, offs_s, offs_i,
                               c, s, T, S, M, I, HAS_KEY)  # fmt: skip
                _query_grads(qpart_ptr, bg, 0, n, M, I, offs_i, offs_r, c, nb, blk, 0,
                             tl.sum(x[None, :, :] * zq, axis=2), None)  # fmt: skip
                if HAS_KEY:
                    _key_grads(kpart_ptr, bg, 0, n, M, I, offs_i, offs_s, s, rb, rbs, 0,
                               tl.sum(x[None, :, :] * zk, axis=1), None)  # fmt: skip
                _store(a_ptr, a_base + n * hs, offs_r, offs_s, c, s, tl.where(ok, dx * scale, 0.0))
                _store(d_ptr, a_base + n * hs, offs_r, offs_s, c, s, tl.where(ok, out, 0.0))
        _zero_rest(a_ptr, a_base, hs, offs_r, c, s, lo, hi, nb, M, R, BS)
        _zero_rest(d_ptr, a_base, hs, offs_r, c, s, lo, hi, nb, M, R, BS)
        if HAS_KEY:
            _zero_key_partials(kpart_ptr, bg, M, I, s, rb, rbs, lo, hi, nb, BS)
        tl.debug_barrier()  # the query partials above are read back below
        _sum_query_partials(qpart_ptr, dqt_ptr, bg, M, I, offs_r, c, T, t0, lo, hi, nb, NW, R)

    @triton.jit
    def _logit_grad(a_ptr, d_ptr, base, lse_ptr, delta_ptr, head, t0, hq, hk, gq, gk, qt_ptr, q_base, kt_ptr, k_base,
                    ok, offs_r, offs_s, offs_i, c, s, T, S, M, scale, I: tl.constexpr, HAS_KEY: tl.constexpr):  # fmt: skip
        """One head's gradient of the pre-softmax Compose's output (the logits): P (dP - D), with dP the gradient of
        the probabilities through the post-softmax Compose (gq, gk: its back hidden values)."""
        post_q, post_k = q_base + (2 * I + 1) * M * T, k_base + (2 * I + 1) * M * S
        p = _probs(a_ptr, base, lse_ptr, head * T + t0, hq, hk, qt_ptr, q_base, kt_ptr, k_base, ok, offs_r, offs_s,
                   offs_i, c, s, T, S, M, scale, I, HAS_KEY)  # fmt: skip
        g = tl.where(ok, _scores(d_ptr, base, offs_r, offs_s, c, s, 1.0), 0.0)
        dp = _compose_vjp(g, gq, gk, qt_ptr, post_q, kt_ptr, post_k, offs_r, offs_s, offs_i, c, s, T, S, M, I, HAS_KEY)
        delta = tl.load(delta_ptr + head * c + offs_r, mask=offs_r < c, other=0.0)
        return p * (dp - delta[:, None])

def _constants(rank: int, has_key: bool, pad, window, tile: tuple[int, int]) -> dict:
    return dict(I=rank, IP=max(2, triton.next_power_of_2(rank)), HAS_KEY=has_key, HAS_PAD=pad is not None,
                HAS_WINDOW=window is not None, R=tile[0], BS=tile[1])  # fmt: skip


class Chunk:
    """One chunk of a call: queries [t0, t1) against keys [s0, s1) (indices into the call's), with what every kernel
    of it takes besides its buffers."""

    def __init__(self, call, span: tuple[int, int, int, int]):
        self.t0, t1, self.s0, s1 = span
        self.c, self.s = t1 - self.t0, s1 - self.s0
        self.call = call
        self.positions = (call.query_start + self.t0, call.key_start + self.s0, call.window or 0)

    def launch(self, kernel, tile, *buffers, **extra):
        """kernel[grid](...) over the chunk's row blocks and (batch, group)s; a program too big for this GPU is one
        clear error instead of Triton's."""
        call = self.call
        grid = (triton.cdiv(self.c, tile[0]), call.batch * call.groups)
        try:
            kernel[grid](*buffers, self.c, self.s, call.T, call.S, self.t0, self.s0, call.groups,
                         call.heads_per_group, call.heads, *self.positions, call.scale, **LAUNCH,
                         **_constants(call.rank, call.key_terms is not None, call.pad, call.window, tile), **extra)
        except triton.runtime.errors.OutOfResources as err:
            raise ValueError(f"the Triton DCMHA kernels do not fit this GPU at a tile of {tile[0]} queries x "
                             f"{tile[1]} keys ({err}); use a smaller tile or dcmha_implementation=\"compiled\"") from err


class Call:
    """What the kernels of one attention call share: the factors time-last in fp32, the padding as uint8, the
    sizes and positions."""

    def __init__(self, inputs: DCMHAInputs, query_terms, key_terms, budget: int, chunk: int | None = None):
        B, N, T, S, Dh = inputs.shapes
        self.batch, self.heads, self.T, self.S = B, N, T, S
        self.groups, self.rank, self.window = inputs.num_groups, inputs.rank, inputs.window_size
        self.heads_per_group = N // self.groups
        self.query_start, self.key_start, self.scale = inputs.query_start, inputs.key_start, Dh**-0.5
        self.query_terms, self.key_terms = query_terms, key_terms
        pad = inputs.key_padding_mask
        self.pad = None if pad is None else pad.to(torch.uint8).contiguous()
        keys = S if self.window is None else min(S, self.window + T)
        self.chunk = chunk or chunk_queries(B, N, T, keys, inputs.query.dtype, self.rank, budget)
        self.spans = inputs.chunk_spans(queries=self.chunk) if T and S else []

    def operands(self, *buffers):
        """The kernel operands after the chunk buffers: the factors and the padding (placeholders where absent)."""
        qt = self.query_terms
        return (*buffers[:1], qt, qt if self.key_terms is None else self.key_terms,
                qt if self.pad is None else self.pad, *buffers[1:])


def group_rows(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """x [B, N, c, X] as [B, Nkv, N/Nkv * c, X]: each key/value head's query heads' rows as one matrix (a view where
    x's strides allow it, else a copy of x), the operand of a product that sums over the heads of a group."""
    B, N, c, X = x.shape
    return x.reshape(B, kv_heads, (N // kv_heads) * c, X)


def _forward(call: Call, query, key, value):
    """The attention output [B, T, N, Dh] and the log-sum-exp of every row and head [B, N, T] (for the backward);
    key and value [B, Nkv, S, Dh]."""
    B, N, T, Dh = query.shape
    out = query.new_zeros(B, T, N, Dh) if key.shape[2] == 0 else query.new_empty(B, T, N, Dh)
    lse = torch.full((B, N, T), float("inf"), device=query.device, dtype=torch.float32)
    for span in call.spans:
        chunk = Chunk(call, span)
        t0, t1, s0, s1 = span
        scores = grouped_matmul(query[:, :, t0:t1], key[:, :, s0:s1].transpose(-1, -2)).contiguous()
        blocks = triton.cdiv(chunk.s, FORWARD_TILE[1])
        partials = torch.empty(B, N, chunk.c, blocks, 2, device=query.device, dtype=torch.float32)
        chunk.launch(_fwd_stats, FORWARD_TILE, *call.operands(scores, partials))
        chunk.launch(_fwd_probs, FORWARD_TILE, *call.operands(scores, partials, lse), NW=32)
        out[:, t0:t1] = grouped_matmul(scores, value[:, :, s0:s1]).transpose(1, 2)
    return out, lse


def _backward(call: Call, query, key, value, lse, grad_out):
    """The gradients of q, k, v (in their dtypes) and of the query and key factors (fp32), chunk by chunk: the
    products recomputed (cuBLAS), then the two kernels, then the products' gradients (cuBLAS) and the partials
    summed. key and value [B, Nkv, S, Dh]: dk and dv are one product per key/value head over its query heads' rows
    (`group_rows`), which sums over them."""
    B, N, T, Dh = query.shape
    Nkv = key.shape[1]
    G, M, I, R = call.groups, call.heads_per_group, call.rank, BACKWARD_TILE[0]
    d_out = grad_out.transpose(1, 2)  # [B, N, T, Dh]
    dq = torch.empty(query.shape, device=query.device, dtype=torch.float32)
    dk = torch.zeros(key.shape, device=query.device, dtype=torch.float32)
    dv = torch.zeros(value.shape, device=query.device, dtype=torch.float32)
    dqt = torch.zeros_like(call.query_terms)  # (rows of no chunk: none unless T = 0)
    dkt = None if call.key_terms is None else torch.zeros_like(call.key_terms)
    for span in call.spans:
        chunk = Chunk(call, span)
        t0, t1, s0, s1 = span
        c, s, blocks, row_blocks = chunk.c, chunk.s, triton.cdiv(chunk.s, BACKWARD_TILE[1]), triton.cdiv(chunk.c, R)
        k, v = key[:, :, s0:s1], value[:, :, s0:s1]
        q, g = group_rows(query[:, :, t0:t1], Nkv), group_rows(d_out[:, :, t0:t1], Nkv)  # [B, Nkv, rep * c, Dh]
        scores = torch.matmul(q, k.transpose(-1, -2)).view(B, N, c, s)
        d_probs = torch.matmul(g, v.transpose(-1, -2)).view(B, N, c, s)
        dpart = torch.empty(B, N, c, blocks, device=query.device, dtype=torch.float32)
        delta = torch.empty(B, N, c, device=query.device, dtype=torch.float32)
        qpart = torch.empty(B, G, 2, 2 * I + 1, M, c, blocks, device=query.device, dtype=torch.float32)
        kpart = dpart  # a placeholder: query-wise composition has no key factors
        if dkt is not None:
            kpart = torch.empty(B, G, 2, 2 * I + 1, M, row_blocks, s, device=query.device, dtype=torch.float32)
        operands = call.operands(scores, d_probs, lse, dpart)
        chunk.launch(_bwd_stats, BACKWARD_TILE, *operands, qpart, kpart)
        chunk.launch(_bwd_grads, BACKWARD_TILE, *operands, delta, qpart, kpart, dqt, NW=32)
        # now scores holds the gradient of the products (scale included), d_probs the composed probabilities
        dq[:, :, t0:t1] = grouped_matmul(scores, k)
        dk[:, :, s0:s1] += torch.matmul(group_rows(scores, Nkv).transpose(-1, -2), q)
        dv[:, :, s0:s1] += torch.matmul(group_rows(d_probs, Nkv).transpose(-1, -2), g)
        if dkt is not None:
            dkt[..., s0:s1] += kpart.sum(-2)
    if not call.spans:
        dq.zero_()  # no query (and no chunk) at all
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), dqt, dkt


class _DCMHAFunction(torch.autograd.Function):
    """The chunked forward with its gradient; the forward keeps its inputs and the rows' log-sum-exps only."""

    @staticmethod
    def forward(ctx, call: Call, query, key, value, query_terms, key_terms):
        out, lse = _forward(call, query, key, value)
        ctx.call = call
        ctx.save_for_backward(query, key, value, query_terms, key_terms, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, query_terms, key_terms, lse = ctx.saved_tensors
        call = ctx.call
        call.query_terms, call.key_terms = query_terms, key_terms
        dq, dk, dv, dqt, dkt = _backward(call, query, key, value, lse, grad_out)
        return None, dq, dk, dv, dqt, dkt


def dcmha_triton(inputs: DCMHAInputs, budget: int = MEMORY_BUDGET, chunk: int | None = None) -> torch.Tensor:
    """DCMHA of the call `inputs` by the Triton kernels, differentiable: the output [B, T, N, Dh]; chunks of queries
    whose transient memory stays within `budget` bytes, or of `chunk` queries where given."""
    problem = unsupported(inputs.query.device, inputs.rank) or kv_heads_problem(inputs)
    if problem is not None:
        raise ValueError(f"the Triton DCMHA kernels cannot run: {problem}")
    qt, kt = (None if t is None else t.float() for t in inputs.time_last_terms())
    call = Call(inputs, qt, kt, budget, chunk)
    query, key, value = (x if x.stride(-1) == 1 else x.contiguous() for x in (inputs.query, inputs.key, inputs.value))
    return _DCMHAFunction.apply(call, query, key, value, qt, kt)


class TritonBackend(DCMHABackend):
    """"triton": per chunk of queries, cuBLAS products and Triton kernels between them (the module's docstring),
    forward and backward, the chunks' transient memory within `memory_budget` bytes (or chunks of `chunk_queries`
    queries, where given: the benchmarks' sweep). "auto" takes it for large calls on CUDA GPUs of compute capability
    `AUTO_MIN_CAPABILITY` or newer (`device_capability`: torch.cuda's, or a stand-in)."""

    name = "triton"
    auto_rank = 20

    def __init__(self, auto_min_scores: int = AUTO_MIN_SCORES, device_capability=None,
                 memory_budget: int = MEMORY_BUDGET, chunk_queries: int | None = None):
        self.auto_min_scores = auto_min_scores
        self.device_capability = device_capability or torch.cuda.get_device_capability
        self.memory_budget, self.chunk_queries = memory_budget, chunk_queries

    def why_not(self, inputs: DCMHAInputs, output_attentions: bool = False) -> str | None:
        if self.failure is not None:
            return self.failure
        if not inputs.composed:
            return "no composition (use_dcmha=False)"
        if output_attentions:
            return "it does not return the attention probabilities (output_attentions=True)"
        return unsupported(inputs.query.device, inputs.rank) or kv_heads_problem(inputs)

    def why_not_auto(self, inputs: DCMHAInputs, output_attentions: bool = False) -> str | None:
        device = inputs.query.device
        if device.type != "cuda":
            return f"it is chosen on CUDA only, not on {device.type}"
        if inputs.num_scores < self.auto_min_scores:
            return f"fewer than {self.auto_min_scores} scores: eager ops cost as little as a launch"
        if tuple(self.device_capability(device)) < AUTO_MIN_CAPABILITY:
            return f"compute capability below {AUTO_MIN_CAPABILITY} (Triton multiplies bf16 only from Ampere on)"
        return self.why_not(inputs, output_attentions)

    def __call__(self, inputs: DCMHAInputs, *, output_attentions: bool = False, recompute: bool = False):
        return dcmha_triton(inputs, self.memory_budget, self.chunk_queries), None


TRITON = TritonBackend()
