#!/usr/bin/env python3
"""What each Triton DCMHA kernel needs of a GPU, compiled for a CUDA target on a machine without one.

    python benchmarks/triton_resources.py                                 # Pythia-160M and 6.9B heads, bf16, sm_90
    python benchmarks/triton_resources.py --heads 32 --head-dim 80 --dtype fp32 --arch 80
    python benchmarks/triton_resources.py --heads 12 --head-dim 64 --tiles 16x16,32x16,16x32  # other tiles

Compiles `_fwd`, `_bwd_rows` (both passes) and `_bwd_cols` of `modeling_dcformer/kernels/dcmha_triton.py` with Triton's
own compiler and ptxas (they ship with the `triton` wheel; no driver is needed) for each shape, with the block
settings the package uses (`block_settings`), and prints the shared memory of one program against the GPU's
limit, and from the cubin (the bundled `cuobjdump`) the registers per thread and the stack bytes per thread
(spilled registers: 0 is the goal, since spills go through local memory). It measures no speed: that needs a GPU
(`bench_attention.py --device cuda`). Each kernel takes 5-60 s to compile.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

os.environ.pop("TRITON_INTERPRET", None)  # the real compiler, not the interpreter

from modeling_dcformer.kernels import dcmha_triton  # noqa: E402

from bench_train_step import parse_tile, triton_tile  # noqa: E402  (benchmarks/ is on sys.path, as for profile_shapes)

# usable shared memory per block (KiB) by compute capability
SHARED_LIMIT_KIB = {80: 163, 86: 99, 89: 99, 90: 227}
KERNELS = ("fwd", "bwd_stats", "bwd_rows", "bwd_cols")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", default="12,32", help="heads per group, comma-separated (default 12,32)")
    p.add_argument("--head-dim", default="64,128", help="head size for each --heads entry (default 64,128)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--rank", type=int, default=2)
    p.add_argument("--arch", type=int, default=90, choices=sorted(SHARED_LIMIT_KIB), help="compute capability")
    p.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated subset of " + ",".join(KERNELS))
    p.add_argument("--warps", type=int, default=None, help="override the package's num_warps")
    p.add_argument("--tiles", default=None,
                   help="BLOCK_TxBLOCK_S tiles to compile, comma-separated (default: the package's, "
                        f"{dcmha_triton.BLOCK_T}x{dcmha_triton.BLOCK_S}); each a power of two from 16")
    args = p.parse_args(argv)
    texts = (args.tiles or "").split(",")
    bad = [text for text in texts if text and parse_tile(text) is None]
    if bad:
        p.error(f"--tiles: {', '.join(bad)} is not TxS with T and S powers of two from 16")
    args.tiles = [parse_tile(text) for text in texts if text] or [(dcmha_triton.BLOCK_T, dcmha_triton.BLOCK_S)]
    args.heads = [int(x) for x in args.heads.split(",")]
    args.head_dim = [int(x) for x in args.head_dim.split(",")]
    if len(args.heads) != len(args.head_dim):
        p.error("--heads and --head-dim need the same number of entries")
    args.kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    for k in args.kernels:
        if k not in KERNELS:
            p.error(f"--kernels: unknown {k!r} ({', '.join(KERNELS)})")
    return args


def compile_kernel(name: str, heads: int, head_dim: int, dtype: str, rank: int, arch: int, warps: int | None = None):
    """The compiled kernel `name` for `heads` heads per group of `head_dim` dimensions, and its block settings."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    MP, DHP = max(2, triton.next_power_of_2(heads)), max(16, triton.next_power_of_2(head_dim))
    settings = dcmha_triton.block_settings(MP, DHP)
    if warps is not None:
        settings["num_warps"] = warps
    consts = dict(
        I=rank, HAS_KEY=True, HAS_PAD=True, HAS_WINDOW=True, MP=MP, DHP=DHP, DK=settings["DK"], DV=settings["DV"],
        BT=dcmha_triton.BLOCK_T, BS=dcmha_triton.BLOCK_S, PRECISION="ieee",
    )  # fmt: skip
    fn = {"fwd": dcmha_triton._fwd, "bwd_cols": dcmha_triton._bwd_cols}.get(name, dcmha_triton._bwd_rows)
    if fn is dcmha_triton._bwd_rows:
        consts["STATS"] = name == "bwd_stats"
    activations = ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "do_ptr")

    def arg_type(arg: str) -> str:
        if arg in consts:
            return "constexpr"
        if arg.endswith("_ptr"):
            return f"*{dtype}" if arg in activations else "*u8" if arg == "pad_ptr" else "*fp32"
        return "fp32" if arg == "scale" else "i32"

    source = ASTSource(fn, {arg: arg_type(arg) for arg in fn.arg_names}, constexprs=consts)
    options = {k: v for k, v in settings.items() if k in ("num_warps", "num_stages", "maxnreg")}
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options), settings


def registers_and_stack(kernel) -> tuple[str, str]:
    """(registers per thread, stack bytes per thread) from `cuobjdump --dump-resource-usage`, or ("?", "?")."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        try:
            report = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        except OSError:
            return "?", "?"
    regs, stack = re.search(r"REG:(\d+)", report), re.search(r"STACK:(\d+)", report)
    return (regs.group(1) if regs else "?"), (stack.group(1) if stack else "?")


def main(argv=None) -> int:
    args = parse_args(argv)
    if dcmha_triton.triton is None:
        print("Triton is not installed (pip install triton)", file=sys.stderr)
        return 1
    limit = SHARED_LIMIT_KIB[args.arch]
    print(f"- Triton {dcmha_triton.triton.__version__}, sm_{args.arch} (shared memory per block: {limit} KiB), "
          f"{args.dtype}, rank {args.rank}")  # fmt: skip
    print("| heads per group | head size | tile | kernel | DK | DV | warps | shared (KiB) | fits | registers | "
          "stack (B) |")
    print("| ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |")
    too_big = 0
    for heads, head_dim in zip(args.heads, args.head_dim):
        for tile in args.tiles:
            with triton_tile(tile):  # what compile_kernel and block_settings read
                for name in args.kernels:
                    start = time.perf_counter()
                    kernel, settings = compile_kernel(name, heads, head_dim, args.dtype, args.rank, args.arch,
                                                      args.warps)
                    shared = kernel.metadata.shared / 1024
                    fits = shared <= limit
                    too_big += not fits
                    regs, stack = registers_and_stack(kernel)
                    print(f"| {heads} | {head_dim} | {tile[0]}x{tile[1]} | {name} | {settings['DK']} | "
                          f"{settings['DV']} | {settings['num_warps']} | {shared:.0f} | {'yes' if fits else 'NO'} | "
                          f"{regs} | {stack} |", flush=True)  # fmt: skip
                    print(f"  ({name} compiled in {time.perf_counter() - start:.1f} s)", file=sys.stderr)
    return 0 if too_big == 0 else 2


if __name__ == "__main__":
    sys.exit(main())
