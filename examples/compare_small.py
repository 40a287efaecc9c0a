#!/usr/bin/env python
"""A reproducible small-scale DCFormer (DCPythia) vs Transformer (Pythia / GPT-NeoX) comparison.

Both models have the Pythia body (LayerNorm, parallel residual, GELU MLP with biases, rotary on 25% of each
head, untied output head) and the same hidden size, layers, heads and vocabulary; the only difference is the
attention: plain multi-head attention (`GPTNeoXForCausalLM`, sdpa or eager) or DCMHA (`DCFormerForCausalLM`).
They are trained from the same seed, on the same examples in the same order, with the same `transformers.Trainer`
and `TrainingArguments` (cosine schedule, warmup, batch, steps, evaluation every k steps; the learning rate is the
same too unless `--dc-lr` or `--lr-sweep` gives each model its own).

Tasks (`--task`):
* `synthetic` (default): a mixture of two synthetic in-context tasks generated on the fly (`experiments.synthetic_tasks`),
  multi-query associative recall (MQAR) and two-hop fact composition, with the loss on the answer tokens only.
  Validation: a fixed held-out generated set per task; accuracy is the exact match of each answer token (greedy
  argmax given the true prefix), also per sequence (all answers right).
* `lm`: language modelling on real text (`experiments.lm_corpus`): by default the English documentation of Python as
  Debian ships it (`apt-get install python3.11-doc`), or any text files given with `--corpus`; split into train
  and validation by document; byte-level or trained BPE tokens; blocks of `--block-size` tokens. Reports the
  validation loss, perplexity and bits per byte over training, and training tokens per second.

The paper's recipe, for the DCFormer only, each part switchable: `--dc-init authors|normal` (the authors'
initialisation of dw1, qkw, dd is `DCFormerConfig`'s default), `--qk-norm`, `--window N --window-type LG` (the
local/global layers of the released configurations), and the warm-up (`--warmup`, for both models).

Diagnostics: `--lr-sweep 1e-3,3e-3,1e-2` trains every model at every rate with the first seed, then the other
seeds at each model's best rate; the RMS of the dynamic terms (w2 and the diagonal, per composition slot, on a fixed
probe batch) is logged at every evaluation; `--ablation` adds the DCFormer variants `static` (learned,
input-independent full-rank composition), `pre` (pre-softmax composition only), `post` (post-softmax only) and
`query-wise` (query-wise terms only); `--sizes 128/4,256/8,512/8` runs the comparison at several sizes and adds a
scaling table.

Seeds: `--seeds N` trains each model with model seeds 0..N-1 (initialisation); the training stream, its order
and the validation sets come from `--data-seed` alone, so they are the same for every model and seed, and the
spread over seeds is the spread due to initialisation.

Task sizes: the synthetic CPU default uses small symbol sets (MQAR: 2-8 pairs over 16 keys and 16 values; two-hop:
6-10 facts over 32 entities and 4 relations, 2 queries) because with 4-16 pairs over 64 symbols neither model gets
beyond guessing a value from the context in a CPU budget (measured: ~14% after 600 steps); raise them on a GPU.

Parameters: DCMHA adds about 20·D·N + 64·N² parameters a layer, which is under 1% at Pythia sizes but ~5% at
hidden 128 / 4 heads. `--param-match auto` (default) keeps the shapes identical when the counts are within 2%,
and otherwise widens the *Transformer's* MLP (never the DCFormer's) until they match; `none` keeps identical
shapes and fails when they are more than 2% apart. Both counts and the difference are printed.

    python examples/compare_small.py                      # synthetic, CPU default: 13 min on a loaded 2-core machine
    python examples/compare_small.py --task lm --steps 300 --block-size 128 --batch-size 16 --seeds 2
    python examples/compare_small.py --task lm --sizes 128/4,256/8,512/8 --lr-sweep 1e-3,3e-3 --device cuda --bf16

Writes into `--out` (default `compare_out/`): `results.md` (tables), `results.json` (every number, every eval of
every run), `curves.png` (validation curves, mean over seeds with the min-max band), `dyn_norms.png` (the dynamic
terms over training); with `--sizes`, one folder per size and `scaling.md`, `scaling.json`, `scaling.png`.

The code is the research distribution in research/ (`pip install -e research`, which `make install` does):
`dcformer_research.compare` (this command line), `.ablation` (the models and ablation variants), `.runner` (one
training run and the data), `.report` (statistics, tables, plots).
"""

from dcformer_research.compare import main

if __name__ == "__main__":
    main()
