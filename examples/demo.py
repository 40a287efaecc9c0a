#!/usr/bin/env python3
"""DCFormer in one minute, offline: a tiny model and a tiny tokenizer built here, generation, benchmark ratios.

    python examples/demo.py                  # what `make demo` runs
    python examples/demo.py --train-steps 0  # skip the short training: generate from random weights
    python examples/demo.py --no-bench       # skip benchmarks/bench_model.py --quick

Steps:
1. a byte-level BPE tokenizer trained with `tokenizers` on a few sentences written below, wrapped as a
   `transformers.PreTrainedTokenizerFast` (vocabulary within the preset's 512 entries; id 0 is
   `<|endoftext|>`, the preset's bos/eos as in Pythia);
2. a DCFormer from `configuration/dcformer-tiny.json` (hidden 64, 2 layers, 4 heads, window 16 on layer 0,
   qk-norm), trained for a few seconds on those sentences so that its greedy output is readable;
3. `generate()` from a prompt, greedy and sampled, with the KV cache (and a check that the cached greedy
   decode equals decoding without cache);
4. `benchmarks/bench_model.py --quick`: DCFormer vs GPT-NeoX of the same tiny shape, ratios printed.
Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # the package is used from the checkout, installed or not
    sys.path.insert(0, ROOT)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast  # noqa: E402

import modeling_dcformer  # noqa: E402,F401  (registers model_type "dcformer" with the Auto classes)
from modeling_dcformer import DCFormerConfig  # noqa: E402

PRESET = os.path.join(ROOT, "configuration", "dcformer-tiny.json")
BENCH = os.path.join(ROOT, "benchmarks", "bench_model.py")

SENTENCES = [
    "DCFormer composes attention heads with weights computed from the input.",
    "Dynamically composable multi-head attention mixes the heads before and after the softmax.",
    "The composition weights are low rank and diagonal, and they depend on the query and on the key.",
    "Local layers attend to the most recent keys of a window, global layers attend to every key.",
    "A cache keeps the keys, the values and the composition factors of every past token.",
    "The quick brown fox jumps over the lazy dog.",
    "Transformers generate text one token at a time, greedily or by sampling.",
    "Small models are fast to build, so tests and demos use them.",
    "Pythia is a suite of language models trained on the same data in the same order.",
    "The released DCPythia model has six point nine billion parameters.",
]


def build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on SENTENCES: every string can be encoded, ids stay below `vocab_size`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|padding|>"],  # ids 0 and 1, as in the Pythia tokenizer
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SENTENCES, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<|padding|>",
    )


def train(model, tokenizer, steps: int, seed: int = 0) -> list[float]:
    """A few Adam steps on SENTENCES (each ended by <|endoftext|>), in padded batches with a mask."""
    torch.manual_seed(seed)
    texts = [s + tokenizer.eos_token for s in SENTENCES]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    losses = []
    for _ in range(steps):
        loss = model(**batch, labels=labels, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.eval()
    return losses


def run_quick_bench() -> dict | None:
    """`benchmarks/bench_model.py --quick` in its own process (it forks its measuring processes, which must
    happen before a process has run torch ops); returns its JSON summary."""
    with tempfile.TemporaryDirectory() as tmp:
        out_json = os.path.join(tmp, "bench.json")
        proc = subprocess.run([sys.executable, BENCH, "--quick", "--json", out_json], cwd=ROOT,
                              capture_output=True, text=True)
        print(proc.stdout.rstrip())
        if proc.returncode != 0:
            print(proc.stderr[-4000:], file=sys.stderr)
            return None
        with open(out_json) as f:
            return json.load(f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--train-steps", type=int, default=150, help="AdamW steps on the built-in sentences (0: none)")
    p.add_argument("--prompt", default="The")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--no-bench", action="store_true", help="skip benchmarks/bench_model.py --quick")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    torch.set_num_threads(1)  # a tiny model: threads only cost synchronisation

    # 1. Tokenizer and model
    config = DCFormerConfig.from_json_file(PRESET)
    tokenizer = build_tokenizer(config.vocab_size)
    assert len(tokenizer) <= config.vocab_size, (len(tokenizer), config.vocab_size)
    assert tokenizer.eos_token_id == config.eos_token_id == 0
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    n_params = sum(p.numel() for p in model.parameters())
    n_dcmha = sum(p.numel() for n, p in model.named_parameters() if "dyn_w_proj" in n)
    print(f"== DCFormer demo (torch {torch.__version__}) ==")
    print(f"tokenizer: byte-level BPE, {len(tokenizer)} tokens (trained on {len(SENTENCES)} sentences)")
    print(f"model: {type(model).__name__} from {os.path.relpath(PRESET, ROOT)}: {n_params:,} parameters "
          f"({n_dcmha:,} in DCMHA's dw1/qkw/dd), layer types {config.layer_types}, window {config.window_size}")

    # 2. A few seconds of training, so that the greedy continuation is recognisable
    if args.train_steps > 0:
        t0 = time.perf_counter()
        losses = train(model, tokenizer, args.train_steps, seed=args.seed)
        print(f"trained {args.train_steps} steps in {time.perf_counter() - t0:.1f}s: "
              f"loss {losses[0]:.2f} -> {losses[-1]:.2f}")

    # 3. Generation
    inputs = tokenizer(args.prompt, return_tensors="pt")
    common = dict(max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.pad_token_id)
    with torch.inference_mode():
        greedy = model.generate(**inputs, do_sample=False, **common)
        greedy_nocache = model.generate(**inputs, do_sample=False, use_cache=False, **common)
        torch.manual_seed(args.seed)
        sampled = model.generate(**inputs, do_sample=True, temperature=1.0, top_k=40, num_return_sequences=3, **common)
    n_prompt = inputs["input_ids"].shape[1]
    print(f"\nprompt: {args.prompt!r}")
    print(f"greedy:  {tokenizer.decode(greedy[0], skip_special_tokens=True)!r}")
    for i, row in enumerate(sampled):
        print(f"sample {i}: {tokenizer.decode(row, skip_special_tokens=True)!r}")
    same = torch.equal(greedy, greedy_nocache)
    print(f"greedy with the DCFormer cache == greedy without cache: {same} "
          f"({greedy.shape[1] - n_prompt} new tokens)")
    if not same:
        print("WARNING: cached and uncached greedy decoding disagree", file=sys.stderr)

    # 4. Benchmark ratios
    if not args.no_bench:
        print("\n== benchmarks/bench_model.py --quick ==")
        summary = run_quick_bench()
        if summary is not None:
            ratios = ", ".join(f"{k} {v:.2f}x" for k, v in summary["ratios"].items())
            mem = ", ".join(f"{k} {v:.2f}x" for k, v in summary["memory_ratios"].items())
            print(f"\nDCFormer/{summary['baseline']} ratios (tiny shape; time for prefill and fwd+bwd, "
                  f"tokens/s for decode): {ratios}; peak memory: {mem}")
    print(f"\ndemo finished in {time.perf_counter() - t_start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
