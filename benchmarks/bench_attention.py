#!/usr/bin/env python3
"""One attention layer: DCMHA (each `dcmha_implementation`) against plain attention through SDPA, same shape.

    python benchmarks/bench_attention.py                                  # CPU, Pythia-160M layer, T=1024
    python benchmarks/bench_attention.py --device cuda --dtype bf16 --seq-lens 1024,4096
    python benchmarks/bench_attention.py --quick                          # tiny, seconds

What is timed, per sequence length T (batch `--batch-size`, causal, every layer global unless `--window`):
    forward      `DCFormerAttention` (q/k/v projection, rotary, dynamic weights, DCMHA, output projection) in eval
                 mode, no grad; the baseline is the same module with `use_dcmha=False`, whose attention is
                 `F.scaled_dot_product_attention` (FlashAttention / memory-efficient kernels where the device has them)
    fwd+bwd      the same in training mode (chunks recomputed in the backward pass as the model does), loss = sum
Each implementation is warmed up (for "compiled": compiled) before timing; the median of `--repeats` runs is
printed with the ratio DCMHA / SDPA. The first call's time of "compiled" (the compilation) is printed apart.
"cpu" (the C++ kernel, `modeling_dcformer/kernels/dcmha_cpu.py`) times its forward and its backward operator.
"triton" (`modeling_dcformer/kernels/dcmha_triton.py`) needs CUDA (the default
on `--device cuda`) and Triton; it has no chunks, so `--chunk` does not apply to it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import modeling_dcformer.modeling_dcformer as mdl
from modeling_dcformer import DCFormerConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--hidden-size", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq-lens", default="1024", help="comma-separated T values")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--window", type=int, default=None, help="make the layer local with this window")
    p.add_argument("--chunk", type=int, default=DCFormerConfig.attention_chunk_size, help="attention_chunk_size (default: the config's)")
    p.add_argument("--implementations", default=None,
                   help="comma-separated (default: eager,compiled,cpu on CPU; eager,compiled,triton on CUDA)")
    p.add_argument("--phases", default="forward,fwd+bwd")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="CPU threads (1: stable ratios on a shared machine)")
    p.add_argument("--quick", action="store_true", help="hidden 64, 4 heads, T=64,128, 2 repeats")
    args = p.parse_args(argv)
    if args.quick:
        args.hidden_size, args.heads, args.seq_lens, args.repeats = 64, 4, "64,128", 2
    try:
        args.seq_lens = [int(t) for t in args.seq_lens.split(",") if t.strip()]
    except ValueError:
        p.error(f"--seq-lens must be comma-separated integers, got {args.seq_lens!r}")
    if not args.seq_lens or min(args.seq_lens) < 1:
        p.error("--seq-lens must list positive integers")
    if args.implementations is None:
        args.implementations = "eager,compiled," + ("triton" if args.device.startswith("cuda") else "cpu")
    args.implementations = [i.strip() for i in args.implementations.split(",") if i.strip()]
    for impl in args.implementations:
        if impl not in ("eager", "compiled", "cpu", "triton"):
            p.error(f"--implementations: unknown {impl!r} (eager, compiled, cpu, triton)")
    args.phases = [ph.strip() for ph in args.phases.split(",") if ph.strip()]
    for ph in args.phases:
        if ph not in ("forward", "fwd+bwd"):
            p.error(f"--phases: unknown {ph!r} (forward, fwd+bwd)")
    return args


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def make_layer(args, use_dcmha: bool, device, dtype):
    config = DCFormerConfig(
        hidden_size=args.hidden_size,
        num_attention_heads=args.heads,
        num_hidden_layers=1,
        intermediate_size=4 * args.hidden_size,
        max_position_embeddings=max(args.seq_lens),
        use_dcmha=use_dcmha,
        window_size=args.window,
        window_type="L" if args.window else None,
        attention_chunk_size=args.chunk,
    )
    torch.manual_seed(0)
    layer = mdl.DCFormerAttention(config, 0)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02)
    rotary = mdl.DCFormerRotaryEmbedding(config)
    return layer.to(device=device, dtype=dtype), rotary.to(device), config


def make_step(layer, rotary, phase, x):
    T = x.shape[1]
    pos = rotary(x, torch.arange(T, device=x.device)[None].expand(x.shape[0], T))

    def step():
        if phase == "forward":
            layer.eval()
            with torch.no_grad():
                layer(x, position_embeddings=pos)
        else:
            layer.train()
            xr = x.detach().requires_grad_(True)
            out, _ = layer(xr, position_embeddings=pos)
            out.float().sum().backward()
            layer.zero_grad(set_to_none=True)

    return step


def timed(step, device, repeats):
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} thread(s)"
    print(f"## One attention layer: DCMHA / SDPA (`python benchmarks/bench_attention.py {' '.join(sys.argv[1:] if argv is None else argv)}`)")
    print(f"- {name}, torch {torch.__version__}, {args.dtype}, hidden {args.hidden_size}, {args.heads} heads, "
          f"batch {args.batch_size}, chunk {args.chunk}, window {args.window}")
    print()
    print("| T | phase | SDPA (ms) | " + " | ".join(f"{i} (ms) | {i} / SDPA" for i in args.implementations) + " |")
    print("| ---: | --- | ---: | " + " | ".join("---: | ---:" for _ in args.implementations) + " |")
    base_layer, rotary, _ = make_layer(args, False, device, dtype)
    dc_layer, _, config = make_layer(args, True, device, dtype)
    compile_notes, diffs = [], []
    for T in args.seq_lens:
        x = torch.randn(args.batch_size, T, args.hidden_size, device=device, dtype=dtype)
        pos = rotary(x, torch.arange(T, device=device)[None].expand(args.batch_size, T))
        outputs = {}
        with torch.no_grad():
            for impl in args.implementations:
                config.dcmha_implementation = impl
                sync(device)
                t0 = time.perf_counter()
                outputs[impl] = dc_layer.eval()(x, position_embeddings=pos)[0].float()
                sync(device)
                if impl == "compiled":
                    compile_notes.append(f"T={T} forward: {time.perf_counter() - t0:.1f} s")
        first = args.implementations[0]
        for impl in args.implementations[1:]:
            diffs.append(f"T={T} {impl} vs {first}: {(outputs[impl] - outputs[first]).abs().max().item():.2e}")
        for phase in args.phases:
            base = make_step(base_layer, rotary, phase, x)
            base()
            t_base = timed(base, device, args.repeats)
            cells = []
            for impl in args.implementations:
                config.dcmha_implementation = impl
                step = make_step(dc_layer, rotary, phase, x)
                sync(device)
                t0 = time.perf_counter()
                step()
                sync(device)
                if impl == "compiled" and phase != "forward":
                    compile_notes.append(f"T={T} {phase}: {time.perf_counter() - t0:.1f} s")
                t = timed(step, device, args.repeats)
                cells.append(f"{t * 1e3:.1f} | {t / t_base:.2f}x")
            print(f"| {T} | {phase} | {t_base * 1e3:.1f} | " + " | ".join(cells) + " |", flush=True)
    if diffs:
        print()
        print("max |output difference| (forward): " + "; ".join(diffs))
    if compile_notes:
        print()
        print("compiled, first calls (compilation included): " + "; ".join(compile_notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
