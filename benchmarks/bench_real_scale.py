#!/usr/bin/env python3
"""Pythia-6.9B at its real size, end to end on CPU: write a random GPT-NeoX checkpoint, convert it with
`dcformer-convert-pythia`, then load each model in bf16 and time its load, a prefill and a few decode steps.

Phases, each in its own child process so that each peak resident set size (RSS) is that phase's own:

    write     a random GPT-NeoX checkpoint of the Pythia-6.9B shape (4096 hidden, 32 layers, 32 heads, MLP 16384,
              vocab 50432), fp16 safetensors shards (one or two layers each) and their index; one shard is in
              memory at a time, never the whole model
    convert   `dcformer-convert-pythia SRC DST --no-verify` (the installed console script; the dtype of the source,
              fp16, is kept)
    gpt-neox  `GPTNeoXForCausalLM.from_pretrained(SRC, dtype=torch.bfloat16)`, then a prefill of --prefill-tokens
              tokens (cache filled, logits of the last position) and --decode-steps greedy decode steps, one token
              each, through the cache
    dcformer  the same with `DCFormerForCausalLM.from_pretrained(DST, dtype=torch.bfloat16)`

What it needs at the full shape (6.86B parameters source, 6.95B converted): disk about 28 GB under --workdir
(13.7 GB source + 13.9 GB converted; both are deleted at the end unless --keep) and about 15 GiB of free memory
(one bf16 model, 13.9 GB, and its prefill; the two models are never in memory together; the conversion peaks near
7 GB). It checks both before it starts and refuses with a line saying what is missing; `--layers N` runs the same
pipeline on fewer layers (the per-layer cost is the same; memory and disk shrink about in proportion). The peak
RSS of a load is about twice the model's size: safetensors maps the checkpoint files, and RSS counts their mapped
(clean, reclaimable) pages besides the model's own memory. Time: an 8-layer run took 15 minutes on a busy 2-core
CPU with 1 torch thread; the full shape has four times the layers' work (bf16 products are slow on CPU: a decode
step of the full model takes tens of seconds).

    python benchmarks/bench_real_scale.py --workdir /scratch/realscale             # the full Pythia-6.9B shape
    python benchmarks/bench_real_scale.py --workdir /scratch/realscale --layers 8  # a quarter of the layers
    python benchmarks/bench_real_scale.py --workdir /tmp/rs --layers 2 --override hidden_size=64 \\
        --override num_attention_heads=4 --override intermediate_size=256 --override vocab_size=512  # smoke run

Threads: 1 torch thread by default (`--threads`), for ratios that hold on a shared machine. The ratio
DCFormer/GPT-NeoX is the point of the numbers; absolute times depend on what else the machine runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

GB = 1000**3
GIB = 1024**3
# Pythia-6.9B (EleutherAI/pythia-6.9b's config.json)
PYTHIA_69B = dict(
    hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, intermediate_size=16384, vocab_size=50432,
    max_position_embeddings=2048, rotary_pct=0.25, rotary_emb_base=10000, layer_norm_eps=1e-5,
    use_parallel_residual=True, tie_word_embeddings=False, hidden_act="gelu", bos_token_id=0, eos_token_id=0,
)
DCMHA_EXTRA = 1.0125  # the converted model's parameters over the source's (DCMHA's projections: about 1.25%)


# ------------------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------------------
def override(text: str) -> tuple[str, object]:
    """argparse type of --override: "hidden_size=64" -> ("hidden_size", 64) (ints, floats, true/false, else str)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE (e.g. hidden_size=64)")
    key = key.strip()
    if key not in PYTHIA_69B:
        raise argparse.ArgumentTypeError(f"unknown key {key!r}; choose from {', '.join(sorted(PYTHIA_69B))}")
    for cast in (int, float):
        try:
            return key, cast(value)
        except ValueError:
            pass
    if value.lower() in ("true", "false"):
        return key, value.lower() == "true"
    return key, value


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Pythia-6.9B shape end to end: write a random fp16 GPT-NeoX checkpoint shard by shard, convert "
                    "it with dcformer-convert-pythia, load both in bf16 (one at a time) and time load, prefill and "
                    "decode, with each phase's peak RSS. Needs, at the full shape, about 28 GB of disk under "
                    "--workdir and about 15 GiB of free memory (checked first; --layers N for less).",
        epilog=__doc__.split("\n\n", 2)[2] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workdir", required=True,
                   help="folder for the two checkpoints (created if absent; each goes in a new subfolder, deleted at "
                        "the end unless --keep)")
    p.add_argument("--layers", type=int, default=None, help="number of layers (default: Pythia-6.9B's 32)")
    p.add_argument("--override", type=override, action="append", default=[], metavar="KEY=VALUE",
                   help="change one GPT-NeoX config value of the shape (for smoke runs: hidden_size=64 ...)")
    p.add_argument("--prefill-tokens", type=int, default=64, help="prompt length of the prefill (default 64)")
    p.add_argument("--decode-steps", type=int, default=4, help="greedy decode steps after the prefill (default 4)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and the prompt")
    p.add_argument("--keep", action="store_true", help="keep both checkpoints (default: delete them at the end)")
    p.add_argument("--skip-resource-check", action="store_true",
                   help="start even if the free memory or disk looks too small (the run may then fail or swap)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--child", nargs=3, metavar=("PHASE", "PATH", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return args
    for name in ("prefill_tokens", "decode_steps", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.layers is not None and args.layers < 1:
        p.error(f"--layers must be at least 1, got {args.layers}")
    if os.path.exists(args.workdir) and not os.path.isdir(args.workdir):
        p.error(f"--workdir {args.workdir!r} exists and is not a folder")
    return args


def neox_shape(args) -> dict:
    shape = dict(PYTHIA_69B)
    if args.layers is not None:
        shape["num_hidden_layers"] = args.layers
    shape.update(dict(args.override))
    if shape["hidden_size"] % shape["num_attention_heads"]:
        raise SystemExit(f"hidden_size {shape['hidden_size']} is not a multiple of num_attention_heads "
                         f"{shape['num_attention_heads']}")
    return shape


def parameter_count(shape: dict) -> int:
    H, L, F, V = shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"], shape["vocab_size"]
    per_layer = 4 * H * H + 4 * H + 2 * H * F + F + H + 4 * H  # qkv, dense, MLP, their biases, two LayerNorms
    return L * per_layer + 2 * V * H + 2 * H


def mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_resources(args, params: int) -> list[str]:
    """Lines saying what is missing (free disk under --workdir, free memory), empty when the run fits."""
    problems = []
    source = params * 2
    disk_needed = int(source * (1 + DCMHA_EXTRA) * 1.02) + 256 * 1024**2
    probe = args.workdir
    while not os.path.exists(probe):
        probe = os.path.dirname(os.path.abspath(probe))
    free = shutil.disk_usage(probe).free
    if free < disk_needed:
        problems.append(f"--workdir {args.workdir}: {free / GB:.1f} GB free, the two checkpoints need "
                        f"{disk_needed / GB:.1f} GB")
    mem_needed = int(params * DCMHA_EXTRA * 2 * 1.08) + GIB  # one bf16 model, its prefill, the interpreter
    avail = mem_available()
    if avail is not None and avail < mem_needed:
        problems.append(f"memory: {avail / GIB:.1f} GiB available, one bf16 model and its prefill need about "
                        f"{mem_needed / GIB:.1f} GiB")
    return problems


# ------------------------------------------------------------------------------------------------------------
# Children (each phase in its own process)
# ------------------------------------------------------------------------------------------------------------
def peak_rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def current_rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def child_write(path: str, args) -> dict:
    """Writes the random fp16 GPT-NeoX checkpoint at `path`: shards of about 1 GB (whole layers), then the index.
    Tensor names and shapes come from the model built on the meta device (no memory); values: N(0, 0.02) weights,
    LayerNorm weights 1, biases 0."""
    import torch
    from safetensors.torch import save_file
    from tqdm.auto import tqdm
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    shape = neox_shape(args)
    config = GPTNeoXConfig(**shape, dtype="float16")
    config.architectures = ["GPTNeoXForCausalLM"]
    with torch.device("meta"):
        model = GPTNeoXForCausalLM(config)
    tensors = [(name, tuple(t.shape)) for name, t in model.state_dict().items()]
    del model

    def group(name: str) -> str:  # tensors of one layer go together
        parts = name.split(".")
        return ".".join(parts[:3]) if "layers" in parts else parts[-2]

    groups: list[list[tuple[str, tuple]]] = []
    for name, shp in tensors:
        if groups and group(groups[-1][-1][0]) == group(name):
            groups[-1].append((name, shp))
        else:
            groups.append([(name, shp)])
    shards, current, size = [], [], 0
    for grp in groups:
        gsize = sum(2 * torch.Size(s).numel() for _, s in grp)
        if current and size + gsize > GB:
            shards.append(current)
            current, size = [], 0
        current += grp
        size += gsize
    shards.append(current)

    os.makedirs(path)
    gen = torch.Generator().manual_seed(args.seed)
    weight_map, total = {}, 0
    for i, shard in enumerate(tqdm(shards, desc="writing shards", unit="shard"), start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        data = {}
        for name, shp in shard:
            if name.endswith("bias"):
                t = torch.zeros(shp, dtype=torch.float16)
            elif len(shp) == 1:  # LayerNorm weights
                t = torch.ones(shp, dtype=torch.float16)
            else:
                t = torch.empty(shp, dtype=torch.float16).normal_(0.0, 0.02, generator=gen)
            data[name] = t
            weight_map[name] = file
            total += t.numel() * 2
        save_file(data, os.path.join(path, file), metadata={"format": "pt"})
        del data
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config.save_pretrained(path)
    return dict(shards=len(shards), bytes=total, parameters=total // 2)


def child_model(kind: str, path: str, args) -> dict:
    """Loads one model in bf16, then times a prefill and `--decode-steps` greedy steps through its cache."""
    import torch

    torch.set_num_threads(args.threads)
    if kind == "gpt-neox":
        from transformers import GPTNeoXForCausalLM as cls
        extra = dict(attn_implementation="sdpa")
    else:
        from modeling_dcformer import DCFormerForCausalLM as cls
        extra = {}
    rss_start = current_rss_kib()
    t0 = time.perf_counter()
    model = cls.from_pretrained(path, dtype=torch.bfloat16, **extra).eval()
    load_s = time.perf_counter() - t0
    rss_loaded, peak_load = current_rss_kib(), peak_rss_kib()
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, args.prefill_tokens), generator=torch.Generator().manual_seed(args.seed + 1))
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        prefill_s = time.perf_counter() - t0
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        tokens, steps = [], []
        next_id = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(args.decode_steps):
            tokens.append(int(next_id))
            t0 = time.perf_counter()
            out = model(input_ids=next_id, cache=cache, use_cache=True)
            steps.append(time.perf_counter() - t0)
            cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
            next_id = out.logits[:, -1].argmax(-1, keepdim=True)
    return dict(parameters=sum(p.numel() for p in model.parameters()), load_s=load_s, prefill_s=prefill_s,
                decode_step_s=steps, decode_tokens_per_s=len(steps) / sum(steps), tokens=tokens,
                rss_start_kib=rss_start, rss_loaded_kib=rss_loaded, peak_load_kib=peak_load,
                peak_kib=peak_rss_kib())


def run_child_main(args) -> int:
    phase, path, out = args.child
    result = child_write(path, args) if phase == "write" else child_model(phase, path, args)
    with open(out, "w") as f:
        json.dump(result, f)
    return 0


# ------------------------------------------------------------------------------------------------------------
# Parent
# ------------------------------------------------------------------------------------------------------------
def run_phase(cmd: list[str], label: str, log) -> tuple[float, int]:
    """Runs `cmd` to completion; returns (wall seconds, the child's peak RSS in KiB, from wait4's rusage)."""
    print(f"[real-scale] {label}: {' '.join(map(shlex.quote, cmd))}", file=log, flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"bench_real_scale: the {label} phase failed (exit code {proc.returncode}): "
                         f"{' '.join(map(shlex.quote, cmd))}")
    return wall, usage.ru_maxrss  # KiB on Linux


def converter_command() -> list[str]:
    script = os.path.join(os.path.dirname(sys.executable), "dcformer-convert-pythia")
    if os.path.isfile(script):
        return [script]
    found = shutil.which("dcformer-convert-pythia")
    return [found] if found else [sys.executable, "-m", "modeling_dcformer.conversion.pythia"]


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def child_args(args) -> list[str]:
    out = ["--workdir", args.workdir, "--prefill-tokens", str(args.prefill_tokens), "--decode-steps",
           str(args.decode_steps), "--threads", str(args.threads), "--seed", str(args.seed)]
    if args.layers is not None:
        out += ["--layers", str(args.layers)]
    for key, value in args.override:
        out += ["--override", f"{key}={value}"]
    return out


def report(args, shape, results, command, load_before, wall) -> list[str]:
    import torch
    import transformers

    w, c, n, d = results["write"], results["convert"], results["gpt-neox"], results["dcformer"]
    gib = 1024**2  # KiB per GiB

    def ratio(a, b):
        return f"{a / b:.2f}x"

    lines = [
        f"## Real scale, end to end: `{command}`",
        "",
        f"- torch {torch.__version__}, transformers {transformers.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()} CPU, {os.cpu_count()} cores visible, {args.threads} torch thread(s)",
        f"- shape: hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, {shape['num_attention_heads']} "
        f"heads, MLP {shape['intermediate_size']}, vocab {shape['vocab_size']}; source {w['parameters'] / 1e6:.1f}M "
        f"parameters, fp16, {w['shards']} shards, {w['bytes'] / GB:.1f} GB; converted {c['bytes'] / GB:.1f} GB",
        f"- each phase in its own process; peak RSS is that process's (wait4's ru_maxrss); models loaded with "
        f"`from_pretrained(..., dtype=torch.bfloat16)`, one at a time; prefill {args.prefill_tokens} tokens (cache "
        f"filled, logits of the last position), then {args.decode_steps} greedy decode steps of one token",
        f"- load average (1/5/15 min) before: {load_before}, after: {load_average()}",
        "",
        f"| phase | wall (s) | peak RSS (GiB) |",
        "| --- | ---: | ---: |",
        f"| write random GPT-NeoX checkpoint | {w['wall_s']:.0f} | {w['peak_kib'] / gib:.1f} |",
        f"| dcformer-convert-pythia --no-verify | {c['wall_s']:.0f} | {c['peak_kib'] / gib:.1f} |",
        f"| GPT-NeoX: load + prefill + decode | {n['wall_s']:.0f} | {n['peak_kib'] / gib:.1f} |",
        f"| DCFormer: load + prefill + decode | {d['wall_s']:.0f} | {d['peak_kib'] / gib:.1f} |",
        "",
        "| metric (bf16) | GPT-NeoX | DCFormer | ratio DCFormer/GPT-NeoX |",
        "| --- | ---: | ---: | ---: |",
        f"| parameters (M) | {n['parameters'] / 1e6:.1f} | {d['parameters'] / 1e6:.1f} | "
        f"{ratio(d['parameters'], n['parameters'])} |",
        f"| from_pretrained (s) | {n['load_s']:.1f} | {d['load_s']:.1f} | {ratio(d['load_s'], n['load_s'])} |",
        f"| RSS after load (GiB) | {n['rss_loaded_kib'] / gib:.1f} | {d['rss_loaded_kib'] / gib:.1f} | "
        f"{ratio(d['rss_loaded_kib'], n['rss_loaded_kib'])} |",
        f"| peak RSS during load (GiB) | {n['peak_load_kib'] / gib:.1f} | {d['peak_load_kib'] / gib:.1f} | "
        f"{ratio(d['peak_load_kib'], n['peak_load_kib'])} |",
        f"| prefill {args.prefill_tokens} tokens (s, no warm-up) | {n['prefill_s']:.2f} | {d['prefill_s']:.2f} | "
        f"{ratio(d['prefill_s'], n['prefill_s'])} |",
        f"| decode ({args.decode_steps} steps, tokens/s, higher is better) | {n['decode_tokens_per_s']:.3f} | "
        f"{d['decode_tokens_per_s']:.3f} | {ratio(d['decode_tokens_per_s'], n['decode_tokens_per_s'])} |",
        f"| peak RSS of the process (GiB) | {n['peak_kib'] / gib:.1f} | {d['peak_kib'] / gib:.1f} | "
        f"{ratio(d['peak_kib'], n['peak_kib'])} |",
        "",
        "Decode steps (s): GPT-NeoX " + ", ".join(f"{s:.2f}" for s in n["decode_step_s"]) + "; DCFormer "
        + ", ".join(f"{s:.2f}" for s in d["decode_step_s"]),
        f"Greedy tokens: GPT-NeoX {n['tokens']}, DCFormer {d['tokens']} "
        f"({'the same' if n['tokens'] == d['tokens'] else 'different'}: the conversion keeps the function; bf16 "
        "rounding can still flip a near tie of random weights)",
        f"Total wall time: {wall:.0f} s",
    ]
    return lines


def load_average() -> str:
    try:
        return " / ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return run_child_main(args)
    shape = neox_shape(args)
    params = parameter_count(shape)
    problems = check_resources(args, params)
    if problems and not args.skip_resource_check:
        fewer = "" if shape["num_hidden_layers"] <= 1 else " (fewer --layers need less)"
        raise SystemExit("bench_real_scale: not enough resources for this shape" + fewer + ": "
                         + "; ".join(problems))
    argv_list = sys.argv[1:] if argv is None else list(argv)
    command = " ".join(["python", "benchmarks/bench_real_scale.py", *map(shlex.quote, argv_list)])
    os.makedirs(args.workdir, exist_ok=True)
    run_dir = tempfile.mkdtemp(prefix="real-scale-", dir=args.workdir)
    src, dst = os.path.join(run_dir, "gpt-neox"), os.path.join(run_dir, "dcformer")
    log = sys.stderr
    load_before = load_average()
    t_start = time.perf_counter()
    results = {}
    this = [sys.executable, os.path.abspath(__file__)] + child_args(args)
    try:
        out = os.path.join(run_dir, "write.json")
        wall, peak = run_phase(this + ["--child", "write", src, out], "write", log)
        with open(out) as f:
            results["write"] = dict(json.load(f), wall_s=wall, peak_kib=peak)

        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        cmd = converter_command() + [src, dst, "--no-verify"]
        print(f"[real-scale] convert: {' '.join(map(shlex.quote, cmd))}", file=log, flush=True)
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            raise SystemExit(f"bench_real_scale: dcformer-convert-pythia failed (exit code {proc.returncode})")
        results["convert"] = dict(wall_s=time.perf_counter() - t0, peak_kib=usage.ru_maxrss, bytes=folder_bytes(dst))

        for kind, path in (("gpt-neox", src), ("dcformer", dst)):
            out = os.path.join(run_dir, f"{kind}.json")
            wall, peak = run_phase(this + ["--child", kind, path, out], kind, log)
            with open(out) as f:
                results[kind] = dict(json.load(f), wall_s=wall, peak_kib=peak)
    finally:
        if not args.keep:
            shutil.rmtree(run_dir, ignore_errors=True)
    wall = time.perf_counter() - t_start
    for line in report(args, shape, results, command, load_before, wall):
        print(line, flush=True)
    if args.keep:
        print(f"Checkpoints kept: {src}, {dst}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(command=command, shape=shape, results=results, wall_s=wall), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
