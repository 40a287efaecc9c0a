"""The code behind the scripts in `examples/`, installed with the package so that the scripts stay short and the
tests import it by name:

* `train_clm`: causal-LM training with the `transformers` Trainer (console script `dcformer-train`; the accelerate
  configs it is launched with are package data: `dcformer-train --print-accelerate-config NAME`);
* `pipeline`: the steps of `examples/demo.py` (a tiny Pythia, conversion, fine-tuning, evaluation, saving,
  reloading with and without the package, generation);
* `compare`, `ablation`, `runner`, `report`: the small DCFormer vs Transformer comparison of
  `examples/compare_small.py` (its command line, models and ablation variants, one training run, statistics,
  tables and plots), with its data in
  `synthetic_tasks` and `lm_corpus` and its argparse types in `arguments`;
* `tokenizer_utils`: a tiny byte-level BPE tokenizer trained locally (no downloads).

None of it is imported by `modeling_dcformer.modeling_dcformer`, so none of it is copied into a saved model's
remote code. Importing `modeling_dcformer.experiments` imports nothing heavy; import the modules you need.
"""
