"""DCMHA as flash-style Triton kernels, forward and backward (the "triton" implementation).

No [heads, queries, keys] tensor is ever stored: each program holds one block of queries (or keys) for all the
heads of one group, recomputes the q.k scores block by block and composes them in registers.

- forward, one program per (query block, batch x group), two passes over the keys it sees:
  1. scores -> Compose (pre) -> mask -> running row max and sum: the row's log-sum-exp (kept for the backward);
  2. scores -> Compose (pre) -> probabilities exp(z - lse) -> Compose (post) -> mask -> @ v into the output.
- backward, three kernels (a row needs D = sum_s P dP before its dZ = P (dP - D) exists):
  `_bwd_row_stats` (per query block): D and the gradients of the post-softmax query-side factors;
  `_bwd_rows` (per query block): dq and the pre-softmax query-side factors;
  `_bwd_cols` (per key block, looping over the queries that see it): dk, dv and all key-side factors.
  Every program owns the rows it accumulates into: no atomics.

Layouts: q [B, N, T, Dh], k and v [B, N, S, Dh] (any strides, the last one 1); the factors time-last and
contiguous, query ones [B, G, 2, 2I+1, M, T] and key ones [B, G, 2, 2I+1, M, S] (slots pre and post; rows w1,
w2, dd: `DynamicWeightProjection`'s packing). Heads are padded to a power of two inside a program; padded heads
load zeros and are never stored.

Runs on CUDA, or on the CPU under Triton's interpreter (`TRITON_INTERPRET=1` when this module is imported): that
is how the tests check it. Triton is optional: without it this module imports, and `available()` says False.
"""

from __future__ import annotations

import torch

from ..dcmha_base import DCMHABackend, DCMHAInputs

MAX_RANK = 8  # dynamic_rank supported by the kernels

try:
    import triton
    import triton.language as tl
except ImportError:  # the other implementations do without Triton
    triton = tl = None

BLOCK_T = 16  # queries per program (tl.dot needs every dimension >= 16)
BLOCK_S = 16  # keys per step


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


if triton is not None:

    @triton.jit
    def _dot(a, b, PRECISION: tl.constexpr):
        """Batched matrix product with fp32 accumulation. PRECISION "upcast": operands in fp32 first (Triton's
        interpreter multiplies bf16 operands as their integer bit patterns, so they are converted there)."""
        if PRECISION == "upcast":
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        return tl.dot(a, b, input_precision=PRECISION)

    @triton.jit
    def _terms(ptr, base, row, offs_m, offs_x, M, X):
        """Row `row` (w1_i, w2_i or dd) of one slot's factors: [MP, BX] over heads offs_m and times offs_x."""
        mask = (offs_m[:, None] < M) & (offs_x[None, :] < X)
        return tl.load(ptr + base + row * M * X + offs_m[:, None] * X + offs_x[None, :], mask=mask, other=0.0)

    @triton.jit
    def _mix(a, ptr, base, offs_m, offs_x, M, X, I: tl.constexpr, AXIS: tl.constexpr, TRANSPOSE: tl.constexpr):
        """One side's terms of Compose on a [MP, BT, BS] block: a * dd + sum_i w2_i (sum_n a[n] w1_i[n]), the
        factors indexed by the query (AXIS=2: they broadcast over the keys) or by the key (AXIS=1). TRANSPOSE
        swaps w1 and w2: the vector-Jacobian product of the same terms."""
        out = a * tl.expand_dims(_terms(ptr, base, 2 * I, offs_m, offs_x, M, X), AXIS)
        for i in tl.static_range(I):
            w_in = tl.expand_dims(_terms(ptr, base, (I + i) if TRANSPOSE else i, offs_m, offs_x, M, X), AXIS)
            w_out = tl.expand_dims(_terms(ptr, base, i if TRANSPOSE else (I + i), offs_m, offs_x, M, X), AXIS)
            hidden = tl.sum(a * w_in, axis=0)  # [BT, BS]
            out += w_out * tl.expand_dims(hidden, 0)
        return out

    @triton.jit
    def _compose(a, qt_ptr, q_base, kt_ptr, k_base, offs_m, offs_t, offs_s, M, T, S,
                 I: tl.constexpr, HAS_KEY: tl.constexpr, TRANSPOSE: tl.constexpr):  # fmt: skip
        """Compose of a [MP, BT, BS] block with one slot's factors (TRANSPOSE: its vector-Jacobian product)."""
        out = a + _mix(a, qt_ptr, q_base, offs_m, offs_t, M, T, I, 2, TRANSPOSE)
        if HAS_KEY:
            out += _mix(a, kt_ptr, k_base, offs_m, offs_s, M, S, I, 1, TRANSPOSE)
        return out

    @triton.jit
    def _add_mix_grads(a, g, ptr, base, dptr, offs_m, offs_x, M, X, I: tl.constexpr, AXIS: tl.constexpr):
        """Adds to dptr the gradients of one side's factors given Compose's input block `a` and the gradient `g`
        of its output: d dd = sum a g; d w2_i[m] = sum g[m] (sum_n a[n] w1_i[n]); d w1_i[n] = sum a[n] (sum_m
        g[m] w2_i[m]); the sums over the keys (AXIS=2, query factors) or the queries (AXIS=1, key factors)."""
        mask = (offs_m[:, None] < M) & (offs_x[None, :] < X)
        off = offs_m[:, None] * X + offs_x[None, :]
        p = dptr + base + 2 * I * M * X + off
        tl.store(p, tl.load(p, mask=mask, other=0.0) + tl.sum(a * g, axis=AXIS), mask=mask)
        for i in tl.static_range(I):
            w1 = tl.expand_dims(_terms(ptr, base, i, offs_m, offs_x, M, X), AXIS)
            w2 = tl.expand_dims(_terms(ptr, base, I + i, offs_m, offs_x, M, X), AXIS)
            hidden = tl.expand_dims(tl.sum(a * w1, axis=0), 0)
            back = tl.expand_dims(tl.sum(g * w2, axis=0), 0)
            p = dptr + base + (I + i) * M * X + off
            tl.store(p, tl.load(p, mask=mask, other=0.0) + tl.sum(g * hidden, axis=AXIS), mask=mask)
            p = dptr + base + i * M * X + off
            tl.store(p, tl.load(p, mask=mask, other=0.0) + tl.sum(a * back, axis=AXIS), mask=mask)

    @triton.jit
    def _visible(offs_t, offs_s, T, S, pad_ptr, b, query_pos0, key_pos0, window,
                 HAS_PAD: tl.constexpr, HAS_WINDOW: tl.constexpr):  # fmt: skip
        """[1, BT, BS] bool: query t sees key s (causal, in the window, not padding, both in range)."""
        q_pos = query_pos0 + offs_t[:, None]
        k_pos = key_pos0 + offs_s[None, :]
        ok = (offs_t[:, None] < T) & (offs_s[None, :] < S) & (k_pos <= q_pos)
        if HAS_WINDOW:
            ok = ok & (k_pos > q_pos - window)
        if HAS_PAD:
            ok = ok & (tl.load(pad_ptr + b * S + offs_s, mask=offs_s < S, other=0) != 0)[None, :]
        return tl.expand_dims(ok, 0)

    @triton.jit
    def _rows(ptr, base, st_n, st_x, offs_m, offs_x, offs_d, M, X, DH, X_LAST: tl.constexpr = False):
        """A [MP, BX, DHP] block of q, k, v or an output gradient (zeros outside); with X_LAST, the same block
        laid out [MP, DHP, BX] (k or v as the right operand of a product)."""
        m3 = offs_m[:, None, None]
        if X_LAST:
            x3 = offs_x[None, None, :]
            d3 = offs_d[None, :, None]
        else:
            x3 = offs_x[None, :, None]
            d3 = offs_d[None, None, :]
        mask = (m3 < M) & (x3 < X) & (d3 < DH)
        return tl.load(ptr + base + m3 * st_n + x3 * st_x + d3, mask=mask, other=0.0)

    @triton.jit
    def _key_range(t_start, T, query_pos0, key_pos0, S, window, HAS_WINDOW: tl.constexpr, BT: tl.constexpr):
        """The keys [lo, hi) that the queries [t_start, t_start + BT) can see."""
        last = query_pos0 + tl.minimum(t_start + BT, T) - 1
        hi = tl.minimum(S, last - key_pos0 + 1)
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(0, query_pos0 + t_start - window + 1 - key_pos0)
        return lo, hi

    @triton.jit
    def _product(x_ptr, x_base, sx_n, sx_t, y_ptr, y_base, sy_n, sy_s, offs_m, offs_t, offs_s, M, T, S, DH,
                 MP: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, DHP: tl.constexpr, DK: tl.constexpr,
                 PRECISION: tl.constexpr):  # fmt: skip
        """[MP, BT, BS] = sum_d x[m, t, d] y[m, s, d] (q.k, or dout.v), DK head dimensions at a time: operands of
        [heads, 16, DK] instead of [heads, 16, Dh] keep a program within the GPU's shared memory."""
        acc = tl.zeros((MP, BT, BS), tl.float32)
        for d0 in range(0, DHP, DK):
            offs_d = d0 + tl.arange(0, DK)
            x = _rows(x_ptr, x_base, sx_n, sx_t, offs_m, offs_t, offs_d, M, T, DH)
            y = _rows(y_ptr, y_base, sy_n, sy_s, offs_m, offs_s, offs_d, M, S, DH, True)
            acc += _dot(x, y, PRECISION)
        return acc

    @triton.jit
    def _store_rows(ptr, base, st_n, st_t, value, offs_m, offs_t, offs_d, M, T, DH):
        m3 = offs_m[:, None, None]
        t3 = offs_t[None, :, None]
        d3 = offs_d[None, None, :]
        mask = (m3 < M) & (t3 < T) & (d3 < DH)
        tl.store(ptr + base + m3 * st_n + t3 * st_t + d3, value.to(ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _factor_bases(bg, M, T, S, I: tl.constexpr):
        """Offsets of one (batch, group)'s pre- and post-softmax factors in the query and key factor tensors."""
        q_pre = (bg * 2) * (2 * I + 1) * M * T
        k_pre = (bg * 2) * (2 * I + 1) * M * S
        return q_pre, q_pre + (2 * I + 1) * M * T, k_pre, k_pre + (2 * I + 1) * M * S

    @triton.jit
    def _scores(q_ptr, k_ptr, qt_ptr, kt_ptr, pad_ptr, b, q_base, k_base, sq_n, sq_t, sk_n, sk_s, q_pre, k_pre,
                offs_m, offs_t, offs_s, T, S, M, DH, query_pos0, key_pos0, window, scale,
                I: tl.constexpr, HAS_KEY: tl.constexpr, HAS_PAD: tl.constexpr, HAS_WINDOW: tl.constexpr,
                MP: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, DHP: tl.constexpr, DK: tl.constexpr,
                PRECISION: tl.constexpr):  # fmt: skip
        """A [MP, BT, BS] block before the softmax: the scores a, Compose(a) and which (query, key) pairs see
        each other."""
        a = _product(q_ptr, q_base, sq_n, sq_t, k_ptr, k_base, sk_n, sk_s, offs_m, offs_t, offs_s, M, T, S, DH,
                     MP, BT, BS, DHP, DK, PRECISION) * scale  # fmt: skip
        z = _compose(a, qt_ptr, q_pre, kt_ptr, k_pre, offs_m, offs_t, offs_s, M, T, S, I, HAS_KEY, False)
        ok = _visible(offs_t, offs_s, T, S, pad_ptr, b, query_pos0, key_pos0, window, HAS_PAD, HAS_WINDOW)
        return a, z, ok

    @triton.jit
    def _fwd(q_ptr, k_ptr, v_ptr, qt_ptr, kt_ptr, pad_ptr, out_ptr, lse_ptr,
             sq_b, sq_n, sq_t, sk_b, sk_n, sk_s, sv_b, sv_n, sv_s, so_b, so_t, so_n,
             T, S, G, M, DH, query_pos0, key_pos0, window, scale,
             I: tl.constexpr, HAS_KEY: tl.constexpr, HAS_PAD: tl.constexpr, HAS_WINDOW: tl.constexpr,
             MP: tl.constexpr, DHP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
             BT: tl.constexpr, BS: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
        """Grid (query blocks, B x G, DHP / DV): each program writes DV of the output's head dimensions (and
        recomputes the probabilities, which every part needs)."""
        t_start = tl.program_id(0) * BT
        bg = tl.program_id(1)
        part = tl.program_id(2)
        b = bg // G
        g = bg % G
        offs_m = tl.arange(0, MP)
        offs_t = t_start + tl.arange(0, BT)
        offs_v = part * DV + tl.arange(0, DV)
        q_base = b * sq_b + g * M * sq_n
        k_base = b * sk_b + g * M * sk_n
        q_pre, q_post, k_pre, k_post = _factor_bases(bg, M, T, S, I)
        lo, hi = _key_range(t_start, T, query_pos0, key_pos0, S, window, HAS_WINDOW, BT)
        row_max = tl.full((MP, BT), float("-inf"), tl.float32)
        row_sum = tl.zeros((MP, BT), tl.float32)
        for s_start in range(lo, hi, BS):
            offs_s = s_start + tl.arange(0, BS)
            a, z, ok = _scores(
                q_ptr, k_ptr, qt_ptr, kt_ptr, pad_ptr, b, q_base, k_base, sq_n, sq_t, sk_n, sk_s, q_pre, k_pre,
                offs_m, offs_t, offs_s, T, S, M, DH, query_pos0, key_pos0, window, scale,
                I, HAS_KEY, HAS_PAD, HAS_WINDOW, MP, BT, BS, DHP, DK, PRECISION,
            )  # fmt: skip
            z = tl.where(ok, z, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(z, axis=2))
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            row_sum = row_sum * tl.exp(row_max - shift) + tl.sum(tl.exp(z - tl.expand_dims(shift, 2)), axis=2)
            row_max = new_max
        # rows that see no key (padding) get probabilities 0: lse = +inf
        lse = tl.where(row_sum > 0, row_max + tl.log(tl.where(row_sum > 0, row_sum, 1.0)), float("inf"))
        if part == 0:
            lse_mask = (offs_m[:, None] < M) & (offs_t[None, :] < T)
            tl.store(lse_ptr + (bg * M + offs_m[:, None]) * T + offs_t[None, :], lse, mask=lse_mask)
        acc = tl.zeros((MP, BT, DV), tl.float32)
        for s_start in range(lo, hi, BS):
            offs_s = s_start + tl.arange(0, BS)
            a, z, ok = _scores(
                q_ptr, k_ptr, qt_ptr, kt_ptr, pad_ptr, b, q_base, k_base, sq_n, sq_t, sk_n, sk_s, q_pre, k_pre,
                offs_m, offs_t, offs_s, T, S, M, DH, query_pos0, key_pos0, window, scale,
                I, HAS_KEY, HAS_PAD, HAS_WINDOW, MP, BT, BS, DHP, DK, PRECISION,
            )  # fmt: skip
            p = tl.where(ok, tl.exp(z - tl.expand_dims(lse, 2)), 0.0)
            o = _compose(p, qt_ptr, q_post, kt_ptr, k_post, offs_m, offs_t, offs_s, M, T, S, I, HAS_KEY, False)
            o = tl.where(ok, o, 0.0)
            v = _rows(v_ptr, b * sv_b + g * M * sv_n, sv_n, sv_s, offs_m, offs_s, offs_v, M, S, DH)
            acc += _dot(o.to(v.dtype), v, PRECISION)
        _store_rows(out_ptr, b * so_b + g * M * so_n, so_n, so_t, acc, offs_m, offs_t, offs_v, M, T, DH)

    @triton.jit
    def _block(q_ptr, k_ptr, v_ptr, do_ptr, qt_ptr, kt_ptr, pad_ptr, lse, b, q_base, k_base, v_base, do_base,
               sq_n, sq_t, sk_n, sk_s, sv_n, sv_s, sd_n, sd_t, q_pre, q_post, k_pre, k_post, offs_m, offs_t, offs_s,
               T, S, M, DH, query_pos0, key_pos0, window, scale,
               I: tl.constexpr, HAS_KEY: tl.constexpr, HAS_PAD: tl.constexpr, HAS_WINDOW: tl.constexpr,
               MP: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, DHP: tl.constexpr, DK: tl.constexpr,
               PRECISION: tl.constexpr):  # fmt: skip
        """The forward of one [MP, BT, BS] block again, and the backward up to the probabilities: returns the
        scores a, the probabilities p, the gradient dO of the composed probabilities (masked), dP and the mask."""
        a, z, ok = _scores(
            q_ptr, k_ptr, qt_ptr, kt_ptr, pad_ptr, b, q_base, k_base, sq_n, sq_t, sk_n, sk_s, q_pre, k_pre,
            offs_m, offs_t, offs_s, T, S, M, DH, query_pos0, key_pos0, window, scale,
            I, HAS_KEY, HAS_PAD, HAS_WINDOW, MP, BT, BS, DHP, DK, PRECISION,
        )  # fmt: skip
        p = tl.where(ok, tl.exp(z - tl.expand_dims(lse, 2)), 0.0)
        d_o = _product(do_ptr, do_base, sd_n, sd_t, v_ptr, v_base, sv_n, sv_s, offs_m, offs_t, offs_s, M, T, S, DH,
                       MP, BT, BS, DHP, DK, PRECISION)  # fmt: skip
        d_o = tl.where(ok, d_o, 0.0)
        d_p = _compose(d_o, qt_ptr, q_post, kt_ptr, k_post, offs_m, offs_t, offs_s, M, T, S, I, HAS_KEY, True)
        return a, p, d_o, d_p, ok

    @triton.jit
    def _backward_program(G, M, sq_b, sq_n, sk_b, sk_n, sv_b, sv_n, sd_b, sd_n):
        """A backward program's (batch x group, part of the head dimension, batch) and the offsets of its group's
        first head in q, k, v and the output gradient (dout is [B, T, N, Dh], the forward output's layout)."""
        bg = tl.program_id(1)
        b = bg // G
        g = bg % G
        return (bg, tl.program_id(2), b, b * sq_b + g * M * sq_n, b * sk_b + g * M * sk_n, b * sv_b + g * M * sv_n,
                b * sd_b + g * M * sd_n)  # fmt: skip

    @triton.jit
    def _bwd_rows(q_ptr, k_ptr, v_ptr, qt_ptr, kt_ptr, pad_ptr, do_ptr, lse_ptr, delta_ptr, dqt_ptr, dq_ptr,
                  sq_b, sq_n, sq_t, sk_b, sk_n, sk_s, sv_b, sv_n, sv_s, sd_b, sd_t, sd_n,
                  T, S, G, M, DH, query_pos0, key_pos0, window, scale,
                  I: tl.constexpr, HAS_KEY: tl.constexpr, HAS_PAD: tl.constexpr, HAS_WINDOW: tl.constexpr,
                  MP: tl.constexpr, DHP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                  BT: tl.constexpr, BS: tl.constexpr, PRECISION: tl.constexpr, STATS: tl.constexpr):  # fmt: skip
        """Per query block, over the keys it sees. STATS (grid (query blocks, B x G, 1)): D = sum_s P dP per row
        (into delta_ptr) and the gradients of the post-softmax query factors. Otherwise (grid (query blocks,
        B x G, DHP / DV)), given D: DV of dq's head dimensions (into dq_ptr, [B, N, T, Dh] contiguous fp32) and,
        from the first part only, the gradients of the pre-softmax query factors."""
        t_start = tl.program_id(0) * BT
        bg, part, b, q_base, k_base, v_base, do_base = _backward_program(
            G, M, sq_b, sq_n, sk_b, sk_n, sv_b, sv_n, sd_b, sd_n
        )
        offs_m = tl.arange(0, MP)
        offs_t = t_start + tl.arange(0, BT)
        offs_v = part * DV + tl.arange(0, DV)
        q_pre, q_post, k_pre, k_post = _factor_bases(bg, M, T, S, I)
        row_mask = (offs_m[:, None] < M) & (offs_t[None, :] < T)
        row_off = (bg * M + offs_m[:, None]) * T + offs_t[None, :]
        lse = tl.load(lse_ptr + row_off, mask=row_mask, other=float("inf"))
        if STATS:
            delta = tl.zeros((MP, BT), tl.float32)
        else:
            delta = tl.load(delta_ptr + row_off, mask=row_mask, other=0.0)
        dq = tl.zeros((MP, BT, DV), tl.float32)
        lo, hi = _key_range(t_start, T, query_pos0, key_pos0, S, window, HAS_WINDOW, BT)
        for s_start in range(lo, hi, BS):
            offs_s = s_start + tl.arange(0, BS)
            a, p, d_o, d_p, ok = _block(
                q_ptr, k_ptr, v_ptr, do_ptr, qt_ptr, kt_ptr, pad_ptr, lse, b, q_base, k_base, v_base, do_base,
                sq_n, sq_t, sk_n, sk_s, sv_n, sv_s, sd_n, sd_t, q_pre, q_post, k_pre, k_post, offs_m, offs_t, offs_s,
                T, S, M, DH, query_pos0, key_pos0, window, scale, I, HAS_KEY, HAS_PAD, HAS_WINDOW,
                MP, BT, BS, DHP, DK, PRECISION,
            )  # fmt: skip
            if STATS:
                delta += tl.sum(p * d_p, axis=2)
                _add_mix_grads(p, d_o, qt_ptr, q_post, dqt_ptr, offs_m, offs_t, M, T, I, 2)
            else:
                d_z = p * (d_p - tl.expand_dims(delta, 2))
                if part == 0:
                    _add_mix_grads(a, d_z, qt_ptr, q_pre, dqt_ptr, offs_m, offs_t, M, T, I, 2)
                d_a = _compose(d_z, qt_ptr, q_pre, kt_ptr, k_pre, offs_m, offs_t, offs_s, M, T, S, I, HAS_KEY, True)
                k = _rows(k_ptr, k_base, sk_n, sk_s, offs_m, offs_s, offs_v, M, S, DH)
                dq += _dot(d_a.to(k.dtype), k, PRECISION) * scale
        if STATS:
            tl.store(delta_ptr + row_off, delta, mask=row_mask)
        else:
            _store_rows(dq_ptr, bg * M * T * DH, T * DH, DH, dq, offs_m, offs_t, offs_v, M, T, DH)

    @triton.jit
    def _bwd_cols(q_ptr, k_ptr, v_ptr, qt_ptr, kt_ptr, pad_ptr, do_ptr, lse_ptr, delta_ptr, dkt_ptr, dk_ptr, dv_ptr,
                  sq_b, sq_n, sq_t, sk_b, sk_n, sk_s, sv_b, sv_n, sv_s, sd_b, sd_t, sd_n,
                  T, S, G, M, DH, query_pos0, key_pos0, window, scale,
                  I: tl.constexpr, HAS_KEY: tl.constexpr, HAS_PAD: tl.constexpr, HAS_WINDOW: tl.constexpr,
                  MP: tl.constexpr, DHP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                  BT: tl.constexpr, BS: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
        """Grid (key blocks, B x G, DHP / DV), over the queries that see the block: DV of dk's and dv's head
        dimensions (into [B, N, S, Dh] contiguous fp32 buffers) and, from the first part only, the gradients of
        the key factors of both slots."""
        s_start = tl.program_id(0) * BS
        bg, part, b, q_base, k_base, v_base, do_base = _backward_program(
            G, M, sq_b, sq_n, sk_b, sk_n, sv_b, sv_n, sd_b, sd_n
        )
        offs_m = tl.arange(0, MP)
        offs_s = s_start + tl.arange(0, BS)
        offs_v = part * DV + tl.arange(0, DV)
        q_pre, q_post, k_pre, k_post = _factor_bases(bg, M, T, S, I)
        # the queries [lo, hi) that can see a key of this block
        lo = tl.maximum(0, key_pos0 + s_start - query_pos0)
        hi = T
        if HAS_WINDOW:
            hi = tl.minimum(T, key_pos0 + tl.minimum(s_start + BS, S) - 1 + window - query_pos0)
        dk = tl.zeros((MP, BS, DV), tl.float32)
        dv = tl.zeros((MP, BS, DV), tl.float32)
        for t_start in range(lo, hi, BT):
            offs_t = t_start + tl.arange(0, BT)
            row_mask = (offs_m[:, None] < M) & (offs_t[None, :] < T)
            row_off = (bg * M + offs_m[:, None]) * T + offs_t[None, :]
            lse = tl.load(lse_ptr + row_off, mask=row_mask, other=float("inf"))
            delta = tl.load(delta_ptr + row_off, mask=row_mask, other=0.0)
            a, p, d_o, d_p, ok = _block(
                q_ptr, k_ptr, v_ptr, do_ptr, qt_ptr, kt_ptr, pad_ptr, lse, b, q_base, k_base, v_base, do_base,
                sq_n, sq_t, sk_n, sk_s, sv_n, sv_s, sd_n, sd_t, q_pre, q_post, k_pre, k_post, offs_m, offs_t, offs_s,
                T, S, M, DH, query_pos0, key_pos0, window, scale, I, HAS_KEY, HAS_PAD, HAS_WINDOW,
                MP, BT, BS, DHP, DK, PRECISION,
            )  # fmt: skip
            # in the order that lets each [MP, BT, BS] block die soonest (fewer registers spilled)
            o = _compose(p, qt_ptr, q_post, kt_ptr, k_post, offs_m, offs_t, offs_s, M, T, S, I, HAS_KEY, False)
            o = tl.where(ok, o, 0.0)
            do = _rows(do_ptr, do_base, sd_n, sd_t, offs_m, offs_t, offs_v, M, T, DH)
            dv += _dot(tl.permute(o, (0, 2, 1)).to(do.dtype), do, PRECISION)
            if HAS_KEY:
                if part == 0:
                    _add_mix_grads(p, d_o, kt_ptr, k_post, dkt_ptr, offs_m, offs_s, M, S, I, 1)
            d_z = p * (d_p - tl.expand_dims(delta, 2))
            if HAS_KEY:
                if part == 0:
                    _add_mix_grads(a, d_z, kt_ptr, k_pre, dkt_ptr, offs_m, offs_s, M, S, I, 1)
            d_a = _compose(d_z, qt_ptr, q_pre, kt_ptr, k_pre, offs_m, offs_t, offs_s, M, T, S, I, HAS_KEY, True)
            q = _rows(q_ptr, q_base, sq_n, sq_t, offs_m, offs_t, offs_v, M, T, DH)
            dk += _dot(tl.permute(d_a, (0, 2, 1)).to(q.dtype), q, PRECISION) * scale
        base = bg * M * S * DH
        _store_rows(dk_ptr, base, S * DH, DH, dk, offs_m, offs_s, offs_v, M, S, DH)
        _store_rows(dv_ptr, base, S * DH, DH, dv, offs_m, offs_s, offs_v, M, S, DH)


def block_settings(heads: int, head_dim: int) -> dict:
    """How a program splits its work, from the padded heads of a group and head size: DK head dimensions at a time
    in the q.k and dout.v products, DV of the output's head dimensions per program (each part recomputes the
    probabilities), the warps, no software pipelining, the registers a thread may use. Chosen from what the real
    compiler reports for sm_90 without a GPU (`benchmarks/triton_resources.py`: shared memory, registers, spills),
    so that a program fits in a GPU's shared memory and spills little; their speed has not been measured on a
    GPU."""
    DK = min(head_dim, 32)
    DV = head_dim
    while heads * DV > 1024 and DV > 16:
        DV //= 2
    if heads * BLOCK_T * BLOCK_S < 4096:
        return dict(DK=DK, DV=DV, num_warps=4, num_stages=1)
    # maxnreg: left to itself, ptxas gave the 32-head kernels 32 registers a thread and spilled the rest
    return dict(DK=DK, DV=DV, num_warps=8, num_stages=1, maxnreg=255)


def _launch_args(q, k, v, qt, kt, pad, query_pos0, key_pos0, window, rank, groups):
    """What every kernel's arguments start with: the inputs (q, k, v, the factors and the padding; an absent one is
    replaced by a tensor the kernel never reads), then the strides, sizes and positions; and the constants."""
    B, N, T, Dh = q.shape
    S = k.shape[2]
    M = N // groups
    MP, DHP = max(2, triton.next_power_of_2(M)), max(16, triton.next_power_of_2(Dh))
    precision = "ieee"  # fp32 products without TF32, as in the other implementations
    if q.dtype != torch.float32 and interpreting():
        precision = "upcast"  # see `_dot`
    sizes = (T, S, groups, M, Dh, query_pos0, key_pos0, window or 0, Dh**-0.5)
    consts = dict(
        I=rank,
        HAS_KEY=kt is not None,
        HAS_PAD=pad is not None,
        HAS_WINDOW=window is not None,
        MP=MP,
        DHP=DHP,
        **block_settings(MP, DHP),
        BT=BLOCK_T,
        BS=BLOCK_S,
        PRECISION=precision,
    )
    strides = (*_strides3(q), *_strides3(k), *_strides3(v))
    inputs = (q, k, v, qt, qt if kt is None else kt, qt if pad is None else pad)
    return inputs, strides, sizes, consts


def _strides3(x: torch.Tensor) -> tuple[int, int, int]:
    """Strides of [B, N, L, Dh] along B, N and L (Dh must be contiguous)."""
    if x.stride(-1) != 1:
        raise ValueError(f"the Triton DCMHA kernels need the head dimension contiguous, got strides {x.stride()}")
    return x.stride(0), x.stride(1), x.stride(2)


def _launch(kernel, grid, *args, **kwargs):
    """kernel[grid](*args, **kwargs); a program too big for the GPU is a clear error instead of Triton's."""
    try:
        kernel[grid](*args, **kwargs)
    except triton.runtime.errors.OutOfResources as err:
        raise ValueError(
            f"the Triton DCMHA kernels do not fit this GPU for {kwargs['MP']} heads per group (padded) of "
            f"{kwargs['DHP']} dimensions in {args[0].dtype} ({err}); "
            'use dcmha_implementation="compiled" (or bf16, or more head groups)'
        ) from err


def _forward(q, k, v, qt, kt, pad, query_pos0, key_pos0, window, rank, groups):
    inputs, strides, sizes, consts = _launch_args(q, k, v, qt, kt, pad, query_pos0, key_pos0, window, rank, groups)
    B, N, T, Dh = q.shape
    out = q.new_empty(B, T, N, Dh)
    lse = torch.empty(B, N, T, device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(T, BLOCK_T), B * groups, consts["DHP"] // consts["DV"])
    _launch(_fwd, grid, *inputs, out, lse, *strides, out.stride(0), out.stride(1), out.stride(2), *sizes, **consts)
    return out, lse


def _backward(dout, q, k, v, qt, kt, pad, lse, query_pos0, key_pos0, window, rank, groups):
    inputs, strides, sizes, consts = _launch_args(q, k, v, qt, kt, pad, query_pos0, key_pos0, window, rank, groups)
    (B, _, T, _), S = q.shape, k.shape[2]
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    d_strides = (dout.stride(0), dout.stride(1), dout.stride(2))  # [B, T, N, Dh]
    delta = torch.empty_like(lse)
    dqt = torch.zeros_like(qt)
    dkt = torch.zeros_like(kt) if kt is not None else dqt
    dq = torch.empty(q.shape, device=q.device, dtype=torch.float32)
    dk = torch.empty(k.shape, device=q.device, dtype=torch.float32)
    dv = torch.empty(v.shape, device=q.device, dtype=torch.float32)
    parts = consts["DHP"] // consts["DV"]
    common = (*strides, *d_strides, *sizes)
    rows = (triton.cdiv(T, BLOCK_T), B * groups)
    row_args = (*inputs, dout, lse, delta, dqt, dq, *common)
    _launch(_bwd_rows, (*rows, 1), *row_args, **consts, STATS=True)
    _launch(_bwd_rows, (*rows, parts), *row_args, **consts, STATS=False)
    cols = (triton.cdiv(S, BLOCK_S), B * groups, parts)
    _launch(_bwd_cols, cols, *inputs, dout, lse, delta, dkt, dk, dv, *common, **consts)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dqt, (dkt if kt is not None else None)


class _DCMHAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, qt, kt, pad, query_pos0, key_pos0, window, rank, groups):
        out, lse = _forward(q, k, v, qt, kt, pad, query_pos0, key_pos0, window, rank, groups)
        ctx.save_for_backward(q, k, v, qt, kt, pad, lse)
        ctx.settings = (query_pos0, key_pos0, window, rank, groups)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, qt, kt, pad, lse = ctx.saved_tensors
        grads = _backward(dout, q, k, v, qt, kt, pad, lse, *ctx.settings)
        return (*grads, None, None, None, None, None, None)


def dcmha_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    qt: torch.Tensor,
    kt: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    query_start: int,
    key_start: int,
    window_size: int | None,
    rank: int,
    num_groups: int,
) -> torch.Tensor:
    """Causal (optionally windowed) DCMHA, differentiable. query [B, N, T, Dh], key/value [B, N, S, Dh]; the
    factors time-last and contiguous fp32 (`DCMHAInputs.time_last_terms`): qt
    [B, G, 2, 2I+1, M, T], kt [B, G, 2, 2I+1, M, S] or None; key_padding_mask [B, S] uint8 (1: a real token) or
    None; absolute token indices of the first query and key. Returns [B, T, N, Dh]."""
    problem = unsupported(query.device, rank)
    if problem is not None:
        raise ValueError(f"the Triton DCMHA kernels cannot run: {problem}")
    B, N, T, Dh = query.shape
    if qt.shape[:3] != (B, num_groups, 2) or qt.shape[-1] != T or qt.shape[-2] * num_groups != N:
        raise ValueError(f"query factors {tuple(qt.shape)} do not fit {N} heads in {num_groups} groups, {T} queries")
    if T == 0 or key.shape[2] == 0:
        return query.new_zeros(B, T, N, Dh)
    args = (query, key, value, qt, kt, key_padding_mask, query_start, key_start, window_size, rank, num_groups)
    return _DCMHAFunction.apply(*args)


# "auto" runs "triton" for calls of at least this many scores (batch x heads x queries x the keys each chunk sees):
# below that (a decoding step) eager ops cost as little as a launch.
AUTO_MIN_SCORES = 1 << 20
AUTO_MIN_CAPABILITY = (8, 0)  # CUDA GPUs from Ampere on: Triton multiplies bf16 only there (tested: Hopper)


class TritonBackend(DCMHABackend):
    """"triton": the whole call at once (no chunks, no [heads, queries, keys] tensor), forward and backward. "auto"
    takes it for large calls on CUDA GPUs of compute capability `AUTO_MIN_CAPABILITY` or newer
    (`device_capability`: torch.cuda's, or a stand-in)."""

    name = "triton"
    auto_rank = 20

    def __init__(self, auto_min_scores: int = AUTO_MIN_SCORES, device_capability=None):
        self.auto_min_scores = auto_min_scores
        self.device_capability = device_capability or torch.cuda.get_device_capability

    def why_not_auto(self, inputs: DCMHAInputs, output_attentions: bool = False) -> str | None:
        device = inputs.query.device
        if device.type != "cuda":
            return f"it is chosen on CUDA only, not on {device.type}"
        if inputs.num_scores < self.auto_min_scores:
            return f"fewer than {self.auto_min_scores} scores: eager ops cost as little as a launch"
        if tuple(self.device_capability(device)) < AUTO_MIN_CAPABILITY:
            return f"compute capability below {AUTO_MIN_CAPABILITY} (Triton multiplies bf16 only from Ampere on)"
        return self.why_not(inputs, output_attentions)

    def why_not(self, inputs: DCMHAInputs, output_attentions: bool = False) -> str | None:
        if self.failure is not None:
            return self.failure
        if not inputs.composed:
            return "no composition (use_dcmha=False)"
        if output_attentions:
            return "it does not return the attention probabilities (output_attentions=True)"
        return unsupported(inputs.query.device, inputs.rank)

    def __call__(self, inputs: DCMHAInputs, *, output_attentions: bool = False, recompute: bool = False):
        qt, kt = (None if t is None else t.float() for t in inputs.time_last_terms())
        pad = None if inputs.key_padding_mask is None else inputs.key_padding_mask.to(torch.uint8).contiguous()
        out = dcmha_triton(
            inputs.query, inputs.key, inputs.value, qt, kt, pad, inputs.query_start, inputs.key_start,
            inputs.window_size, inputs.rank, inputs.num_groups,
        )  # fmt: skip
        return out, None


TRITON = TritonBackend()
