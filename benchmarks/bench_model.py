#!/usr/bin/env python3
"""DCFormer vs. a plain-attention baseline of the same shape, on CPU: prefill, training step, decode, memory.

The baseline is transformers' `GPTNeoXForCausalLM` (SDPA attention) for DCPythia-style bodies (the default,
Pythia-160M's shape) and `LlamaForCausalLM` (SDPA) for DCFormer++-style bodies (RMSNorm, SwiGLU). Both
models get the same hidden size, layers, heads, MLP width, vocabulary and dtype, random weights.

Measurements (each ratio is DCFormer / baseline):
    prefill     forward of one batch of `--seq-len` tokens under inference_mode, filling the KV cache and
                computing the logits of the last position only (what `generate` does) -> seconds
    fwd+bwd     training step without optimizer: train mode, loss on `--seq-len` tokens, backward -> seconds
    decode      greedy `generate` with use_cache: `--decode-prompt` prompt tokens, exactly `--decode-new` new
                tokens (EOS disabled) -> new tokens per second, prompt processing included
    peak memory the process's peak resident memory during one run, above its resident memory before that
                run, which follows a warm-up run (one-time costs such as torch.compile's compilation of DCMHA
                chunks are left out) (Linux: VmHWM reset through /proc/self/clear_refs; elsewhere a sampling
                thread), with glibc's mmap threshold pinned at 128 KiB so that freed tensors go back to the
                system and the peak follows live tensors, not heap retention (`--malloc default` to measure
                with glibc as it is) -> MiB
    sweep       `--sweep`: the training step (fwd+bwd above) at each of `--sweep-seq-lens` (default 512, 1024,
                2048, 4096), batch `--batch-size`, shape Pythia-70M unless `--shape`: a table of step time and
                peak memory of both models per sequence length with their ratios, and a PNG plot of both against
                the sequence length, written with the table to `--out-dir` (default benchmarks/results/); it
                replaces the table above. Above 1024 tokens one timed run per model after the warm-up
                (`--sweep-full-repeats`: `--repeats` runs)
Threads: 1 by default (`--threads N` for more), for ratios that hold on a shared or loaded machine.
Every measurement runs in a fresh process forked from this one (the imports are paid once; no allocator
state leaks from one measurement into the next). Time: per phase, one process holds both models, warms each
up once, then runs them `--repeats` times interleaved (A B B A ...) so that both see the same machine load;
the median is reported; `--processes N` times each phase in N such processes and reports the median of their
ratios, with each process's (on this project's shared CPU two processes' ratios can differ by 10-20%, more than
one process's runs do). Memory: one run (after a warm-up run) per model and phase, each in its own process.

    python benchmarks/bench_model.py                      # Pythia-160M shape, T=1024, fp32
    python benchmarks/bench_model.py --quick              # tiny smoke test (a few seconds of work)
    python benchmarks/bench_model.py --shape pythia-70m --seq-len 512 --window 256
    python benchmarks/bench_model.py --profile            # also: top DCFormer prefill ops (torch.profiler)
    python benchmarks/bench_model.py --phases prefill,train --processes 5   # the median of 5 processes' ratios
    python benchmarks/bench_model.py --shape pythia-6.9b --layers 2 --vocab-size 1024 --dtype bf16 \
        --phases prefill,decode --seq-len 64 --decode-prompt 8 --decode-new 8 --repeats 5  # DCPythia-6.9B's layers
    python benchmarks/bench_model.py --compile-static     # decode: static cache, torch.compile'd forward, both models
    python benchmarks/bench_model.py --sweep              # training step vs T (Pythia-70M shape), table + PNG
    python benchmarks/bench_model.py --sweep --quick      # the same on the tiny shape at T=32,64 (seconds)

`--json FILE` writes the results (examples/demo.py reads the ratios from it); `run_benchmark(argv)` returns them.
Call `run_benchmark` from a process that has not run torch ops yet (it forks; OpenMP is not fork-safe once
its threads exist), or run this script as a subprocess. The timing process holds both models at once: a
shape needs about twice its weights in memory.
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import math
import multiprocessing
import os
import platform
import shlex
import statistics
import sys
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import CompileConfig, GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402

import modeling_dcformer  # noqa: E402,F401
import modeling_dcformer.configuration  # noqa: E402
from modeling_dcformer import DCFormerConfig, DCFormerForCausalLM  # noqa: E402

CONFIG_DIR = os.path.dirname(modeling_dcformer.configuration.__file__)  # the presets, installed with the package

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}
MIB = 1024 * 1024
PHASES = ("prefill", "train", "decode")
QUICK = dict(shape="dcformer-tiny", seq_len=128, decode_prompt=16, decode_new=16, repeats=2, sweep_seq_lens=[32, 64])
DEFAULTS = dict(shape="pythia-160m", seq_len=1024, decode_prompt=128, decode_new=128, repeats=3,
                sweep_seq_lens=[512, 1024, 2048, 4096])
SWEEP_SHAPE = "pythia-70m"  # --sweep's default shape: Pythia-160M's steps at 4096 tokens take minutes each on 1 thread
RESULTS_DIR = os.path.join(ROOT, "benchmarks", "results")
SWEEP_LONG = 1024  # --sweep: above this many tokens one timed run per model (after the warm-up)


# ------------------------------------------------------------------------------------------------------------
# Command line and shapes
# ------------------------------------------------------------------------------------------------------------
def preset_names() -> list[str]:
    return sorted(os.path.basename(p)[:-5] for p in glob.glob(os.path.join(CONFIG_DIR, "*.json")))


def seq_len_list(text: str) -> list[int]:
    """argparse type of --sweep-seq-lens: "512,1024" -> [512, 1024] (sorted, distinct, each at least 1)."""
    lens = []
    for item in text.split(","):
        try:
            lens.append(int(item))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item.strip()!r} is not an integer (expected e.g. 512,1024)") from None
        if lens[-1] < 1:
            raise argparse.ArgumentTypeError(f"sequence lengths must be at least 1, got {lens[-1]}")
    return sorted(set(lens))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="DCFormer vs GPT-NeoX (or Llama) of the same shape on CPU: prefill, fwd+bwd, decode, memory.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--shape", default=None,
                   help="a preset of configuration/ (e.g. dcpythia-pythia-410m, dcformer-tiny) or pythia-SIZE "
                        f"(-> dcpythia-pythia-SIZE.json); default {DEFAULTS['shape']} ({SWEEP_SHAPE} with --sweep, "
                        f"{QUICK['shape']} with --quick)")
    p.add_argument("--layers", type=int, default=None,
                   help="number of layers (default: the preset's); with --shape pythia-6.9b a slice of DCPythia-6.9B's "
                        "layers at their real shape")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="vocabulary size (default: the preset's); a small one (1024) keeps a few-layer slice of a "
                        "big shape from being dominated by its embedding and output layer")
    p.add_argument("--seq-len", type=int, default=None, help=f"tokens of prefill and fwd+bwd (default {DEFAULTS['seq_len']})")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--decode-prompt", type=int, default=None, help=f"prompt tokens for decode (default {DEFAULTS['decode_prompt']})")
    p.add_argument("--decode-new", type=int, default=None, help=f"new tokens for decode (default {DEFAULTS['decode_new']})")
    p.add_argument("--repeats", type=int, default=None, help=f"timed runs after one warm-up (default {DEFAULTS['repeats']})")
    p.add_argument("--processes", type=int, default=1,
                   help="timing processes per phase, one after the other, each building both models afresh: the "
                        "reported ratio is the median of the processes' ratios, each process's ratio is printed. "
                        "On a shared machine one process's ratio can differ from the next one's by 10-20%% (where "
                        "each tensor lands in memory differs); several processes show that spread")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads. 1 by default: the ratios are then stable even on a shared or loaded "
                        "machine (with 2 threads and other work on the cores, each of DCFormer's many small ops can "
                        "wait a scheduler slice at OpenMP barriers); use --threads N for N cores")
    p.add_argument("--window", type=int, default=None,
                   help="make DCFormer layers local with this window (pattern from --window-type); 0: every layer "
                        "global. Default: the preset's own setting")
    p.add_argument("--window-type", default=None, help="window pattern with --window (None: 'LG', even layers local)")
    p.add_argument("--qk-norm", choices=("on", "off"), default=None, help="override the preset's qk-norm")
    p.add_argument("--dcmha-implementation", choices=("auto", "eager", "compiled", "cpu"), default=None,
                   help="DCFormerConfig.dcmha_implementation (default: the preset's, 'auto'; 'cpu' computes no "
                        "gradients: prefill and decode only)")
    p.add_argument("--attention-chunk-size", type=int, default=None,
                   help="DCFormerConfig.attention_chunk_size (default: the preset's)")
    p.add_argument("--malloc", choices=("pinned", "default"), default="pinned",
                   help="memory runs: 'pinned' fixes glibc's mmap threshold at 128 KiB so that the RSS peak follows "
                        "live tensors; 'default' leaves glibc as it is (its heap then retains freed blocks of up to 32 MiB)")
    p.add_argument("--cache", choices=("dynamic", "static"), default="dynamic",
                   help="decode: generate's cache_implementation, for both models (static: buffers written in place)")
    p.add_argument("--compile-static", action="store_true",
                   help="decode with cache_implementation='static', which generate() compiles by itself (here on "
                        "any device: CompileConfig), both models; the warm-up run compiles. "
                        "Implies --cache static and, unless --phases says otherwise, --phases decode")
    p.add_argument("--phases", default=None, help="comma-separated subset of " + ",".join(PHASES))
    p.add_argument("--quick", action="store_true", help="tiny model and short inputs: a smoke test")
    p.add_argument("--sweep", action="store_true",
                   help="instead of the phase table: the training step (forward, loss, backward; no optimizer) at "
                        "each of --sweep-seq-lens, time and peak memory of both models, a table and a PNG plot")
    p.add_argument("--sweep-seq-lens", type=seq_len_list, default=None, metavar="T1,T2,...",
                   help="comma-separated sequence lengths of --sweep (implies --sweep); default "
                        f"{','.join(map(str, DEFAULTS['sweep_seq_lens']))} "
                        f"({','.join(map(str, QUICK['sweep_seq_lens']))} with --quick)")
    p.add_argument("--sweep-full-repeats", action="store_true",
                   help=f"--sweep: --repeats timed runs at every length (default: one above {SWEEP_LONG} tokens)")
    p.add_argument("--out-dir", default=None, metavar="DIR",
                   help="--sweep writes its table (.md) and plot (.png) here; default benchmarks/results/")
    p.add_argument("--profile", action="store_true", help="also profile one DCFormer prefill and print its top ops")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)
    args.sweep = args.sweep or args.sweep_seq_lens is not None
    if args.sweep and not args.quick and args.shape is None:
        args.shape = SWEEP_SHAPE
    base = QUICK if args.quick else DEFAULTS
    for key, value in base.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.out_dir = args.out_dir or RESULTS_DIR
    if args.phases is None:
        args.phases = "decode" if args.compile_static else ",".join(PHASES)
    args.phases = [ph.strip() for ph in args.phases.split(",") if ph.strip()]
    unknown = set(args.phases) - set(PHASES)
    if unknown:
        p.error(f"unknown phases {sorted(unknown)}; choose from {PHASES}")
    if args.dcmha_implementation == "cpu" and ("train" in args.phases or args.sweep):
        p.error("--dcmha-implementation cpu computes no gradients: use it with --phases prefill,decode")
    if args.compile_static:
        if args.phases != ["decode"] or args.sweep:
            p.error("--compile-static measures decoding: use it with --phases decode (and without --sweep)")
        if args.cache == "dynamic" and "--cache" in (sys.argv[1:] if argv is None else list(argv)):
            p.error("--compile-static decodes with the static cache: drop --cache dynamic")
        args.cache = "static"
    for name in ("layers", "vocab_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.processes > 1 and args.sweep:
        p.error("--processes applies to the phase table, not to --sweep")
    for name in ("seq_len", "batch_size", "decode_prompt", "decode_new", "repeats", "threads", "processes"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def resolve_preset(shape: str) -> str:
    candidates = [shape, os.path.join(CONFIG_DIR, shape), os.path.join(CONFIG_DIR, shape + ".json"),
                  os.path.join(CONFIG_DIR, "dcpythia-" + shape + ".json")]
    for path in candidates:
        if os.path.isfile(path):
            return path
    raise SystemExit(f"unknown --shape {shape!r}: use a file or one of {', '.join(preset_names())} "
                     "(or pythia-SIZE for dcpythia-pythia-SIZE)")


def dcformer_config(args) -> DCFormerConfig:
    config = DCFormerConfig.from_json_file(resolve_preset(args.shape))
    overrides = {}
    if args.window is not None:
        overrides.update(window_size=args.window or None, window_type=args.window_type, layer_types=None)
    if args.qk_norm is not None:
        overrides["use_qk_norm"] = args.qk_norm == "on"
    if args.dcmha_implementation is not None:
        overrides["dcmha_implementation"] = args.dcmha_implementation
    if args.attention_chunk_size is not None:
        overrides["attention_chunk_size"] = args.attention_chunk_size
    if args.layers is not None:
        overrides.update(num_hidden_layers=args.layers, layer_types=None)  # the pattern is re-derived for N layers
    if args.vocab_size is not None:
        overrides["vocab_size"] = args.vocab_size
    max_len = max(args.seq_len, args.decode_prompt + args.decode_new, *(args.sweep_seq_lens if args.sweep else ()))
    if max_len > config.max_position_embeddings:
        overrides["max_position_embeddings"] = max_len
    if overrides:
        config = DCFormerConfig(**{**config.to_dict(), **overrides})
    return config


def baseline_config(dc: DCFormerConfig):
    """(name, config) of the plain-attention model of the same shape as `dc`."""
    common = dict(
        vocab_size=dc.vocab_size, hidden_size=dc.hidden_size, num_hidden_layers=dc.num_hidden_layers,
        num_attention_heads=dc.num_attention_heads, intermediate_size=dc.intermediate_size,
        max_position_embeddings=dc.max_position_embeddings, hidden_act=dc.hidden_act,
        attention_bias=dc.attention_bias, tie_word_embeddings=dc.tie_word_embeddings,
        bos_token_id=dc.bos_token_id, eos_token_id=dc.eos_token_id,
    )
    pythia_like = dc.norm_type == "layernorm" and not dc.use_gated_mlp
    if pythia_like:
        cfg = GPTNeoXConfig(**common, layer_norm_eps=dc.layer_norm_eps, use_parallel_residual=dc.use_parallel_residual,
                            partial_rotary_factor=dc.partial_rotary_factor, rope_theta=dc.rope_theta)
        return "GPT-NeoX", cfg
    cfg = LlamaConfig(**common, rms_norm_eps=dc.layer_norm_eps, mlp_bias=dc.mlp_bias,
                      rope_parameters={"rope_type": "default", "rope_theta": dc.rope_theta})
    return "Llama", cfg


# ------------------------------------------------------------------------------------------------------------
# Memory
# ------------------------------------------------------------------------------------------------------------
def _read_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class PeakRSS:
    """Peak resident memory of this process from `start()` to `stop()`, in bytes above the RSS at `start()`."""

    def __init__(self):
        self.method = "sampling"
        self._thread = None
        self._stop = threading.Event()
        self._peak = 0

    @staticmethod
    def current() -> int:
        kib = _read_status_kib("VmRSS")
        if kib is not None:
            return kib * 1024
        import psutil  # noqa: PLC0415

        return psutil.Process().memory_info().rss

    def start(self):
        self.base = self.current()
        try:  # Linux: "5" resets the peak RSS (VmHWM) to the current RSS
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            if _read_status_kib("VmHWM") is not None:
                self.method = "VmHWM"
                return self
        except OSError:
            pass
        self._peak = self.base
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self._peak = max(self._peak, self.current())
            time.sleep(0.002)

    def stop(self) -> int:
        if self.method == "VmHWM":
            peak = _read_status_kib("VmHWM") * 1024
        else:
            self._stop.set()
            self._thread.join()
            peak = max(self._peak, self.current())
        return max(0, peak - self.base)


# ------------------------------------------------------------------------------------------------------------
# One measurement (runs in a forked child)
# ------------------------------------------------------------------------------------------------------------
def build_model(kind: str, dc_cfg: DCFormerConfig, dtype: torch.dtype):
    torch.manual_seed(0)
    if kind == "dcformer":
        model = DCFormerForCausalLM(dc_cfg)
    else:
        name, cfg = baseline_config(dc_cfg)
        cls = GPTNeoXForCausalLM if name == "GPT-NeoX" else LlamaForCausalLM
        model = cls._from_config(cfg, attn_implementation="sdpa")
    model = model.to(dtype)
    model.generation_config.eos_token_id = None  # decode exactly --decode-new tokens
    model.generation_config.pad_token_id = 0
    return model


def make_step(model, phase: str, dc_cfg: DCFormerConfig, opts: dict):
    """A closure running one measured operation of `phase` on `model` (and the model mode it needs)."""
    gen = torch.Generator().manual_seed(1)
    B = opts["batch_size"]
    length = opts["decode_prompt"] if phase == "decode" else opts["seq_len"]
    ids = torch.randint(0, dc_cfg.vocab_size, (B, length), generator=gen)
    mask = torch.ones_like(ids)
    if phase == "prefill":
        model.eval()

        def step():
            with torch.inference_mode():
                out = model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
            assert out.logits.shape[1] == 1
    elif phase == "train":
        model.train()

        def step():
            out = model(input_ids=ids, labels=ids, use_cache=False)
            out.loss.backward()
            model.zero_grad(set_to_none=True)
    else:
        model.eval()
        new = opts["decode_new"]
        cache = None if opts.get("cache", "dynamic") == "dynamic" else opts["cache"]
        compiling = {}
        if opts.get("compile_static"):
            # generate() compiles the decoding step by itself with a compileable (static) cache on a GPU (Inductor,
            # CUDA graphs there); the flag asks it to on any device
            compiling["compile_config"] = CompileConfig()
            compiling["compile_config"]._compile_all_devices = True

        def step():
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                     do_sample=False, use_cache=True, cache_implementation=cache, **compiling)
            assert out.shape[1] == ids.shape[1] + new, out.shape
    return step


def timed(step) -> float:
    t0 = time.perf_counter()
    step()
    return time.perf_counter() - t0


def measure_time(phase: str, dc_cfg: DCFormerConfig, opts: dict) -> dict:
    """Both models in one process, runs interleaved (A B B A ...) so that both see the same machine load."""
    torch.set_num_threads(opts["threads"])
    dtype = DTYPES[opts["dtype"]]
    steps, info = {}, {}
    for kind in ("baseline", "dcformer"):
        model = build_model(kind, dc_cfg, dtype)
        info[kind] = dict(params=sum(p.numel() for p in model.parameters()),
                          weight_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
                          attn_implementation=getattr(model.config, "_attn_implementation", None))
        steps[kind] = make_step(model, phase, dc_cfg, opts)
    for kind in ("baseline", "dcformer"):  # warm-up
        timed(steps[kind])
    times = {"baseline": [], "dcformer": []}
    for r in range(opts["repeats"]):
        order = ("baseline", "dcformer") if r % 2 == 0 else ("dcformer", "baseline")
        for kind in order:
            times[kind].append(timed(steps[kind]))
    return {kind: dict(info[kind], times=times[kind], median=statistics.median(times[kind]),
                       torch_threads=torch.get_num_threads()) for kind in times}


def pooled(runs: list[dict]) -> dict:
    """One phase's timing from several processes' `measure_time` results: per model the times of every process
    (`times`, flattened; `process_times`, per process) and the median of the processes' medians (`median`), and
    `process_ratios`: each process's DCFormer / baseline ratio of medians. One process: its own result, the same
    numbers."""
    out = {kind: dict(runs[0][kind], times=[t for run in runs for t in run[kind]["times"]],
                      process_times=[run[kind]["times"] for run in runs],
                      median=statistics.median(run[kind]["median"] for run in runs)) for kind in ("baseline", "dcformer")}
    out["process_ratios"] = [run["dcformer"]["median"] / run["baseline"]["median"] for run in runs]
    return out


def pin_malloc_mmap_threshold(threshold: int = 128 * 1024) -> bool:
    """glibc only: serve every allocation above `threshold` bytes with its own mmap, returned to the system
    when freed. By default glibc raises that threshold up to 32 MiB as big blocks are freed, then keeps freed
    tensors of up to 32 MiB in its heap, so the RSS of a process that churns through many such tensors (DCMHA's
    [heads, chunk, keys] score tensors) records the allocator's retention rather than the live tensors."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes  # noqa: PLC0415

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, threshold)) and bool(libc.mallopt(m_trim_threshold, threshold))
    except (OSError, AttributeError):
        return False


def measure_memory(kind: str, phase: str, dc_cfg: DCFormerConfig, opts: dict) -> dict:
    """Peak resident memory of one run of `phase`, above the resident memory before it (after a warm-up run)."""
    pinned = pin_malloc_mmap_threshold() if opts.get("malloc") == "pinned" else False
    torch.set_num_threads(opts["threads"])
    model = build_model(kind, dc_cfg, DTYPES[opts["dtype"]])
    step = make_step(model, phase, dc_cfg, opts)
    step()  # warm-up: one-time costs (torch.compile compiling DCMHA chunks, lazy initialisation) stay out of the peak
    gc.collect()
    tracker = PeakRSS().start()
    step()
    return dict(peak_bytes=tracker.stop(), memory_method=tracker.method + (", glibc mmap threshold 128 KiB" if pinned else ""))


def _child(conn, fn, args):
    try:
        conn.send(("ok", fn(*args)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def run_in_fresh_process(fn, *args):
    """`fn(*args)` in a process forked from this one (imports already done, a clean heap)."""
    if "fork" not in multiprocessing.get_all_start_methods():  # Windows...: run here, memory less isolated
        return fn(*args)
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, fn, args))
    proc.start()
    child.close()
    try:
        status, payload = parent.recv()
    except EOFError:
        proc.join()
        raise RuntimeError(f"{fn.__name__}{args[:2]}: the measuring process died (exit code {proc.exitcode})") from None
    proc.join()
    if status != "ok":
        raise RuntimeError(f"{fn.__name__}{args[:2]} failed:\n{payload}")
    return payload


def profile_dcformer_prefill(dc_cfg: DCFormerConfig, opts: dict, rows: int = 18) -> str:
    """Top ops (self CPU time) of one DCFormer prefill, after a warm-up."""
    from torch.profiler import ProfilerActivity, profile, record_function  # noqa: PLC0415

    torch.set_num_threads(opts["threads"])
    model = build_model("dcformer", dc_cfg, DTYPES[opts["dtype"]]).eval()
    ids = torch.randint(0, dc_cfg.vocab_size, (opts["batch_size"], opts["seq_len"]),
                        generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        model(input_ids=ids, use_cache=True, logits_to_keep=1)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            with record_function("prefill"):
                model(input_ids=ids, use_cache=True, logits_to_keep=1)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


# ------------------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------------------
def fmt_ratio(x: float) -> str:
    """A ratio as "1.23x"; "n/a" where the baseline measured nothing (shown as 0 MiB: a tiny model's step can fit
    in memory the process already holds)."""
    return "n/a" if math.isnan(x) else f"{x:.2f}x"


def describe(dc: DCFormerConfig) -> str:
    local = sum(t == "sliding_attention" for t in dc.layer_types)
    window = f"window {dc.window_size} on {local}/{dc.num_hidden_layers} layers" if local else "every layer global"
    return (f"hidden {dc.hidden_size}, {dc.num_hidden_layers} layers, {dc.num_attention_heads} heads, "
            f"MLP {dc.intermediate_size}{' (gated)' if dc.use_gated_mlp else ''}, vocab {dc.vocab_size}, "
            f"qk-norm {'on' if dc.use_qk_norm else 'off'}, {window}, dcmha_implementation {dc.dcmha_implementation!r}")


def load_average() -> str:
    try:
        return " / ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def environment(args) -> str:
    return (f"torch {torch.__version__}, transformers {transformers.__version__}, Python {platform.python_version()}, "
            f"{platform.machine()} CPU ({torch.backends.cpu.get_cpu_capability()}), "
            f"{os.cpu_count()} cores visible, {args.threads} torch "
            f"thread{'s' if args.threads > 1 else ''}, {args.dtype}")


def shown_path(path: str) -> str:
    """`path` relative to the checkout when inside it."""
    rel = os.path.relpath(os.path.abspath(path), ROOT)
    return path if rel.startswith("..") else rel


# ------------------------------------------------------------------------------------------------------------
# --sweep: the training step against the sequence length
# ------------------------------------------------------------------------------------------------------------
def sweep_point(seq_len: int, args, dc_cfg: DCFormerConfig, opts: dict) -> dict:
    """Training-step time (interleaved runs, median) and peak memory of both models at `seq_len` tokens."""
    long = seq_len > SWEEP_LONG and not args.sweep_full_repeats
    opts = dict(opts, seq_len=seq_len, repeats=1 if long else args.repeats)
    timing = run_in_fresh_process(measure_time, "train", dc_cfg, opts)
    point = dict(seq_len=seq_len, repeats=opts["repeats"])
    for kind in ("baseline", "dcformer"):
        memory = run_in_fresh_process(measure_memory, kind, "train", dc_cfg, opts)
        point[kind] = dict(step_s=timing[kind]["median"], times=timing[kind]["times"],
                           peak_mib=memory["peak_bytes"] / MIB, memory_method=memory["memory_method"])
    base, dc = point["baseline"], point["dcformer"]
    point["time_ratio"] = dc["step_s"] / base["step_s"]
    # n/a over a baseline that rounds to 0.0 MiB in the table (a tiny model's step can fit in held memory)
    point["memory_ratio"] = dc["peak_mib"] / base["peak_mib"] if round(base["peak_mib"], 1) else float("nan")
    return point


def plot_sweep(points: list[dict], base_name: str, title: str, path: str) -> bool:
    """Peak memory (left) and step time (right) of both models against the sequence length, as a PNG.
    False (and no file) where matplotlib is not installed."""
    try:
        import matplotlib  # noqa: PLC0415
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    lens = [pt["seq_len"] for pt in points]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    panels = (("peak_mib", "peak memory (MiB over weights)"), ("step_s", "training step (s)"))
    for ax, (key, ylabel) in zip(axes, panels, strict=True):
        for kind, label, marker in (("baseline", base_name, "o"), ("dcformer", "DCFormer", "s")):
            ax.plot(lens, [pt[kind][key] for pt in points], marker=marker, label=label)
        ax.set_xticks(lens, [str(n) for n in lens])
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80, metadata={"Software": None})
    plt.close(fig)
    return True


def run_sweep(args, dc_cfg: DCFormerConfig, base_name: str, opts: dict, command: str, progress) -> tuple[list, dict]:
    """The training step at each of `args.sweep_seq_lens`: report lines (also written to `--out-dir` with the
    plot) and the results."""
    t_start = time.perf_counter()
    load_before = load_average()
    points = []
    for seq_len in args.sweep_seq_lens:
        pt = sweep_point(seq_len, args, dc_cfg, opts)
        points.append(pt)
        progress(f"sweep T={seq_len}: step {base_name} {pt['baseline']['step_s']:.3f}s, DCFormer "
                 f"{pt['dcformer']['step_s']:.3f}s; peak {base_name} {pt['baseline']['peak_mib']:.1f} MiB, "
                 f"DCFormer {pt['dcformer']['peak_mib']:.1f} MiB")
    wall = time.perf_counter() - t_start

    os.makedirs(args.out_dir, exist_ok=True)
    layers = "" if args.layers is None else f"-{args.layers}layers"
    stem = os.path.join(args.out_dir, f"train_sweep_{os.path.splitext(os.path.basename(args.shape))[0]}{layers}")
    png, md = stem + ".png", stem + ".md"
    title = (f"training step (fwd+bwd), batch {args.batch_size}, {args.dtype}, {args.threads} thread(s): "
             f"shape {args.shape}")
    plotted = plot_sweep(points, base_name, title, png)

    b = base_name
    few = [pt["seq_len"] for pt in points if pt["repeats"] != args.repeats]
    long = f" (at T={','.join(map(str, few))}: 1 run each)" if few else ""
    lines = [
        f"## Training step vs sequence length, DCFormer vs {b}: `{command}`",
        "",
        f"- {environment(args)}",
        f"- shape `{args.shape}`: {describe(dc_cfg)}",
        (f"- {b}: same shape, `attn_implementation=\"sdpa\"`; DCFormer: its own DCMHA attention "
         f"(query chunks of {dc_cfg.attention_chunk_size})"),
        (f"- training step: train mode, forward, loss on all T tokens, backward; batch {args.batch_size}; "
         "no optimizer step (its cost per parameter is the same in both models)"),
        (f"- time: per T one fresh process holds both models, 1 warm-up each, then {args.repeats} runs interleaved, "
         f"median{long}; peak memory: one step per model and T in a fresh process after a warm-up step, peak "
         f"resident set size minus the resident set size before the step ({points[0]['baseline']['memory_method']}), "
         "gradients included"),
        f"- load average (1/5/15 min) before: {load_before}, after: {load_average()}",
        "",
        f"| T | step time {b} (s) | step time DCFormer (s) | ratio | peak MiB {b} | peak MiB DCFormer | ratio |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for pt in points:
        base, dc = pt["baseline"], pt["dcformer"]
        lines.append(f"| {pt['seq_len']} | {base['step_s']:.3f} | {dc['step_s']:.3f} | {fmt_ratio(pt['time_ratio'])} | "
                     f"{base['peak_mib']:.1f} | {dc['peak_mib']:.1f} | {fmt_ratio(pt['memory_ratio'])} |")
    lines += [
        "",
        "Ratios are DCFormer / " + b + "; peak MiB is above the weights.",
        "Timed runs (s): " + "; ".join(
            f"T={pt['seq_len']} {b if k == 'baseline' else 'DCFormer'}: "
            + ", ".join(f"{t:.3f}" for t in pt[k]["times"]) for pt in points for k in ("baseline", "dcformer")),
        f"Sweep wall time: {wall:.0f} s",
        f"Table: `{shown_path(md)}`; plot: "
        + (f"`{shown_path(png)}`" if plotted else "none (matplotlib is not installed)"),
    ]
    with open(md, "w") as f:
        f.write("\n".join(lines) + "\n")
        if plotted:
            f.write(f"\n![peak memory and step time against the sequence length]({os.path.basename(png)})\n")
    summary = dict(command=command, torch=torch.__version__, transformers=transformers.__version__,
                   threads=args.threads, dtype=args.dtype, shape=args.shape, baseline=base_name,
                   sweep=dict(step="train mode: forward + loss + backward, no optimizer step",
                              batch_size=args.batch_size, seq_lens=args.sweep_seq_lens, points=points, table=md,
                              plot=png if plotted else None),
                   wall_s=wall)
    return lines, summary


def run_benchmark(argv=None, out=sys.stdout, log=sys.stderr) -> dict:
    """Runs the benchmark, prints the report to `out` (progress to `log`), returns the results."""
    args = parse_args(argv)
    t_start = time.perf_counter()
    dc_cfg = dcformer_config(args)
    base_name, _ = baseline_config(dc_cfg)
    opts = dict(threads=args.threads, dtype=args.dtype, batch_size=args.batch_size, seq_len=args.seq_len,
                decode_prompt=args.decode_prompt, decode_new=args.decode_new, repeats=args.repeats,
                malloc=args.malloc, cache=args.cache, compile_static=args.compile_static)
    argv_list = sys.argv[1:] if argv is None else list(argv)
    command = " ".join(["python", "benchmarks/bench_model.py", *map(shlex.quote, argv_list)])
    load_before = load_average()

    def say(line=""):
        print(line, file=out, flush=True)

    def progress(line):
        if log is not None:
            print(f"[bench {time.perf_counter() - t_start:6.1f}s] {line}", file=log, flush=True)

    if args.sweep:
        lines, summary = run_sweep(args, dc_cfg, base_name, opts, command, progress)
        for line in lines:
            say(line)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=2)
        return summary

    timing, memory = {}, {}
    for phase in args.phases:
        timing[phase] = pooled([run_in_fresh_process(measure_time, phase, dc_cfg, opts) for _ in range(args.processes)])
        progress(f"{phase}: time {base_name} {timing[phase]['baseline']['median']:.3f}s, "
                 f"DCFormer {timing[phase]['dcformer']['median']:.3f}s")
        for kind in ("baseline", "dcformer"):
            memory[(kind, phase)] = run_in_fresh_process(measure_memory, kind, phase, dc_cfg, opts)
        progress(f"{phase}: peak {base_name} {memory[('baseline', phase)]['peak_bytes'] / MIB:.0f} MiB, "
                 f"DCFormer {memory[('dcformer', phase)]['peak_bytes'] / MIB:.0f} MiB")
    wall = time.perf_counter() - t_start

    first = timing[args.phases[0]]
    rows = [("parameters (M)", first["baseline"]["params"] / 1e6, first["dcformer"]["params"] / 1e6, "{:.1f}"),
            ("weights (MiB)", first["baseline"]["weight_bytes"] / MIB, first["dcformer"]["weight_bytes"] / MIB, "{:.1f}")]
    bxt = f"{args.batch_size}x{args.seq_len}"
    time_ratios = {}  # per row: the median of the processes' ratios
    process_ratios = {}  # per phase: each process's ratio, in the direction the table shows (decode: tokens/s)
    for phase in args.phases:
        b, d = timing[phase]["baseline"]["median"], timing[phase]["dcformer"]["median"]
        per_process = timing[phase]["process_ratios"]
        if phase == "prefill":
            rows.append((f"prefill {bxt} (s, lower is better)", b, d, "{:.3f}"))
        elif phase == "train":
            rows.append((f"fwd+bwd {bxt} (s, lower is better)", b, d, "{:.3f}"))
        else:
            n = args.decode_new * args.batch_size
            rows.append((f"decode {args.decode_prompt}+{args.decode_new} (new tokens/s, higher is better)",
                         n / b, n / d, "{:.1f}" if min(n / b, n / d) >= 10 else "{:.3f}"))
            per_process = [1 / r for r in per_process]  # tokens/s: the inverse of the time ratio
        process_ratios[phase] = per_process
        time_ratios[rows[-1][0]] = statistics.median(per_process)
    mem_label = {"prefill": "prefill", "train": "fwd+bwd", "decode": "decode"}
    for phase in args.phases:
        rows.append((f"peak memory, {mem_label[phase]} (MiB over weights)", memory[("baseline", phase)]["peak_bytes"] / MIB,
                     memory[("dcformer", phase)]["peak_bytes"] / MIB, "{:.0f}"))

    say(f"## DCFormer vs {base_name}: `{command}`")
    say()
    say(f"- {environment(args)}")
    say(f"- shape `{args.shape}`: {describe(dc_cfg)}")
    say(f"- {base_name}: same shape, `attn_implementation=\"sdpa\"`; DCFormer: its own DCMHA attention "
        f"(query chunks of {dc_cfg.attention_chunk_size})")
    parts = {"prefill": "prefill (logits of the last position, cache filled)",
             "train": "fwd+bwd (train mode, loss + backward, no optimizer)"}
    measured = [parts[ph] for ph in args.phases if ph in parts]
    described = [f"{' and '.join(measured)} on {args.seq_len} tokens"] if measured else []
    if "decode" in args.phases:
        described.append(
            f"decode: greedy `generate`, {args.decode_prompt} prompt + {args.decode_new} new tokens, use_cache "
            f"({args.cache} cache), prompt included"
            + ("; forward under `torch.compile` (default options), compiled in the warm-up run"
               if args.compile_static else ""))
    say(f"- batch {args.batch_size}; " + "; ".join(described))
    if args.processes == 1:
        say(f"- time: per phase one fresh process holds both models, 1 warm-up each, then {args.repeats} runs "
            f"interleaved, median; memory: one run after a warm-up run in a fresh process per model and phase")
    else:
        say(f"- time: per phase {args.processes} fresh processes one after the other, each holding both models, 1 "
            f"warm-up each, then {args.repeats} runs interleaved; a process's ratio is that of its medians, the "
            f"table's time ratio the median of the processes' ratios (its times: the median of their medians); "
            f"memory: one run after a warm-up run in a fresh process per model and phase")
    say(f"- load average (1/5/15 min) before: {load_before}, after: {load_average()}")
    say()
    say(f"| metric | {base_name} | DCFormer | ratio DCFormer/{base_name} |")
    say("| --- | ---: | ---: | ---: |")
    table = []
    for label, bv, dv, fmt in rows:
        ratio = dv / bv if float(fmt.format(bv)) else float("nan")  # n/a over a baseline shown as 0
        ratio = time_ratios.get(label, ratio)
        table.append(dict(metric=label, baseline=bv, dcformer=dv, ratio=ratio))
        say(f"| {label} | {fmt.format(bv)} | {fmt.format(dv)} | {fmt_ratio(ratio)} |")
    say()
    method = memory[("baseline", args.phases[0])]["memory_method"]
    say(f"Peak memory: peak resident set size during the run minus the resident set size before it (model built, "
        f"one warm-up run done, so torch.compile's compilation is left out; {method}); fwd+bwd includes the gradients.")
    say("Timed runs (s): " + "; ".join(
        f"{base_name if k == 'baseline' else 'DCFormer'} {ph}: " + ", ".join(f"{t:.3f}" for t in timing[ph][k]["times"])
        for ph in args.phases for k in ("baseline", "dcformer")))
    if args.processes > 1:
        say("Ratio of each timing process (DCFormer / " + base_name + "; decode in tokens/s): " + "; ".join(
            f"{ph}: " + ", ".join(f"{r:.3f}" for r in process_ratios[ph]) for ph in args.phases))
    say(f"Benchmark wall time: {wall:.0f} s")

    summary = dict(command=command, torch=torch.__version__, transformers=transformers.__version__,
                   threads=args.threads, dtype=args.dtype, shape=args.shape, baseline=base_name, rows=table,
                   layers=dc_cfg.num_hidden_layers, vocab_size=dc_cfg.vocab_size, cache=args.cache,
                   compile_static=args.compile_static, processes=args.processes,
                   process_ratios=process_ratios,
                   ratios={ph: table[2 + i]["ratio"] for i, ph in enumerate(args.phases)},
                   memory_ratios={ph: table[2 + len(args.phases) + i]["ratio"] for i, ph in enumerate(args.phases)},
                   wall_s=wall)
    if args.profile:
        say()
        say(f"### DCFormer prefill profile (top ops by self CPU time, {bxt})")
        say()
        say("```")
        say(run_in_fresh_process(profile_dcformer_prefill, dc_cfg, opts).rstrip())
        say("```")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return summary


def main(argv=None) -> int:
    run_benchmark(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
