#!/usr/bin/env python3
"""Where DCFormer's time goes at a given shape and dtype, next to GPT-NeoX of the same shape (docs/performance.md).

Both models (random weights, the DCPythia preset's layer shape with `--layers` layers and `--vocab` tokens) live in
one process on 1 torch thread; each phase runs them interleaved (A B B A ...) `--repeats` times after a warm-up and
prints the medians and DC/NeoX. `--profile` then prints, per model, torch.profiler's top CPU ops of one run of each
phase (self time, % of the run), which is what docs/performance.md quotes.

    python benchmarks/profile_shapes.py --preset dcpythia-pythia-6.9b --layers 2 --vocab 1024 --dtype bf16
    python benchmarks/profile_shapes.py --preset dcpythia-pythia-70m --seq-len 1024 --phases prefill,train --profile

Phases: prefill (`--seq-len` tokens under inference_mode, cache filled, logits of the last position), decode
(greedy `generate` of `--decode-new` tokens after `--decode-prompt`), train (loss + backward, no optimizer).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from bench_train_step import timed, top_ops  # one timer and profile table (benchmarks/ is on sys.path)
from modeling_dcformer import DCFormerConfig, DCFormerForCausalLM

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build(kind: str, dc: DCFormerConfig, dtype: torch.dtype):
    torch.manual_seed(0)
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
    length = args.decode_prompt if phase == "decode" else args.seq_len
    ids = torch.randint(0, vocab, (args.batch, length), generator=gen)
    model.train(phase == "train")
    if phase == "prefill":
        def step():
            with torch.inference_mode():
                model(input_ids=ids, use_cache=True, logits_to_keep=1)
    elif phase == "train":
        def step():
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            model.zero_grad(set_to_none=True)
    else:
        def step():
            with torch.inference_mode():
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.decode_new,
                               min_new_tokens=args.decode_new, do_sample=False)
    return step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="dcpythia-pythia-6.9b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--phases", default="prefill,decode")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--decode-prompt", type=int, default=8)
    p.add_argument("--decode-new", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--implementation", default=None, help="dcmha_implementation (default: the preset's, auto)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--rows", type=int, default=14)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    overrides = dict(num_hidden_layers=args.layers, vocab_size=args.vocab)
    if args.implementation:
        overrides["dcmha_implementation"] = args.implementation
    if args.seq_len > 2048:
        overrides["max_position_embeddings"] = args.seq_len
    dc = DCFormerConfig.from_preset(args.preset, **overrides)
    dtype = DTYPES[args.dtype]
    models = {kind: build(kind, dc, dtype) for kind in ("neox", "dcformer")}
    print(f"{args.preset} x{args.layers} layers, vocab {args.vocab}, {args.dtype}, batch {args.batch}, 1 thread, "
          f"median of {args.repeats} (shared machine: noisy)")
    for phase in args.phases.split(","):
        steps = {kind: make_step(m, phase, args, dc.vocab_size) for kind, m in models.items()}
        for step in steps.values():
            step()  # warm-up
        times = {kind: [] for kind in steps}
        for r in range(args.repeats):
            for kind in (("neox", "dcformer") if r % 2 == 0 else ("dcformer", "neox")):
                times[kind].append(timed(steps[kind]))
        med = {kind: statistics.median(t) for kind, t in times.items()}
        print(f"{phase:>8}: NeoX {med['neox'] * 1e3:9.1f} ms  DC {med['dcformer'] * 1e3:9.1f} ms  "
              f"DC/NeoX {med['dcformer'] / med['neox']:.3f}", flush=True)
        if args.profile:
            for kind, step in steps.items():
                print(f"  {phase} profile, {kind}:\n{top_ops(step, args.rows)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
