#!/usr/bin/env python3
"""The CPU kernel's two chunk operators built from two or more C++ sources, timed in one process, interleaved.

Timing a kernel change by running a benchmark once per build does not work on a shared machine: the same unchanged
operator measured 2.8 to 5.3 ns a head-score from one process to the next (docs/performance.md), more than
most changes are worth. This script builds each source (`modeling_dcformer/kernels/csrc/dcmha_cpu.cpp` by default, or a
copy you edited) under its own operator namespace, loads all of them into one process, and times
`compose_softmax_compose_` (forward) and `compose_softmax_compose_backward_` (backward) of each on the same
random chunk, the variants' calls interleaved (A B C, then C B A, ...). Per chunk shape it prints each variant's
median time per head-score and the median of its per-round ratios to the first variant, and checks that every
variant's outputs match the first's (the largest difference relative to the largest value: a variant that computes
something else is not faster).

A source may carry extra compiler flags after colons: `my.cpp:-DBWD_ROWS=32`. Give the first source twice (once
with a trailing comment, so that it builds anew) to see this machine's noise between builds: ratios within a few
percent of 1.00 are noise. The chunk shape is batch x heads x queries x keys, one group, rank 2, causal, the chunk
at the end of the keys (as a training step's last chunk). The forward operator gets the scores laid out as the
model lays them out (`--layout staggered`, `dcmha_cpu.score_layout`) or contiguous (`--layout contiguous`, what
sources that compose on copies take); a variant's own `@layout` suffix overrides it (`old.cpp@contiguous`), and
`@staggeredN` lays the heads N floats apart modulo 4 KiB instead of `dcmha_cpu.HEAD_STAGGER`, for a source whose
block stride is N (`old.cpp@staggered136`: a source whose buffers' rows are 136 floats apart).

    python benchmarks/ab_kernel_source.py modeling_dcformer/kernels/csrc/dcmha_cpu.cpp /tmp/variant.cpp
    python benchmarks/ab_kernel_source.py a.cpp a.cpp:-DBWD_ROWS=32 --shapes 1x12x64x1024,16x8x64x128 --repeats 9
    python benchmarks/ab_kernel_source.py /tmp/old.cpp@contiguous modeling_dcformer/kernels/csrc/dcmha_cpu.cpp
    python benchmarks/ab_kernel_source.py /tmp/old.cpp@staggered136 modeling_dcformer/kernels/csrc/dcmha_cpu.cpp
"""

from __future__ import annotations

import argparse
import hashlib
import re
import statistics
import time
from pathlib import Path

import torch

from modeling_dcformer.kernels import build as kernel_build
from modeling_dcformer.kernels import dcmha_cpu

DEFAULT_SHAPES = "1x12x64x1024,16x8x64x128,16x4x64x128"
RANK = 2
LAYOUTS = ("staggered", "contiguous")  # of the forward operator's scores: the model's (score_layout), or contiguous


def is_layout(name: str) -> bool:
    """One of LAYOUTS, or `staggeredN`: the model's layout with the heads N floats apart modulo 4 KiB (0 < N < 1024)."""
    stagger = re.fullmatch(r"staggered(\d+)", name)
    return name in LAYOUTS or bool(stagger and 0 < int(stagger.group(1)) < 1024)


def split_layout(spec: str) -> tuple[str, str | None]:
    """A variant `path[:flags][@layout]` as (`path[:flags]`, the layout or None). Only a layout's name ends it: any
    other `@...` stays part of the path (a path with no such file is then `build`'s clear error)."""
    source, _, layout = spec.rpartition("@")
    return (source, layout) if source and is_layout(layout) else (spec, None)


def laid_out(raw: torch.Tensor, layout: str) -> torch.Tensor:
    """A copy of the chunk's scores [B, N, c, s] in `layout`."""
    if layout == "contiguous":
        return raw.clone()
    stagger = int(layout[len("staggered"):] or dcmha_cpu.HEAD_STAGGER)  # "staggered" or "staggeredN"
    size, strides = dcmha_cpu.score_layout(*raw.shape, stagger=stagger)
    scores = torch.empty(size).as_strided(raw.shape, strides)
    return scores.copy_(raw)


def parse_shapes(text: str) -> list[tuple[int, int, int, int]]:
    shapes = []
    for item in text.split(","):
        parts = item.strip().split("x")
        if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"a shape is BxNxCxS with positive integers, got {item!r}")
        B, N, c, s = map(int, parts)
        if c > s:
            raise argparse.ArgumentTypeError(f"a chunk has at most as many queries as keys, got {item!r}")
        shapes.append((B, N, c, s))
    return shapes


def renamed_source(text: str, namespace: str) -> str:
    """The kernel's source with its operators registered under `namespace` instead of `dcformer`."""
    renamed, count = re.subn(r"\bTORCH_LIBRARY(_IMPL|_FRAGMENT)?\(dcformer\b", rf"TORCH_LIBRARY\1({namespace}", text)
    if count == 0:
        raise ValueError("the source registers no operator in the dcformer namespace (TORCH_LIBRARY(dcformer, ...))")
    return renamed


def build(spec: str, source_root: Path):
    """Builds (or reuses) the variant `spec` ("path[:flag...]") and returns its operator namespace: its source,
    renamed, is written under `source_root`, and built like the kernel itself (`build.OperatorLibrary`: the
    kernel cache, a verified build reused by later runs, one build at a time)."""
    path, *flags = spec.split(":")
    source = Path(path)
    if not source.is_file():
        raise FileNotFoundError(f"no kernel source at {source}")
    text = source.read_text()
    namespace = "dcformer_ab_" + hashlib.sha256("\0".join([text, *flags]).encode()).hexdigest()[:12]
    copy = source_root / f"{namespace}.cpp"
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_text(renamed_source(text, namespace))
    dcmha_cpu.CPU.prepare()  # the kernel's own operators (and their fakes) first
    kernel_build.OperatorLibrary(copy, cflags=[*kernel_build.CFLAGS, *flags]).load()
    return getattr(torch.ops, namespace)


def chunk(shape, seed: int = 0):
    """A random chunk: raw products and their gradient [B, N, c, s], both slots' factors for the keys' span."""
    B, N, c, s = shape
    g = torch.Generator().manual_seed(seed)
    terms = (B, 1, 2, 2 * RANK + 1, N, s)
    return dict(
        raw=torch.randn(B, N, c, s, generator=g), grad=torch.randn(B, N, c, s, generator=g),
        query_terms=torch.randn(*terms, generator=g) * 0.3, key_terms=torch.randn(*terms, generator=g) * 0.3,
    )  # fmt: skip


def head_scores(shape) -> float:
    """Scores a causal chunk of c queries at the end of s keys computes a head."""
    B, N, c, s = shape
    return B * N * (c * (s - c) + c * (c + 1) / 2)


def run_forward(ops, x, c, s, layout="staggered"):
    scores = laid_out(x["raw"], layout)
    rows = dcmha_cpu.rows_per_tile(scores.shape[1], s)  # as the model's calls tile it
    start = time.process_time()
    ops.compose_softmax_compose_(scores, x["query_terms"], s - c, x["key_terms"], 0, None, s - c, 0, 0, 0.125, RANK,
                                 1, rows, False)  # fmt: skip
    return time.process_time() - start, (scores.contiguous(),)


def run_backward(ops, x, c, s, layout=None):  # the backward operator takes contiguous chunks
    raw, grad = x["raw"].clone(), x["grad"].clone()
    dqt, dkt = torch.zeros_like(x["query_terms"]), torch.zeros_like(x["key_terms"])
    start = time.process_time()
    ops.compose_softmax_compose_backward_(raw, grad, x["query_terms"], s - c, x["key_terms"], 0, None, s - c, 0, 0,
                                          0.125, RANK, 1, dqt, dkt, False)  # fmt: skip
    return time.process_time() - start, (raw, grad, dqt, dkt)


def compare(variants: list[tuple], shapes, repeats: int, layout: str = "staggered") -> list[dict]:
    """Times every variant's two operators on each shape, interleaved; returns one row per shape and variant.
    variants: (name, operators) or (name, operators, layout of the forward operator's scores; default `layout`)."""
    rows = []
    variants = [(v[0], v[1], v[2] if len(v) > 2 and v[2] else layout) for v in variants]
    for shape in shapes:
        B, N, c, s = shape
        x = chunk(shape)
        times = {name: {"forward": [], "backward": []} for name, _, _ in variants}
        outputs = {}
        for r in range(repeats):
            for name, ops, scores_layout in variants if r % 2 == 0 else variants[::-1]:
                for op, fn in (("backward", run_backward), ("forward", run_forward)):
                    seconds, out = fn(ops, x, c, s, scores_layout)
                    times[name][op].append(seconds)
                    outputs[name, op] = out
        first = variants[0][0]
        for name, _, _ in variants:
            row = {"shape": "x".join(map(str, shape)), "variant": name}
            for op in ("forward", "backward"):
                mine, base = times[name][op], times[first][op]
                row[f"{op}_ns"] = 1e9 * statistics.median(mine) / head_scores(shape)
                row[f"{op}_ratio"] = statistics.median(a / b for a, b in zip(mine, base))
                row[f"{op}_difference"] = max(
                    float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
                    for a, b in zip(outputs[name, op], outputs[first, op])
                )
            rows.append(row)
    return rows


def print_rows(rows: list[dict]) -> None:
    print("| shape | variant | forward ns/score | forward x first | backward ns/score | backward x first "
          "| max rel. diff |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        diff = max(row["forward_difference"], row["backward_difference"])
        print(f"| {row['shape']} | `{row['variant']}` | {row['forward_ns']:.2f} | {row['forward_ratio']:.3f} | "
              f"{row['backward_ns']:.2f} | {row['backward_ratio']:.3f} | {diff:.1e} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sources", nargs="*", default=[str(dcmha_cpu.SOURCE)],
                        help="kernel sources, each optionally followed by :compiler flags (the first is the baseline)")
    parser.add_argument("--shapes", type=parse_shapes, default=parse_shapes(DEFAULT_SHAPES),
                        help=f"chunks, BxNxCxS comma-separated (default {DEFAULT_SHAPES})")
    parser.add_argument("--repeats", type=int, default=9, help="interleaved rounds per shape (default 9)")
    parser.add_argument("--source-dir", type=Path, default=kernel_build.cache_dir() / "ab",
                        help="where the variants' renamed sources are written (default: the kernel cache's ab/); "
                        "they are built into the kernel cache like the kernel")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--layout", choices=LAYOUTS, default="staggered",
                        help="the forward operator's scores: laid out as the model's chunks (dcmha_cpu.score_layout) "
                        "or contiguous; a variant's @layout suffix overrides it (default staggered)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    specs = [split_layout(spec) for spec in args.sources]
    torch.set_num_threads(args.threads)
    variants = [(name, build(source, args.source_dir), layout)
                for name, (source, layout) in zip(args.sources, specs)]  # fmt: skip
    print_rows(compare(variants, args.shapes, args.repeats, args.layout))


if __name__ == "__main__":
    main()
