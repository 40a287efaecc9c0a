#!/usr/bin/env python3
"""Where DCFormer's time goes at a given shape and dtype, next to GPT-NeoX of the same shape (docs/performance.md).

Both models (random weights, the DCPythia preset's layer shape with `--layers` layers and `--vocab` tokens) live in
one process on 1 torch thread (or on a GPU: `--device cuda`, which also prints each phase's peak CUDA memory); each
phase runs them interleaved (A B B A ...) `--repeats` times after a warm-up and prints the medians and DC/NeoX.
`--profile` then prints, per model, torch.profiler's top ops of one run of each phase (self time, % of the run: CPU
time, or kernel time on CUDA), which is what docs/performance.md quotes; `--ops` counts the ATen ops and compiled-region
calls of one run (on any device: each is at least one kernel launch on a GPU, where small models are launch-bound).
`--parts` splits the timed runs' forward wall time by part of the decoder layers (forward hooks on every layer's
attention, its projections and MLP): where DCFormer's extra time is, without the profiler's per-op overhead, which
changes the ratio it measures (docs/performance.md).

    python benchmarks/profile_shapes.py --preset dcpythia-pythia-6.9b --layers 2 --vocab 1024 --dtype bf16
    python benchmarks/profile_shapes.py --preset dcpythia-pythia-70m --seq-len 1024 --phases prefill,train --profile
    python benchmarks/profile_shapes.py --device cuda --layers 32 --vocab 50432 --seq-len 2048  # the whole 6.9B shape
    python benchmarks/profile_shapes.py --device cuda --implementation auto,triton  # each against NeoX, interleaved
    python benchmarks/profile_shapes.py --device cuda --implementation triton,triton@c256,triton@8x32  # the sweep
    python benchmarks/profile_shapes.py --preset dcpythia-pythia-160m --layers 12 --dtype fp32 --phases prefill \
        --seq-len 1024 --repeats 4 --parts  # attention, projections, MLP: each model's seconds a run

Phases: prefill (`--seq-len` tokens under inference_mode, cache filled, logits of the last position), decode
(greedy `generate` of `--decode-new` tokens after `--decode-prompt`), decode-static (the same with
`cache_implementation="static"`, which generate() compiles by itself, here on every device; the warm-up
compiles), step (`--decode-new` forward calls of one token against the
cache of `--decode-prompt` tokens, each cropped back: one layer's decode step, from the model's own forward, without
generate()), train (loss + backward, no optimizer). `--decode-implementation` times the decoding phases (decode,
decode-static, step) with other implementations than `--implementation` (say "triton" for prefill and training,
"auto" for decoding); `--json OUT` writes every phase's medians, ratios and peaks (rewritten after each phase).

    python benchmarks/profile_shapes.py --preset dcpythia-pythia-70m --layers 1 --vocab 512 --dtype fp32 \
        --phases step --decode-prompt 192 --decode-new 200 --repeats 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import CompileConfig, DynamicCache, GPTNeoXConfig, GPTNeoXForCausalLM

# one timer, profile table and --implementation for both scripts (benchmarks/ is on sys.path)
from bench_train_step import implementation_list, timed, top_ops, where, with_implementation
from modeling_dcformer import DCFormerCache, DCFormerConfig, DCFormerForCausalLM
from modeling_dcformer.modeling_dcformer import CACHE_NAME

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PHASES = ("prefill", "train", "decode", "decode-static", "step")
DECODING = ("decode", "decode-static", "step")  # timed with --decode-implementation where given


def build(kind: str, dc: DCFormerConfig, dtype: torch.dtype, device: torch.device):
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype and where it runs: a 6.9B-shape model takes seconds on a GPU
    try:
        with device:
            return _build(kind, dc, dtype)
    finally:
        torch.set_default_dtype(default)


def _build(kind: str, dc: DCFormerConfig, dtype: torch.dtype):
    if kind == "dcformer":
        model = DCFormerForCausalLM(dc)
    else:
        cfg = GPTNeoXConfig(
            vocab_size=dc.vocab_size, hidden_size=dc.hidden_size, num_hidden_layers=dc.num_hidden_layers,
            num_attention_heads=dc.num_attention_heads, intermediate_size=dc.intermediate_size,
            max_position_embeddings=dc.max_position_embeddings, hidden_act=dc.hidden_act,
            attention_bias=dc.attention_bias, tie_word_embeddings=dc.tie_word_embeddings,
            layer_norm_eps=dc.layer_norm_eps, use_parallel_residual=dc.use_parallel_residual,
            partial_rotary_factor=dc.partial_rotary_factor, rope_theta=dc.rope_theta,
        )  # fmt: skip
        model = GPTNeoXForCausalLM._from_config(cfg, attn_implementation="sdpa")
    model = model.to(dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def make_step(model, phase: str, args, vocab: int):
    gen = torch.Generator().manual_seed(1)
    length = args.decode_prompt if phase in DECODING else args.seq_len
    ids = torch.randint(0, vocab, (args.batch, length), generator=gen).to(model.device)
    model.train(phase == "train")
    if phase == "prefill":
        def step():
            with torch.inference_mode():
                model(input_ids=ids, use_cache=True, logits_to_keep=1)
    elif phase == "train":
        def step():
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            model.zero_grad(set_to_none=True)
    elif phase == "step":  # single decode steps against the prompt's cache, each cropped back: no logits dilution
        dc = isinstance(model, DCFormerForCausalLM)
        cache = DCFormerCache(model.config) if dc else DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=ids, use_cache=True, **{CACHE_NAME: cache})
        token, position = ids[:, -1:], torch.full((args.batch, 1), length, device=ids.device)

        def step():
            with torch.inference_mode():
                for _ in range(args.decode_new):
                    model(input_ids=token, position_ids=position, use_cache=True, **{CACHE_NAME: cache})
                    cache.crop(-1)

        step.cache = cache  # for a look after the runs
    elif phase == "decode-static":
        compile_config = CompileConfig()  # what generate() uses on a GPU (Inductor, CUDA graphs there)
        compile_config._compile_all_devices = True  # and on any other device: generate() compiles by itself

        def step():  # the warm-up run compiles the decoding step; the model's forward stays its own
            with torch.inference_mode():
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.decode_new,
                               min_new_tokens=args.decode_new, do_sample=False, cache_implementation="static",
                               compile_config=compile_config)
    else:
        def step():
            with torch.inference_mode():
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.decode_new,
                               min_new_tokens=args.decode_new, do_sample=False)
    return step


# ATen ops that launch no kernel on a GPU (views, metadata, allocation), left out of `--ops`' counts
NO_LAUNCH = {
    "aten::view", "aten::as_strided", "aten::_unsafe_view", "aten::reshape", "aten::_reshape_alias", "aten::view_as",
    "aten::expand", "aten::slice", "aten::select", "aten::transpose", "aten::t", "aten::unsqueeze", "aten::squeeze",
    "aten::permute", "aten::detach", "aten::alias", "aten::unbind", "aten::split", "aten::split_with_sizes",
    "aten::chunk", "aten::narrow", "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty",
    "aten::new_empty_strided", "aten::resolve_conj", "aten::resolve_neg",
    "aten::lift_fresh", "aten::contiguous", "aten::result_type", "aten::size", "aten::stride",
}  # fmt: skip


def count_ops(step) -> tuple[int, int]:
    """(ATen ops called from Python, not from inside another ATen op, that can launch a kernel; calls of compiled
    regions) of one call of `step`, recorded on the CPU: about what a GPU would launch (docs/benchmarks.md)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = prof.events()
    nested = lambda e: e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")  # noqa: E731
    top = [e for e in events if e.name.startswith("aten::") and not nested(e)]
    regions = sum(1 for e in events if e.name.startswith("Torch-Compiled Region"))
    return sum(1 for e in top if e.name not in NO_LAUNCH), regions


# module paths inside a decoder layer -> the part `--parts` times; the projections are inside the attention module
LAYER_PARTS = {
    "neox": {"attention": "attention", "attention.query_key_value": "q/k/v projection",
             "attention.dense": "output projection", "mlp": "MLP"},
    "dcformer": {"self_attn": "attention", "self_attn.qkv_proj": "q/k/v projection",
                 "self_attn.o_proj": "output projection", "self_attn.dyn_w_proj": "dynamic-weight projection",
                 "mlp": "MLP"},
}
PROJECTIONS = ("q/k/v projection", "output projection", "dynamic-weight projection")


class PartTimer:
    """Forward wall time per part of every decoder layer (`LAYER_PARTS`), summed under the name of the step being
    run (`timing(name, step)`): forward hooks, synchronising first on a GPU. The backward pass is not split."""

    def __init__(self, models: dict, device: torch.device):
        self.device, self.current = device, None
        self.seconds = defaultdict(lambda: defaultdict(float))
        self._started, self._handles = {}, []
        for kind, model in models.items():
            for layer in model.base_model.layers:
                for path, part in LAYER_PARTS[kind].items():
                    module = layer.get_submodule(path)
                    self._handles.append(module.register_forward_pre_hook(self._start))
                    self._handles.append(module.register_forward_hook(lambda m, a, o, part=part: self._stop(m, part)))

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _start(self, module, args):
        if self.current is not None:
            self._started[id(module)] = self._now()

    def _stop(self, module, part: str):
        if self.current is not None:
            self.seconds[self.current][part] += self._now() - self._started.pop(id(module))

    def timing(self, name: str, step):
        """`step` with its runs' part times summed under `name`."""
        def timed_step():
            self.current = name
            try:
                step()
            finally:
                self.current = None
        return timed_step

    def remove(self):
        for handle in self._handles:
            handle.remove()

    def table(self, times: dict[str, list[float]]) -> str:
        """Seconds a run per part and name, given each name's timed runs (`times`, in which the parts were summed),
        with "attention: the rest" (the attention less its projections: DCMHA or SDPA, rotary, the cache) and
        "outside" (the run less the attention and MLP), and each name's difference to the first name's."""
        rows = ["attention", *PROJECTIONS, "attention: the rest", "MLP", "outside (embedding, norms, head, Python)",
                "total"]
        names, per_run = list(times), {}
        for name in names:
            sec = {part: value / len(times[name]) for part, value in self.seconds[name].items()}
            sec["total"] = statistics.mean(times[name])
            sec["attention: the rest"] = sec.get("attention", 0.0) - sum(sec.get(p, 0.0) for p in PROJECTIONS)
            outside = sec["total"] - sec.get("attention", 0.0) - sec.get("MLP", 0.0)
            sec["outside (embedding, norms, head, Python)"] = outside
            per_run[name] = sec
        first = names[0]
        header = f"    {'part (forward, s a run)':<42}" + "".join(f"{n:>10}" for n in names)
        header += "".join(f"{n + '-' + first:>16}" for n in names[1:])
        lines = [header]
        for part in rows:
            cells = "".join(f"{per_run[n].get(part, 0.0):10.4f}" for n in names)
            cells += "".join(f"{per_run[n].get(part, 0.0) - per_run[first].get(part, 0.0):+16.4f}" for n in names[1:])
            lines.append(f"    {part:<42}{cells}")
        return "\n".join(lines)


def peak_cuda_mib(step, device: torch.device) -> float:
    """The most CUDA memory one run of `step` held above what was allocated before it (weights, cached state), MiB."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="dcpythia-pythia-6.9b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--device", default="cpu", help="cpu (1 torch thread) or cuda")
    p.add_argument("--phases", default="prefill,decode", help="comma-separated: " + ", ".join(PHASES))
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--decode-prompt", type=int, default=8)
    p.add_argument("--decode-new", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--implementation", default=None, type=implementation_list,
                   help="dcmha_implementation, or several comma-separated (one model, each timed; default: auto); "
                        "triton@cN: chunks of N queries, triton@RxBS: tiles of R rows x BS keys")
    p.add_argument("--decode-implementation", default=None, type=implementation_list,
                   help="the same for the decoding phases (decode, decode-static, step; default: --implementation's)")
    p.add_argument("--attention-chunk-size", type=int, default=None,
                   help="queries attended at a time by the chunked implementations (default: the preset's, 128)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--ops", action="store_true",
                   help="also count the ATen ops and compiled calls of one run of each model (what a GPU launches)")
    p.add_argument("--rows", type=int, default=14)
    p.add_argument("--parts", action="store_true",
                   help="split the timed runs' forward wall time by part of the decoder layers (attention, its "
                        "projections, MLP), each model's seconds a run (forward hooks; the backward is not split)")
    p.add_argument("--json", default=None, help="also write each phase's medians, ratios and peaks to this file")
    args = p.parse_args(argv)
    unknown = [phase for phase in args.phases.split(",") if phase not in PHASES]
    if unknown:
        p.error(f"--phases: unknown {', '.join(unknown)} ({', '.join(PHASES)})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    overrides = dict(num_hidden_layers=args.layers, vocab_size=args.vocab)
    if args.seq_len > 2048:
        overrides["max_position_embeddings"] = args.seq_len
    if args.attention_chunk_size:
        overrides["attention_chunk_size"] = args.attention_chunk_size
    dc = DCFormerConfig.from_preset(args.preset, **overrides)
    dtype, device = DTYPES[args.dtype], torch.device(args.device)
    models = {kind: build(kind, dc, dtype, device) for kind in ("neox", "dcformer")}
    print(f"{args.preset} x{args.layers} layers, vocab {args.vocab}, {args.dtype}, batch {args.batch}, "
          f"chunks of {dc.attention_chunk_size} queries, {where(device, 1)}, median of {args.repeats}")
    summary = dict(preset=args.preset, layers=args.layers, vocab=args.vocab, dtype=args.dtype, batch=args.batch,
                   seq_len=args.seq_len, decode_prompt=args.decode_prompt, decode_new=args.decode_new,
                   device=where(device, 1), repeats=args.repeats, phases=[])  # fmt: skip
    for phase in args.phases.split(","):
        implementations = args.implementation or [dc.dcmha_implementation]
        if phase in DECODING and args.decode_implementation:
            implementations = args.decode_implementation
        # the DCFormer model once per implementation ("DC" alone when there is one); all interleaved with NeoX
        names = {impl: "DC" if len(implementations) == 1 else f"DC[{impl}]" for impl in implementations}
        steps = {"NeoX": make_step(models["neox"], phase, args, dc.vocab_size)}
        for impl in implementations:
            steps[names[impl]] = with_implementation(models["dcformer"], impl,
                                                     make_step(models["dcformer"], phase, args, dc.vocab_size))
        for kind, step in list(steps.items()):
            try:
                step()  # warm-up
            except Exception as err:  # one implementation that cannot run here (a tile too big for the GPU, ...)
                if kind == "NeoX":
                    raise
                print(f"{phase:>8}: {kind} failed, left out: {type(err).__name__}: {str(err)[:300]}", flush=True)
                del steps[kind]
        parts = PartTimer(models, device) if args.parts else None
        runs = {kind: parts.timing(kind, step) if parts else step for kind, step in steps.items()}
        times = {kind: [] for kind in steps}
        try:
            for r in range(args.repeats):
                for kind in (list(steps) if r % 2 == 0 else list(reversed(steps))):
                    times[kind].append(timed(runs[kind], device))
        finally:
            if parts:
                parts.remove()
        med = {kind: statistics.median(t) for kind, t in times.items()}
        cells = [f"{kind} {med[kind] * 1e3:9.1f} ms" for kind in steps]
        ratios = [f"{kind}/NeoX {med[kind] / med['NeoX']:.3f}" for kind in steps if kind != "NeoX"]
        print(f"{phase:>8}: {'  '.join(cells)}  {'  '.join(ratios)}", flush=True)
        record = dict(phase=phase, implementations={names[i]: i for i in implementations if names[i] in steps},
                      ms={kind: med[kind] * 1e3 for kind in steps},
                      ratio={kind: med[kind] / med["NeoX"] for kind in steps if kind != "NeoX"})  # fmt: skip
        summary["phases"].append(record)
        if parts:
            print(parts.table(times), flush=True)
        if device.type == "cuda":
            peak = {kind: peak_cuda_mib(step, device) for kind, step in steps.items()}
            cells = [f"{kind} {peak[kind]:.0f} MiB" for kind in steps]
            ratios = [f"{kind}/NeoX {peak[kind] / max(peak['NeoX'], 1e-9):.3f}" for kind in steps if kind != "NeoX"]
            print(f"{'':>8}  peak CUDA memory above the weights: {'  '.join(cells)}  {'  '.join(ratios)}", flush=True)
            record["peak_mib"] = peak
        if args.ops:
            counts = {kind: count_ops(step) for kind, step in steps.items()}
            cells = [f"{kind} {ops} ops + {regions} compiled calls" for kind, (ops, regions) in counts.items()]
            print(f"{'':>8}  per run: {'  '.join(cells)}", flush=True)
        if args.profile:
            for kind, step in steps.items():
                print(f"  {phase} profile, {kind}:\n{top_ops(step, args.rows, device)}", flush=True)
        if args.json:  # after every phase: a run cut short by a time limit keeps the phases it finished
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
