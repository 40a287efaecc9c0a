#!/usr/bin/env python3
"""One attention layer: DCMHA (each `dcmha_implementation`) against plain attention through SDPA, same shape, and for
"triton" the time `benchmarks/cost_model.py` predicts beside each measured time.

    python benchmarks/bench_attention.py                                  # CPU, Pythia-160M layer, T=1024
    python benchmarks/bench_attention.py --quick                          # tiny, seconds
    python benchmarks/bench_attention.py --device cuda --dtype bf16 --seq-lens 1024,4096
    python benchmarks/bench_attention.py --device cuda --dtype bf16 --scope attention --implementations triton \
        --shapes pythia-160m,dcpythia-6.9b,dcpythia-6.9b@w256 --chunks 128,256,512,T --json attention.json
    python benchmarks/bench_attention.py --device cuda --measure-ceilings --json ceilings.json
    python benchmarks/bench_attention.py --device cuda --dtype bf16 --scope attention --shapes dcpythia-6.9b \
        --implementations triton --profile --ceilings ceilings.json

What is timed, per shape and sequence length T (causal; every layer global unless a window):
    --scope layer      `DCFormerAttention` (q/k/v projection, rotary, dynamic weights, DCMHA, output projection);
                       the baseline is the same module with `use_dcmha=False`, whose attention is
                       `F.scaled_dot_product_attention` (FlashAttention / memory-efficient kernels where the device
                       has them)
    --scope attention  the attention call alone (`dcmha_attention` on random q, k, v [B, N, T, Dh] and composition
                       factors); the baseline is the same call without composition (SDPA: one causal call, or per
                       chunk with a mask on a local layer). This is what the cost model predicts.
    phases: forward (eval mode, no grad) and fwd+bwd (training mode, recomputing as the model does, loss = sum).
Shapes: `--hidden-size`, `--heads`, `--batch-size`, `--seq-lens` and `--window`, or `--shapes`: the cost model's
named shapes (`cost_model.SHAPES`: hidden size, heads, batch and tokens), each global or with a window ("@w256").

Each implementation is warmed up (for "compiled": compiled; for "triton": its kernels compiled) before timing; the
median of `--repeats` runs is printed with the ratio DCMHA / SDPA, one row per implementation, and on CUDA the peak
memory one run allocates above what was allocated before it. "cpu" (the C++ kernel) times its forward and backward
operators. "triton" (`modeling_dcformer/kernels/dcmha_triton.py`) needs CUDA (the default on `--device cuda`), or
the CPU under TRITON_INTERPRET=1 (tiny shapes only: the interpreter is slow). `--chunks 128,256,512,T` replaces
"triton" by one row per chunk size ("triton@c128", ..., "triton@cT": the whole call in one chunk); without it
"triton" sizes its chunks from its memory budget. `--implementations` also takes "triton@cN" (chunks of N queries)
and "triton@RxBS" (both kernels' tiles R rows x BS keys), alone or together. Every "triton" row has the cost
model's predicted time of its attention (its chunks and tiles; `--ceilings FILE`: the rates scaled by the ceilings
that `--measure-ceilings` measured) and measured / predicted (in the layer scope the measured time also holds the
projections, rotary and the dynamic weights).

`--measure-ceilings` only measures the machine's ceilings: device-to-device copy (bytes read + written a second)
and the GEMM rate in bf16 and fp32 (no TF32), printed beside the cost model's H200 rates (with `--json`: written).
`--profile` adds, per "triton" row, one profiled run split by kernel (torch.profiler's names): the matrix products
(cuBLAS), each Triton kernel and the rest, beside the cost model's prediction of each (on a CPU: ATen ops' self
time; the interpreted Triton kernels are no ops there). `--json OUT` writes every row (rewritten after each shape).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import cost_model  # benchmarks/ is on sys.path (this script's folder)
import modeling_dcformer.modeling_dcformer as mdl
from bench_train_step import parse_variant, triton_settings
from modeling_dcformer import DCFormerConfig
from modeling_dcformer.dcmha import DCMHAInputs, dcmha_attention
from modeling_dcformer.kernels import dcmha_triton

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
WHOLE_CALL = "T"  # --chunks: one chunk of the whole call
# The cost model's pieces of the attention by the part of a profile they fall in (the rest: "other")
PRODUCTS = "matrix products (cuBLAS)"
OTHER = "other kernels (copies, fills, sums)"
PREDICTED_PARTS = {"q.k": PRODUCTS, "p.v": PRODUCTS, "q.k again": PRODUCTS, "dO.v": PRODUCTS,
                   "dA.k, dAᵀ.q, P'ᵀ.dO": PRODUCTS}  # fmt: skip
TRITON_KERNEL = re.compile(r"_(fwd|bwd)_(stats|probs|grads)")
SDPA_KERNEL = re.compile(r"flash|fmha|sdpa|attention|cudnn|efficient", re.I)
PRODUCT_KERNEL = re.compile(r"gemm|nvjet|cutlass|xmma|cublas|wgmma|s1688|s16816|splitk|^aten::(mm|bmm|addmm|baddbmm)$",
                            re.I)  # fmt: skip


def parse_shapes(text: str) -> list[dict]:
    """`--shapes`: NAME[@wWINDOW],... of `cost_model.SHAPES`, each as (name, hidden, heads, batch, seq_lens,
    window)."""
    specs = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, _, window = item.partition("@")
        if name not in cost_model.SHAPES or (window and not re.fullmatch(r"w[1-9]\d*", window)):
            raise argparse.ArgumentTypeError(f"{item!r} is not NAME or NAME@wWINDOW with NAME one of "
                                             f"{sorted(cost_model.SHAPES)}")  # fmt: skip
        shape = cost_model.SHAPES[name]
        specs.append(dict(name=item, hidden=shape["hidden"], heads=shape["heads"], batch=shape["batch"],
                          seq_lens=[shape["tokens"]], window=int(window[1:]) if window else None))  # fmt: skip
    if not specs:
        raise argparse.ArgumentTypeError("no shape given")
    return specs


def parse_chunks(text: str) -> list[int | str]:
    """`--chunks`: positive query counts or T (the whole call), comma-separated."""
    chunks = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        if item == WHOLE_CALL:
            chunks.append(item)
        elif item.isdigit() and int(item) > 0:
            chunks.append(int(item))
        else:
            raise argparse.ArgumentTypeError(f"{item!r} is not a positive number of queries or {WHOLE_CALL}")
    if not chunks:
        raise argparse.ArgumentTypeError("no chunk size given")
    return chunks


def resolve(label: str, T: int) -> tuple[str, dict]:
    """(implementation, triton settings) of a row's label at sequence length T ("triton@cT": chunks of T)."""
    return parse_variant(label.replace(f"@c{WHOLE_CALL}", f"@c{T}"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--hidden-size", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq-lens", default="1024", help="comma-separated T values")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--window", type=int, default=None, help="make the layer local with this window")
    p.add_argument("--shapes", type=parse_shapes, default=None,
                   help="the cost model's shapes instead of the options above: NAME[@wWINDOW],... of "
                        f"{', '.join(sorted(cost_model.SHAPES))}")
    p.add_argument("--scope", choices=("layer", "attention"), default="layer",
                   help="time the attention module (layer) or the attention call alone (attention)")
    p.add_argument("--chunk", type=int, default=DCFormerConfig.attention_chunk_size,
                   help="attention_chunk_size of the chunked implementations other than triton (default: the "
                        "config's)")
    p.add_argument("--implementations", default=None,
                   help="comma-separated (default: eager,compiled,cpu on CPU; eager,compiled,triton on CUDA); "
                        "triton@cN: triton in chunks of N queries, triton@RxBS: with tiles of R rows x BS keys")
    p.add_argument("--chunks", type=parse_chunks, default=None,
                   help="triton's chunk sizes, one row each: queries, or T for the whole call (e.g. 128,256,512,T)")
    p.add_argument("--phases", default="forward,fwd+bwd")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="CPU threads (1: stable ratios on a shared machine)")
    p.add_argument("--quick", action="store_true", help="hidden 64, 4 heads, T=64,128, 2 repeats")
    p.add_argument("--ceilings", default=None,
                   help="a JSON file of --measure-ceilings: the cost model's rates scaled by it (a missing file: "
                        "the H200's rates, with a note)")
    p.add_argument("--measure-ceilings", action="store_true",
                   help="only measure the device's copy and GEMM rates (printed; written to --json)")
    p.add_argument("--profile", action="store_true",
                   help="split one run of each triton row by kernel, beside the cost model's prediction")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)
    if args.quick:
        args.hidden_size, args.heads, args.seq_lens, args.repeats = 64, 4, "64,128", 2
    try:
        args.seq_lens = [int(t) for t in args.seq_lens.split(",") if t.strip()]
    except ValueError:
        p.error(f"--seq-lens must be comma-separated integers, got {args.seq_lens!r}")
    if not args.seq_lens or min(args.seq_lens) < 1:
        p.error("--seq-lens must list positive integers")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.implementations is None:
        args.implementations = "eager,compiled," + ("triton" if args.device.startswith("cuda") else "cpu")
    args.implementations = [i.strip() for i in args.implementations.split(",") if i.strip()]
    for impl in args.implementations:
        variant = resolve(impl, 1)
        if variant is None or variant[0] not in ("eager", "compiled", "cpu", "triton"):
            p.error(f"--implementations: unknown {impl!r} (eager, compiled, cpu, triton, triton@cN, triton@RxBS)")
    if args.chunks is not None:
        if "triton" not in args.implementations:
            p.error("--chunks sets triton's chunk sizes: list triton in --implementations")
        at = args.implementations.index("triton")
        args.implementations[at:at + 1] = [f"triton@c{chunk}" for chunk in args.chunks]
    args.phases = [ph.strip() for ph in args.phases.split(",") if ph.strip()]
    for ph in args.phases:
        if ph not in ("forward", "fwd+bwd"):
            p.error(f"--phases: unknown {ph!r} (forward, fwd+bwd)")
    if args.shapes is None:
        name = f"{args.hidden_size}/{args.heads}" + (f"@w{args.window}" if args.window else "")
        args.shapes = [dict(name=name, hidden=args.hidden_size, heads=args.heads, batch=args.batch_size,
                            seq_lens=args.seq_lens, window=args.window)]  # fmt: skip
    return args


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------------------------
# The machine's ceilings and the cost model's predictions
# ---------------------------------------------------------------------------------------------------------------
def rate(op, device, repeats: int) -> float:
    """Seconds of one call of `op`: the best of three batches of `repeats` calls (after one call)."""
    op()
    best = float("inf")
    for _ in range(3):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(repeats):
            op()
        sync(device)
        best = min(best, (time.perf_counter() - t0) / repeats)
    return best


def measure_ceilings(device: torch.device, copy_bytes: int | None = None, gemm_n: int | None = None,
                     repeats: int = 10) -> dict:  # fmt: skip
    """The device's copy rate (bytes read + written a second, of a `copy_bytes` buffer) and its GEMM rates (FLOP/s of
    `gemm_n`-square products in bf16, and in fp32 without TF32)."""
    cuda = device.type == "cuda"
    copy_bytes = copy_bytes or (1 << 30 if cuda else 32 << 20)
    gemm_n = gemm_n or (8192 if cuda else 256)
    src = torch.ones(copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = rate(lambda: dst.copy_(src), device, repeats)
    del src, dst
    gemm = {}
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for name in ("bf16", "fp32"):
            a, b = (torch.randn(gemm_n, gemm_n, device=device).to(DTYPES[name]) for _ in range(2))
            gemm[name] = 2 * gemm_n**3 / rate(lambda: torch.matmul(a, b), device, repeats)  # noqa: B023
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    import transformers

    return dict(device=where(device), torch=torch.__version__, triton=getattr(dcmha_triton.triton, "__version__", None),
                transformers=transformers.__version__, copy_bytes=copy_bytes, copy_bytes_per_s=2 * copy_bytes / copy_s,
                gemm_n=gemm_n, gemm_flops_per_s=gemm)  # fmt: skip


def print_ceilings(ceilings: dict):
    h200 = cost_model.H200
    print(f"- {ceilings['device']}, torch {ceilings['torch']}, triton {ceilings['triton']}, transformers "
          f"{ceilings['transformers']}")
    print()
    print("| ceiling | measured | the cost model's H200 |")
    print("| --- | ---: | ---: |")
    print(f"| copy, device to device ({ceilings['copy_bytes'] >> 20} MiB, read + written) | "
          f"{ceilings['copy_bytes_per_s'] / 1e9:.0f} GB/s | {h200.hbm / 1e9:.0f} GB/s |")
    for name, flops in ceilings["gemm_flops_per_s"].items():
        label = f"{name} GEMM ({ceilings['gemm_n']}^3{', no TF32' if name == 'fp32' else ''})"
        print(f"| {label} | {flops / 1e12:.1f} TFLOP/s | {h200.gemm[name] / 1e12:.1f} TFLOP/s |")


def machine_from(path: str | None) -> tuple[cost_model.Machine, str]:
    """The cost model's machine: the H200's rates, or with `path` (a --measure-ceilings JSON) its copy rate, its
    GEMM rates and the fp32 GEMM rate as the CUDA-core rate (L2 and launch costs stay the model's estimates)."""
    base = cost_model.H200
    if path is None:
        return base, f"the cost model's {base.name} rates"
    try:
        with open(path) as f:
            ceilings = json.load(f)
    except (OSError, ValueError) as err:
        return base, f"the cost model's {base.name} rates ({path} unreadable: {err})"
    gemm = ceilings["gemm_flops_per_s"]
    machine = dataclasses.replace(base, name=f"{ceilings['device']} (measured)", hbm=ceilings["copy_bytes_per_s"],
                                  gemm={"bf16": gemm["bf16"], "fp16": gemm["bf16"], "fp32": gemm["fp32"]},
                                  cuda=gemm["fp32"])  # fmt: skip
    return machine, (f"the measured ceilings of {path}: copy {machine.hbm / 1e9:.0f} GB/s, bf16 GEMM "
                     f"{gemm['bf16'] / 1e12:.0f} TFLOP/s, fp32 {gemm['fp32'] / 1e12:.1f} TFLOP/s")


def predicted(spec: dict, config: DCFormerConfig, T: int, dtype: str, phase: str, settings: dict,
              machine: cost_model.Machine) -> dict[str, float]:  # fmt: skip
    """The cost model's seconds for this attention call by "triton" with `settings` (chunk, tile): by piece of work
    ("q.k", "_fwd_stats", ...) and in all ("total")."""
    shape = dict(hidden=spec["hidden"], heads=spec["heads"], mlp=4 * spec["hidden"], groups=config.num_head_groups,
                 rank=config.dynamic_rank, batch=spec["batch"], tokens=T)  # fmt: skip
    with triton_settings(tile=settings.get("tile")):
        works = cost_model.attention(shape, dtype, spec["window"], phase == "fwd+bwd", chunk=settings.get("chunk"))
    pieces: dict[str, float] = {}
    for work in works:
        pieces[work.name] = pieces.get(work.name, 0.0) + work.seconds(machine, dtype)
    pieces["total"] = sum(pieces.values())
    return pieces


# ---------------------------------------------------------------------------------------------------------------
# What is timed
# ---------------------------------------------------------------------------------------------------------------
def make_config(spec: dict, args, use_dcmha: bool) -> DCFormerConfig:
    return DCFormerConfig(
        hidden_size=spec["hidden"],
        num_attention_heads=spec["heads"],
        num_hidden_layers=1,
        intermediate_size=4 * spec["hidden"],
        max_position_embeddings=max(spec["seq_lens"]),
        use_dcmha=use_dcmha,
        window_size=spec["window"],
        window_type="L" if spec["window"] else None,
        attention_chunk_size=args.chunk,
    )


def make_layer(spec: dict, args, use_dcmha: bool, device, dtype):
    config = make_config(spec, args, use_dcmha)
    torch.manual_seed(0)
    layer = mdl.DCFormerAttention(config, 0)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02)
    rotary = mdl.DCFormerRotaryEmbedding(config)
    return layer.to(device=device, dtype=dtype), rotary.to(device)


class LayerScope:
    """Steps of the attention module (DCFormerAttention) and of its plain twin (use_dcmha=False, SDPA)."""

    def __init__(self, spec, args, device, dtype):
        self.spec, self.device, self.dtype = spec, device, dtype
        self.base, self.rotary = make_layer(spec, args, False, device, dtype)
        self.dc, _ = make_layer(spec, args, True, device, dtype)
        self.config = self.dc.config

    def prepare(self, T: int):
        B, D = self.spec["batch"], self.spec["hidden"]
        self.x = torch.randn(B, T, D, device=self.device, dtype=self.dtype)
        self.pos = self.rotary(self.x, torch.arange(T, device=self.device)[None].expand(B, T))

    def step(self, phase: str, implementation: str | None):
        """One run of the phase (implementation None: the plain twin); returns the output."""
        layer = self.base if implementation is None else self.dc
        x, pos = self.x, self.pos

        def run():
            if implementation is not None:
                layer.config.dcmha_implementation = implementation
            if phase == "forward":
                layer.eval()
                with torch.no_grad():
                    return layer(x, position_embeddings=pos)[0]
            layer.train()
            out, _ = layer(x.detach().requires_grad_(True), position_embeddings=pos)
            out.float().sum().backward()
            layer.zero_grad(set_to_none=True)
            return out

        return run


class AttentionScope:
    """Steps of the attention call alone: `dcmha_attention` on random q, k, v and composition factors, and the
    same call without composition (SDPA)."""

    def __init__(self, spec, args, device, dtype):
        self.spec, self.device, self.dtype = spec, device, dtype
        self.config = make_config(spec, args, True)

    def prepare(self, T: int):
        cfg, B, N = self.config, self.spec["batch"], self.spec["heads"]
        G, I, Dh = cfg.num_head_groups, cfg.dynamic_rank, self.spec["hidden"] // N
        gen = torch.Generator().manual_seed(T)

        def make(*shape, scale=1.0):
            return (torch.randn(*shape, generator=gen) * scale).to(self.device, self.dtype)

        q, k, v = (make(B, N, T, Dh) for _ in range(3))
        qt = make(B, T, G, 2, 2 * I + 1, N // G, scale=0.1)
        kt = None if cfg.query_wise else make(B, T, G, 2, 2 * I + 1, N // G, scale=0.1)
        self.tensors = (q, k, v, qt, kt)

    def step(self, phase: str, implementation: str | None):
        cfg, window = self.config, self.spec["window"]
        q, k, v, qt, kt = self.tensors
        composed = implementation is not None
        leaves = [t for t in (q, k, v, *((qt, kt) if composed else ())) if t is not None]

        def run():
            for t in leaves:
                t.requires_grad_(phase == "fwd+bwd")
                t.grad = None
            inputs = DCMHAInputs(query=q, key=k, value=v, query_terms=qt if composed else None,
                                 key_terms=kt if composed else None, query_start=0, key_start=0, key_padding_mask=None,
                                 window_size=window, rank=cfg.dynamic_rank, num_groups=cfg.num_head_groups,
                                 chunk_size=cfg.attention_chunk_size)  # fmt: skip
            if phase == "forward":
                with torch.no_grad():
                    return dcmha_attention(inputs, implementation or "eager")[0]
            out, _ = dcmha_attention(inputs, implementation or "eager", recompute=True)
            out.float().sum().backward()
            return out

        return run


def with_settings(run, settings: dict):
    """`run` with the triton settings (chunk, tile) applied around each call."""
    if not settings:
        return run

    def wrapped():
        with triton_settings(**settings):
            return run()

    return wrapped


def timed(step, device, repeats):
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def peak_mib(step, device) -> float | None:
    """The most CUDA memory one run of `step` allocated above what was allocated before it (None off CUDA)."""
    if device.type != "cuda":
        return None
    sync(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    sync(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def part_of(name: str) -> str:
    """Which part of a split a kernel (or on a CPU an ATen op) is: a Triton DCMHA kernel by its name, the SDPA
    kernels, the matrix products (cuBLAS), or the rest."""
    match = TRITON_KERNEL.match(name)
    if match:
        return match.group(0)
    if SDPA_KERNEL.search(name):
        return "SDPA kernels"
    if PRODUCT_KERNEL.search(name):
        return PRODUCTS
    return OTHER


def kernel_seconds(step, device) -> dict[str, float]:
    """Seconds of one run of `step` by kernel name (torch.profiler): the device's kernels on CUDA, the ATen ops' self
    CPU time on a CPU."""
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        step()
        sync(device)
    seconds: dict[str, float] = {}
    for event in prof.events():
        if cuda:
            if event.device_type != torch.autograd.DeviceType.CUDA or event.is_user_annotation:
                continue
            us = event.time_range.elapsed_us()
        else:
            if not event.name.startswith("aten::"):
                continue
            us = event.self_cpu_time_total
        seconds[event.name] = seconds.get(event.name, 0.0) + us / 1e6
    return seconds


def split(measured: dict[str, float], prediction: dict[str, float]) -> list[tuple[str, float, float | None]]:
    """(part, measured seconds, predicted seconds or None) per part of a profiled run, then the total."""
    parts: dict[str, list] = {}
    for name, seconds in measured.items():
        parts.setdefault(part_of(name), [0.0, None])[0] += seconds
    for name, seconds in prediction.items():
        if name == "total":
            continue
        part = parts.setdefault(PREDICTED_PARTS.get(name, name if TRITON_KERNEL.fullmatch(name) else OTHER),
                                [0.0, None])  # fmt: skip
        part[1] = (part[1] or 0.0) + seconds
    order = [PRODUCTS, *sorted(p for p in parts if TRITON_KERNEL.fullmatch(p)), "SDPA kernels", OTHER]
    rows = [(p, *parts[p]) for p in order if p in parts]
    return rows + [("total", sum(m for _, m, _ in rows), prediction.get("total"))]


def cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def where(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU, {torch.get_num_threads()} thread(s)"


def first_call(run, device) -> tuple[torch.Tensor, float]:
    """The output of one call of `run` and its seconds (the warm-up: compilation included)."""
    sync(device)
    t0 = time.perf_counter()
    result = run()
    sync(device)
    return result, time.perf_counter() - t0


def bench_row(scope, spec, T, phase, label, args, device, machine, out) -> dict:
    """One implementation's row of a phase (and with --profile, for "triton", its split)."""
    impl, settings = resolve(label, T)
    step = with_settings(scope.step(phase, impl), settings)
    _, seconds = first_call(step, device)
    if impl in ("compiled", "triton") and phase != "forward":
        out["first_calls"].append(f"{spec['name']} T={T} {label} {phase}: {seconds:.1f} s")
    row = dict(implementation=label, chunk=settings.get("chunk"), ms=timed(step, device, args.repeats) * 1e3,
               peak_mib=peak_mib(step, device))  # fmt: skip
    if impl != "triton":
        return row
    pred = predicted(spec, scope.config, T, args.dtype, phase, settings, machine)
    h200 = predicted(spec, scope.config, T, args.dtype, phase, settings, cost_model.H200)
    row.update(predicted_ms=pred["total"] * 1e3, predicted_h200_ms=h200["total"] * 1e3,
               measured_over_predicted=row["ms"] / (pred["total"] * 1e3))  # fmt: skip
    if args.profile:
        for part, measured, want in split(kernel_seconds(step, device), pred):
            out["split"].append(dict(shape=spec["name"], batch=spec["batch"], T=T, window=spec["window"], phase=phase,
                                     implementation=label, part=part, measured_ms=measured * 1e3,
                                     predicted_ms=None if want is None else want * 1e3))  # fmt: skip
    return row


def bench_shape(spec, args, device, dtype, machine, out: dict):
    """Every row of one shape: printed, and added to `out` (rows, split, differences, first calls)."""
    scope = (LayerScope if args.scope == "layer" else AttentionScope)(spec, args, device, dtype)
    window = spec["window"] or "-"
    for T in spec["seq_lens"]:
        scope.prepare(T)
        outputs = {}
        for label in args.implementations:
            impl, settings = resolve(label, T)
            outputs[label], seconds = first_call(with_settings(scope.step("forward", impl), settings), device)
            if impl in ("compiled", "triton"):
                out["first_calls"].append(f"{spec['name']} T={T} {label} forward: {seconds:.1f} s")
        first = args.implementations[0]
        for label in args.implementations[1:]:
            diff = (outputs[label].float() - outputs[first].float()).abs().max().item()
            out["differences"].append(f"{spec['name']} T={T} {label} vs {first}: {diff:.2e}")
        del outputs
        for phase in args.phases:
            base = scope.step(phase, None)
            base()
            t_base = timed(base, device, args.repeats)
            rows = [dict(implementation="SDPA", chunk=None, ms=t_base * 1e3, peak_mib=peak_mib(base, device))]
            for label in args.implementations:
                rows.append(bench_row(scope, spec, T, phase, label, args, device, machine, out))
            for row in rows:
                row.update(shape=spec["name"], batch=spec["batch"], T=T, heads=spec["heads"],
                           head_dim=spec["hidden"] // spec["heads"], window=spec["window"], phase=phase,
                           ratio_to_sdpa=row["ms"] / (t_base * 1e3))  # fmt: skip
                over = row.get("measured_over_predicted")
                print(f"| {spec['name']} | {spec['batch']} x {T} | {window} | {phase} | {row['implementation']} | "
                      f"{row['ms']:.3f} | {row['ratio_to_sdpa']:.2f}x | {cell(row.get('predicted_ms'), '.3f')} | "
                      f"{cell(over, '.2f')}{'x' if over is not None else ''} | {cell(row['peak_mib'], '.0f')} |",
                      flush=True)  # fmt: skip
                out["rows"].append(row)


def main(argv=None) -> int:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    command = " ".join(sys.argv[1:] if argv is None else argv)
    if args.measure_ceilings:
        print(f"## The machine's ceilings (`python benchmarks/bench_attention.py {command}`)")
        ceilings = measure_ceilings(device)
        print_ceilings(ceilings)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(ceilings, f, indent=2)
        return 0
    machine, rates = machine_from(args.ceilings)
    what = "the attention call" if args.scope == "attention" else "the attention module (projections included)"
    print(f"## One attention layer: DCMHA / SDPA (`python benchmarks/bench_attention.py {command}`)")
    print(f"- {where(device)}, torch {torch.__version__}, {args.dtype}, {what}, median of {args.repeats}, "
          f"chunk {args.chunk} (the chunked implementations other than triton)")
    print(f"- predicted: benchmarks/cost_model.py's DCMHA attention at {rates}")
    print()
    print("| shape | batch x T | window | phase | implementation | ms | / SDPA | predicted ms | measured / predicted "
          "| peak MiB |")
    print("| --- | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    out = dict(device=where(device), torch=torch.__version__, dtype=args.dtype, scope=args.scope,
               repeats=args.repeats, machine=dataclasses.asdict(machine), rows=[], split=[], differences=[],
               first_calls=[])  # fmt: skip
    for spec in args.shapes:
        bench_shape(spec, args, device, dtype, machine, out)
        if args.json:  # after every shape: a run cut short by a time limit keeps the shapes it finished
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)
    if out["split"]:
        print()
        print("Kernel time of one profiled run by part (torch.profiler" +
              ("" if device.type == "cuda" else ": ATen ops' self CPU time") + "):")
        print()
        print("| shape | batch x T | phase | implementation | part | measured ms | predicted ms "
              "| measured / predicted |")
        print("| --- | ---: | --- | --- | --- | ---: | ---: | ---: |")
        for r in out["split"]:
            ratio = None if not r["predicted_ms"] else r["measured_ms"] / r["predicted_ms"]
            print(f"| {r['shape']} | {r['batch']} x {r['T']} | {r['phase']} | {r['implementation']} | {r['part']} | "
                  f"{r['measured_ms']:.3f} | {cell(r['predicted_ms'], '.3f')} | {cell(ratio, '.2f')} |")
    if out["differences"]:
        print()
        print("max |output difference| (forward): " + "; ".join(out["differences"]))
    if out["first_calls"]:
        print()
        print("first calls (compilation included): " + "; ".join(out["first_calls"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
