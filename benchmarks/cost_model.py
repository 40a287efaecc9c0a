#!/usr/bin/env python3
"""A bytes-and-FLOPs model of one decoder layer on a GPU: GPT-NeoX (flash attention) against DCFormer with the
"triton" DCMHA backend, forward and forward + backward, so that a GPU run shows what it achieves against what the
design predicts.

    python benchmarks/cost_model.py                       # the Pythia-160M and DCPythia-6.9B shapes on an H200, bf16
    python benchmarks/cost_model.py --shape dcpythia-6.9b --window 256 --details

Each piece of work is its bytes from memory, its bytes from the L2 cache and its FLOPs (tensor-core or CUDA-core),
timed as the slowest of the three at the machine's rates, plus a launch cost for each kernel. The DCMHA attention
follows the backend's own plan (`modeling_dcformer/kernels/dcmha_triton.py`): its chunks (`chunk_queries`, the
memory budget), its tiles, and per chunk the products (cuBLAS), the kernels' reads and writes of the score buffers,
the factors each program loads from L2 (a block's key factors per head: the rows of a block share them), the
partials, the zeros written outside the causal band, and the elementwise FLOPs of each kernel's loops. The rest of
the layer (projections, MLP, norms, rotary, the dynamic-weight projection) is the same model for both.

Rates (`H200`): copy 4.3 TB/s and bf16 GEMM 790 TFLOP/s (measured on an H200); fp32 on CUDA cores 67 TFLOP/s
(measured); L2 7 TB/s, flash attention at half the GEMM rate and 4 µs a launch (estimates).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from modeling_dcformer.kernels import dcmha_triton


@dataclasses.dataclass
class Machine:
    name: str = "H200"
    hbm: float = 4.3e12  # bytes/s, read + written (measured copy)
    l2: float = 7e12  # bytes/s (estimate)
    gemm: dict = dataclasses.field(default_factory=lambda: {"bf16": 790e12, "fp16": 790e12, "fp32": 67e12})
    cuda: float = 67e12  # fp32 FLOP/s on CUDA cores (measured)
    flash_efficiency: float = 0.5  # flash attention's share of the GEMM rate (estimate)
    launch: float = 4e-6  # seconds a kernel launch (estimate)


H200 = Machine()
SHAPES = {  # hidden, heads, MLP width, head groups, composition rank, a batch x tokens the benchmarks use
    "pythia-160m": dict(hidden=768, heads=12, mlp=3072, groups=1, rank=2, batch=8, tokens=1024),
    "dcpythia-6.9b": dict(hidden=4096, heads=32, mlp=16384, groups=1, rank=2, batch=1, tokens=2048),
}
BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclasses.dataclass
class Work:
    """One piece of work: bytes from memory, bytes from L2, tensor-core and CUDA-core FLOPs, kernel launches."""

    name: str
    hbm: float = 0.0
    l2: float = 0.0
    gemm_flops: float = 0.0
    cuda_flops: float = 0.0
    launches: int = 1

    def seconds(self, machine: Machine, dtype: str) -> float:
        return max(self.hbm / machine.hbm, self.l2 / machine.l2, self.gemm_flops / machine.gemm[dtype],
                   self.cuda_flops / machine.cuda) + self.launches * machine.launch  # fmt: skip


def spans(tokens: int, window: int | None, chunk: int) -> list[tuple[int, int, int, int]]:
    """The backend's chunks of a prefill of `tokens` (`DCMHAInputs.chunk_spans` with its chunk size)."""
    out = []
    for t0 in range(0, tokens, chunk):
        t1 = min(tokens, t0 + chunk)
        s0 = 0 if window is None else max(0, t0 - window + 1)
        out.append((t0, t1, s0, t1))
    return out


def visited(t0: int, t1: int, s0: int, window: int | None, tile: tuple[int, int]) -> int:
    """(query, key) pairs of the key blocks the programs of a chunk visit (per head and batch row)."""
    rows, keys = tile
    total = 0
    for r0 in range(0, t1 - t0, rows):
        first, last = t0 + r0, min(t1, t0 + r0 + rows) - 1
        lo = 0 if window is None else max(0, first - window + 1 - s0)
        hi = last - s0 + 1
        blocks = -(-hi // keys) - lo // keys
        total += blocks * keys * (min(t1 - t0, r0 + rows) - r0)
    return total


def attention(shape: dict, dtype: str, window: int | None, backward: bool, chunk: int | None = None) -> list[Work]:
    """The DCMHA attention of one layer by the "triton" backend, forward (and backward) per chunk: chunks of `chunk`
    queries, or (None) the backend's own for its memory budget."""
    B, N, T = shape["batch"], shape["heads"], shape["tokens"]
    Dh, I, e = shape["hidden"] // N, shape["rank"], BYTES[dtype]
    keys = T if window is None else min(T, window + T)
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    chunk = chunk or dcmha_triton.chunk_queries(B, N, T, keys, torch_dtype, I, dcmha_triton.MEMORY_BUDGET)
    Rf, BSf = dcmha_triton.FORWARD_TILE
    Rb, BSb = dcmha_triton.BACKWARD_TILE
    terms = 2 * I + 1  # the rows of one slot's factors
    work = []
    for t0, t1, s0, s1 in spans(T, window, chunk):
        c, s = t1 - t0, s1 - s0
        rect, operands = B * N * c * s, B * N * (c + s) * Dh * e
        product = dict(gemm_flops=2 * rect * Dh, hbm=e * rect + operands)
        fwd = B * N * visited(t0, t1, s0, window, dcmha_triton.FORWARD_TILE)
        work += [
            Work("q.k", **product),
            Work("_fwd_stats", hbm=e * fwd + 8 * fwd / BSf, l2=4 * terms * fwd / Rf, cuda_flops=(8 * I + 9) * fwd),
            Work("_fwd_probs", hbm=e * fwd + e * rect, l2=4 * (5 * I + 3) * fwd / Rf, cuda_flops=(20 * I + 16) * fwd),
            Work("p.v", **product),
        ]
        if not backward:
            continue
        bwd = B * N * visited(t0, t1, s0, window, dcmha_triton.BACKWARD_TILE)
        key_parts = 4 * 2 * terms * rect / Rb  # both slots' key-factor partials, per row block
        query_parts = 4 * 2 * terms * bwd / BSb
        work += [
            Work("q.k again", **product),
            Work("dO.v", **product),
            Work("_bwd_stats", hbm=2 * e * bwd + (query_parts + key_parts * bwd / rect) / 2 + 4 * bwd / BSb,
                 l2=4 * (5 * I + 3) * bwd / Rb, cuda_flops=(30 * I + 19) * bwd),  # fmt: skip
            Work("_bwd_grads", hbm=2 * e * bwd + 2 * e * rect + query_parts / 2 + key_parts / 2,
                 l2=4 * (12 * I + 8) * bwd / Rb + query_parts, cuda_flops=(70 * I + 18) * bwd),  # fmt: skip
            Work("key partials summed", hbm=key_parts),
            Work("dA.k, dAᵀ.q, P'ᵀ.dO", gemm_flops=3 * product["gemm_flops"], hbm=3 * product["hbm"], launches=3),
        ]
    return work


def dense(shape: dict, dtype: str, backward: bool, dcmha: bool) -> list[Work]:
    """The rest of the layer: the q/k/v and output projections, the MLP, norms, rotary and residuals (and with
    `dcmha`, the dynamic-weight projection); the backward pass doubles the products and the elementwise traffic."""
    B, T, D, F, N = shape["batch"], shape["tokens"], shape["hidden"], shape["mlp"], shape["heads"]
    G, I, e = shape["groups"], shape["rank"], BYTES[dtype]
    rows = B * T
    factor = 3 if backward else 1  # a product's backward is two products of its size
    work = [
        Work("projections and MLP", gemm_flops=factor * 2 * rows * D * (4 * D + 2 * F),
             hbm=factor * e * (4 * D * D + 2 * D * F), launches=4 * factor),  # fmt: skip
        Work("norms, rotary, activation, residuals", hbm=factor * e * rows * (12 * D + 2 * F), launches=8 * factor),
    ]
    if dcmha:
        M, C = N // G, 4
        K = 4 * M
        work.append(Work("dynamic-weight projection", gemm_flops=factor * 2 * rows * (D * G * C * (K + M) +
                                                                                    G * C * K * 2 * I * M),
                         hbm=factor * 4 * rows * G * C * (K + (2 * I + 1) * M), launches=8 * factor))  # fmt: skip
    return work


def flash(shape: dict, dtype: str, window: int | None, backward: bool, machine: Machine) -> Work:
    """GPT-NeoX's attention (SDPA's flash kernels): its FLOPs at `flash_efficiency` of the GEMM rate."""
    B, N, T = shape["batch"], shape["heads"], shape["tokens"]
    Dh = shape["hidden"] // N
    pairs = T * (T + 1) / 2 if window is None else T * min(T, window)
    flops = 4 * B * N * pairs * Dh * (3.5 if backward else 1)  # the backward pass recomputes and has three products
    return Work("flash attention", gemm_flops=flops / machine.flash_efficiency, launches=2 if backward else 1)


def layer(shape_name: str, dtype: str = "bf16", window: int | None = None, backward: bool = False,
          machine: Machine = H200, **overrides) -> dict:  # fmt: skip
    """The predicted seconds of one layer, GPT-NeoX and DCFormer, and DCFormer's attention work piece by piece."""
    shape = {**SHAPES[shape_name], **overrides}
    neox = dense(shape, dtype, backward, False) + [flash(shape, dtype, window, backward, machine)]
    dc_attention = attention(shape, dtype, window, backward)
    dc = dense(shape, dtype, backward, True) + dc_attention
    seconds = lambda works: sum(w.seconds(machine, dtype) for w in works)  # noqa: E731
    by_kernel: dict[str, float] = {}
    for w in dc_attention:
        by_kernel[w.name] = by_kernel.get(w.name, 0.0) + w.seconds(machine, dtype)
    return dict(shape=shape_name, dtype=dtype, window=window, phase="fwd+bwd" if backward else "forward",
                batch=shape["batch"], tokens=shape["tokens"], neox_s=seconds(neox), dc_s=seconds(dc),
                dc_attention_s=seconds(dc_attention), ratio=seconds(dc) / seconds(neox), kernels=by_kernel)  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), action="append", help="default: both")
    p.add_argument("--dtype", default="bf16", choices=sorted(BYTES))
    p.add_argument("--window", type=int, default=None, help="a local layer's window (default: a global layer)")
    p.add_argument("--details", action="store_true", help="also each piece of DCFormer's attention")
    p.add_argument("--json", default=None, help="also write the predictions to this JSON file")
    args = p.parse_args(argv)
    rows = [layer(name, args.dtype, args.window, backward) for name in args.shape or sorted(SHAPES)
            for backward in (False, True)]  # fmt: skip
    print(f"- predicted on an {H200.name} ({args.dtype}, {'window ' + str(args.window) if args.window else 'global'}"
          f" layers; `python benchmarks/cost_model.py`)")
    print("| shape | batch x tokens | phase | GPT-NeoX layer (ms) | DCFormer layer (ms) | of it DCMHA (ms) | DC / NeoX |")
    print("|---|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['shape']} | {r['batch']} x {r['tokens']} | {r['phase']} | {r['neox_s'] * 1e3:.3f} | "
              f"{r['dc_s'] * 1e3:.3f} | {r['dc_attention_s'] * 1e3:.3f} | {r['ratio']:.2f}x |")
        if args.details:
            for name, seconds in r["kernels"].items():
                print(f"|  | | {name} | | {seconds * 1e3:.3f} | | |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
