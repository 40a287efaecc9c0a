"""Evaluation of DCFormer models with lm-eval 0.4.13: see docs/evaluation.md.

- `modeling_dcformer.evals.harness` (`dcformer-eval`): lm-eval's command line with the `dcformer` model and the offline tasks of evals/tasks, and
  `evaluate(model, tokenizer, tasks, ...)` for notebooks and tests.
- `modeling_dcformer.evals.dcformer_lm`: the `dcformer` lm-eval model (a subclass of lm-eval's HFLM).
- `modeling_dcformer.evals.report`: results files -> a markdown table and a bar chart, beside published numbers.
"""
