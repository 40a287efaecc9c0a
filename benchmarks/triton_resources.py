#!/usr/bin/env python3
"""The resource gate of the "triton" DCMHA kernels: each compiled for a CUDA target on a machine without a GPU, with
Triton's own compiler and ptxas, and its registers and spills read from the cubin.

    python benchmarks/triton_resources.py                      # the shipped configurations, sm_90
    PYTHONPATH=.cache/triton-3.6.0 python benchmarks/triton_resources.py   # with the GPU image's Triton (make install)
    python benchmarks/triton_resources.py --tiles 8x32,2x64 --kernels fwd_probs --dtypes bf16 --flags all

Compiles `_fwd_stats`, `_fwd_probs`, `_bwd_stats` and `_bwd_grads` of `modeling_dcformer/kernels/dcmha_triton.py`
for each compute dtype and set of flags (key-wise terms, padding, a window: the shipped set, or `--flags all` for
every combination) at the package's tiles (or `--tiles`), and prints one line per kernel, configuration and shape,

    KERNEL SHAPE/DTYPE/FLAGS/TILE regs=N stack=N spills=N barriers=N shared=N

(registers per thread, stack bytes per thread, local loads and stores in the SASS, `BAR.SYNC`s, shared memory
bytes). The kernels take the number of heads and the head size at run time, so one compilation serves the
Pythia-160M shape (12 heads, head size 64) and DCPythia-6.9B's (32 heads, 128): each compilation is printed for both.
Exit code 2 when a kernel spills (any stack byte), 0 otherwise. It measures no speed: that needs a GPU
(`bench_attention.py --device cuda`). Each kernel takes a few seconds to compile.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import os
import re
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the real compiler, not the interpreter

KERNELS = ("fwd_stats", "fwd_probs", "bwd_stats", "bwd_grads")
SHAPES = ("pythia-160m", "dcpythia-6.9b")  # 12 and 32 heads a group: the same compiled kernels
SHIPPED_FLAGS = [(True, True, True), (True, False, False), (False, True, True)]  # (key terms, padding, window)


def parse_tile(text: str) -> tuple[int, int] | None:
    """'RxBS' (query rows x keys of a program's block: powers of two, keys from 16) as a pair, or None."""
    match = re.fullmatch(r"(\d+)x(\d+)", text.strip())
    if not match:
        return None
    rows, keys = int(match.group(1)), int(match.group(2))
    power = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    return (rows, keys) if power(rows) and power(keys) and keys >= 16 else None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90, help="compute capability (default 90: Hopper)")
    p.add_argument("--dtypes", default="bf16,fp32", help="compute dtypes, comma-separated (bf16, fp16, fp32)")
    p.add_argument("--rank", type=int, default=2)
    p.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated subset of " + ",".join(KERNELS))
    p.add_argument("--flags", default="shipped", choices=("shipped", "all"),
                   help="the sets of (key terms, padding, window) compiled: the shipped three, or all eight")
    p.add_argument("--tiles", default=None,
                   help="RxBS tiles (query rows x keys of a program's block) for every kernel, comma-separated "
                        "(default: the package's forward and backward tiles)")
    args = p.parse_args(argv)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in args.dtypes if d not in ("bf16", "fp16", "fp32")]
    if bad:
        p.error(f"--dtypes: unknown {', '.join(bad)} (bf16, fp16, fp32)")
    args.kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    bad = [k for k in args.kernels if k not in KERNELS]
    if bad:
        p.error(f"--kernels: unknown {', '.join(bad)} ({', '.join(KERNELS)})")
    texts = [t for t in (args.tiles or "").split(",") if t]
    bad = [t for t in texts if parse_tile(t) is None]
    if bad:
        p.error(f"--tiles: {', '.join(bad)} is not RxBS with powers of two (keys from 16)")
    args.tiles = [parse_tile(t) for t in texts] or None
    return args


def check_triton_folder() -> str | None:
    """Why the Triton that `import triton` would load must not be loaded (a folder another user owns or may write:
    its code would run here), or None. Checked before importing it."""
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return "Triton is not installed (pip install triton; make install puts 3.6.0 in .cache/triton-3.6.0)"
    for folder in (Path(spec.origin).parent, Path(spec.origin).parent.parent):
        info = folder.stat()
        if info.st_uid not in (os.getuid(), 0) or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"{folder} belongs to another user or others may write it: not loaded"
    return None


def compile_kernel(fn, consts: dict, dtype: str, arch: int):
    """`fn` compiled for sm_`arch` with the package's launch options (one warp, every register)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from modeling_dcformer.kernels import dcmha_triton

    def arg_type(arg: str) -> str:
        if arg in consts:
            return "constexpr"
        if arg.endswith("_ptr"):
            return f"*{dtype}" if arg in ("a_ptr", "d_ptr") else "*u8" if arg == "pad_ptr" else "*fp32"
        return "fp32" if arg == "scale" else "i32"

    source = ASTSource(fn, {arg: arg_type(arg) for arg in fn.arg_names}, constexprs=consts)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=dict(dcmha_triton.LAUNCH))


def resources(kernel) -> dict:
    """Registers and stack bytes per thread (`cuobjdump --dump-resource-usage`), local loads and stores and
    barriers in the SASS, shared memory (bytes)."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "--dump-sass", f.name], capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    return dict(regs=int(regs.group(1)), stack=int(stack.group(1)), spills=len(re.findall(r"\b(LDL|STL)\b", sass)),
                barriers=len(re.findall(r"\bBAR\.SYNC\b", sass)), shared=kernel.metadata.shared)  # fmt: skip


def main(argv=None) -> int:
    args = parse_args(argv)
    problem = check_triton_folder()
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    import triton

    from modeling_dcformer.kernels import dcmha_triton

    print(f"- triton {triton.__version__} ({Path(triton.__file__).parent}), sm_{args.arch}, rank {args.rank}")
    kernels = {name: getattr(dcmha_triton, f"_{name}") for name in args.kernels}
    flags = SHIPPED_FLAGS if args.flags == "shipped" else list(itertools.product((True, False), repeat=3))
    spilled = 0
    for name, fn in kernels.items():
        tiles = args.tiles or [dcmha_triton.FORWARD_TILE if name.startswith("fwd") else dcmha_triton.BACKWARD_TILE]
        for dtype, (key, pad, window), tile in itertools.product(args.dtypes, flags, tiles):
            consts = dict(I=args.rank, IP=max(2, triton.next_power_of_2(args.rank)), HAS_KEY=key, HAS_PAD=pad,
                          HAS_WINDOW=window, R=tile[0], BS=tile[1])  # fmt: skip
            if name in ("fwd_probs", "bwd_grads"):
                consts["NW"] = 32
            start = time.perf_counter()
            used = resources(compile_kernel(fn, consts, dtype, args.arch))
            spilled += used["stack"] > 0
            named = "+".join(n for n, on in zip(("key", "pad", "window"), (key, pad, window)) if on) or "plain"
            for shape in SHAPES:
                print(f"{name} {shape}/{dtype}/{named}/{tile[0]}x{tile[1]} regs={used['regs']} stack={used['stack']} "
                      f"spills={used['spills']} barriers={used['barriers']} shared={used['shared']}", flush=True)
            print(f"  ({name} compiled in {time.perf_counter() - start:.1f} s)", file=sys.stderr)
    if spilled:
        print(f"error: {spilled} kernel configuration(s) spill registers to local memory (stack > 0)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
