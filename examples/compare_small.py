#!/usr/bin/env python
"""A reproducible small-scale DCFormer (DCPythia) vs Transformer (Pythia / GPT-NeoX) comparison.

Both models have the Pythia body (LayerNorm, parallel residual, GELU MLP with biases, rotary on 25% of each
head, untied output head) and the same hidden size, layers, heads and vocabulary; the only difference is the
attention: plain multi-head attention (`GPTNeoXForCausalLM`, sdpa or eager) or DCMHA (`DCFormerForCausalLM`,
every layer global, no qk-norm, the `dcpythia-pythia-*` presets' options). They are trained from the same seed,
on the same examples in the same order, with the same `transformers.Trainer` and `TrainingArguments` (learning
rate, cosine schedule, warmup, batch, steps, evaluation every k steps), on a mixture of two synthetic in-context
tasks generated on the fly (see `synthetic_tasks.py`): multi-query associative recall (MQAR) and two-hop
fact composition. The loss is on the answer tokens only (labels -100 elsewhere: the contexts are random and
unpredictable, only the answers can be learnt). Validation: a fixed held-out generated set per task;
accuracy is the exact match of each answer token (greedy argmax given the true prefix; every answer is one
token), also reported per sequence (all answers right).

Seeds: `--seeds N` trains each model with model seeds 0..N-1 (initialisation); the training stream, its order
and the validation sets come from `--data-seed` alone, so they are the same for every model and seed, and the
spread over seeds is the spread due to initialisation.

Task sizes: the CPU default uses small symbol sets (MQAR: 2-8 pairs over 16 keys and 16 values; two-hop: 6-10
facts over 32 entities and 4 relations, 2 queries) because with 4-16 pairs over 64 symbols neither model gets
beyond guessing a value from the context in a CPU budget (measured: ~14% after 600 steps); raise them on a GPU.

Parameters: DCMHA adds about 20·D·N + 64·N² parameters a layer, which is under 1% at Pythia sizes but ~5% at
hidden 128 / 4 heads. `--param-match auto` (default) keeps the shapes identical when the counts are within 2%,
and otherwise widens the *Transformer's* MLP (never the DCFormer's) until they match; `none` keeps identical
shapes and fails when they are more than 2% apart. Both counts and the difference are printed.

    python examples/compare_small.py                      # CPU default: 13 min on 1 thread of a loaded 2-core machine
    python examples/compare_small.py --steps 3000 --seeds 5 --shape configuration/dcpythia-pythia-70m.json \\
        --batch-size 128 --device cuda --bf16 --out compare_70m

Writes into `--out` (default `compare_out/`): `results.md` (table), `results.json` (every number, every eval of
every run), `curves.png` (validation loss and accuracy, mean over seeds with the min-max band).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, Trainer, TrainingArguments, set_seed
from transformers.utils import logging as hf_logging

import modeling_dcformer  # noqa: F401
import modeling_dcformer.configuration
from modeling_dcformer import DCFormerConfig, DCFormerForCausalLM
from synthetic_tasks import TASKS, PadCollator, SyntheticDataset, TaskConfig, TaskVocab

PRESET_DIR = Path(modeling_dcformer.configuration.__file__).parent  # the presets, installed with the package

logger = hf_logging.get_logger("dcformer.compare_small")

MODELS = ("transformer", "dcformer")
LABELS = {"transformer": "Transformer (GPT-NeoX)", "dcformer": "DCFormer (DCMHA)"}
MAX_PARAM_GAP = 0.02
SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


# ----------------------------------------------------------------------------------------------------------------
# Command line


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def seed_list(text: str) -> list[int]:
    """'3' -> [0, 1, 2] (a count); '0,5,7' -> [0, 5, 7] (explicit seeds)."""
    try:
        if "," in text:
            seeds = [int(s) for s in text.split(",") if s.strip()]
            if len(set(seeds)) != len(seeds) or any(s < 0 for s in seeds) or not seeds:
                raise ValueError
            return seeds
        return list(range(positive_int(text)))
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(
            f"--seeds takes a count (3 -> seeds 0,1,2) or distinct non-negative seeds separated by commas, got {text!r}"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Train a Pythia-style Transformer and the DCPythia of the same shape on synthetic in-context "
        "tasks (MQAR, two-hop) with the same Trainer setup, several seeds; write results.md, results.json, curves.png.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("shape (both models)")
    g.add_argument(
        "--shape",
        help="a config JSON (e.g. configuration/dcpythia-pythia-70m.json) or a preset name "
        "(configuration/NAME.json): its hidden_size, num_hidden_layers, num_attention_heads, "
        "intermediate_size are used (the body stays Pythia's, the vocabulary is the tasks'); the flags "
        "below override it",
    )
    g.add_argument("--hidden", type=positive_int, help="hidden size (default 128 without --shape)")
    g.add_argument("--layers", type=positive_int, help="layers (default 3 without --shape)")
    g.add_argument("--heads", type=positive_int, help="attention heads (default 4 without --shape)")
    g.add_argument("--intermediate", type=positive_int, help="MLP width (default 4 x hidden)")
    g.add_argument(
        "--param-match",
        choices=("auto", "none", "mlp"),
        default="auto",
        help="auto: identical shapes if the parameter counts are within 2%%, else widen the Transformer's "
        "MLP to match; none: identical shapes, fail if > 2%% apart; mlp: always widen the Transformer's MLP",
    )
    g.add_argument(
        "--baseline-attn",
        choices=("sdpa", "eager"),
        default="sdpa",
        help="attn_implementation of the GPT-NeoX baseline",
    )
    g.add_argument(
        "--dc-overrides",
        default="",
        help="DCFormerConfig options for the DC model, e.g. 'query_wise=true,dynamic_rank=1' (JSON values)",
    )

    g = p.add_argument_group("training (the same for both models)")
    g.add_argument("--steps", type=positive_int, default=800, help="optimizer steps (one pass over fresh examples)")
    g.add_argument("--batch-size", type=positive_int, default=32, help="sequences per step")
    g.add_argument("--lr", type=positive_float, default=3e-3, help="peak learning rate (AdamW)")
    g.add_argument("--warmup", type=non_negative_int, default=80, help="linear warmup steps")
    g.add_argument("--schedule", default="cosine", help="lr_scheduler_type of TrainingArguments")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--eval-every", type=positive_int, default=100, help="evaluate on the validation sets every k steps")
    g.add_argument("--val-size", type=positive_int, default=256, help="validation sequences per task")
    g.add_argument("--eval-batch-size", type=positive_int, default=128)
    g.add_argument(
        "--seeds",
        type=seed_list,
        default=seed_list("3"),
        help="model seeds: a count N (seeds 0..N-1) or a comma-separated list",
    )
    g.add_argument(
        "--models",
        default="transformer,dcformer",
        help="which models to train (both for a comparison; one alone for quick tuning)",
    )
    g.add_argument(
        "--data-seed",
        type=int,
        default=1234,
        help="seed of the training stream and of the validation sets (the same for every model seed)",
    )

    g = p.add_argument_group("tasks")
    g.add_argument(
        "--tasks", default="mqar,twohop", help=f"comma-separated, from {', '.join(TASKS)}; trained as a mixture"
    )
    g.add_argument("--mqar-pairs", default="2-8", help="key-value pairs per MQAR sequence, uniform in LO-HI")
    g.add_argument("--mqar-keys", type=positive_int, default=16, help="MQAR key symbols")
    g.add_argument("--mqar-values", type=positive_int, default=16, help="MQAR value symbols")
    g.add_argument("--twohop-facts", default="6-10", help="facts per two-hop context (targets + distractors), LO-HI")
    g.add_argument("--twohop-queries", type=positive_int, default=2, help="two-hop queries per context")
    g.add_argument("--twohop-entities", type=positive_int, default=32, help="two-hop entity symbols")
    g.add_argument("--twohop-relations", type=positive_int, default=4, help="two-hop relation symbols")

    g = p.add_argument_group("hardware and output")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    g.add_argument("--bf16", action="store_true", help="bf16 mixed precision (TrainingArguments.bf16)")
    g.add_argument(
        "--threads", type=positive_int, default=1, help="torch CPU threads (1 gives stable timings on a shared machine)"
    )
    g.add_argument("--out", default="compare_out", help="output directory")
    g.add_argument("--quiet", action="store_true", help="no progress bars")
    g.add_argument(
        "--report-only",
        action="store_true",
        help="train nothing: rebuild results.md and curves.png from --out/results.json (e.g. of an "
        "interrupted run: the runs finished so far are kept there)",
    )
    return p


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks or any(t not in TASKS for t in tasks) or len(set(tasks)) != len(tasks):
        parser.error(f"--tasks: a comma-separated subset of {', '.join(TASKS)}, got {args.tasks!r}")
    args.tasks = tasks
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models or any(m not in MODELS for m in models) or len(set(models)) != len(models):
        parser.error(f"--models: a comma-separated subset of {', '.join(MODELS)}, got {args.models!r}")
    args.models = [m for m in MODELS if m in models]
    try:
        args.task_config = TaskConfig(
            mqar_keys=args.mqar_keys,
            mqar_values=args.mqar_values,
            mqar_pairs=args.mqar_pairs,
            twohop_entities=args.twohop_entities,
            twohop_relations=args.twohop_relations,
            twohop_facts=args.twohop_facts,
            twohop_queries=args.twohop_queries,
        )
    except ValueError as err:
        parser.error(str(err))
    if args.warmup >= args.steps:
        parser.error(f"--warmup ({args.warmup}) must be smaller than --steps ({args.steps})")
    if args.eval_every > args.steps:
        parser.error(f"--eval-every ({args.eval_every}) is larger than --steps ({args.steps}): no curve to draw")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available here (use --device cpu)")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.bf16 and args.device == "cuda" and not torch.cuda.is_bf16_supported():
        parser.error("--bf16: this GPU does not support bfloat16")
    try:
        args.shape_dict = resolve_shape(args)
        args.dc_overrides = parse_overrides(args.dc_overrides)
    except ValueError as err:
        parser.error(str(err))
    return args


def parse_overrides(text: str) -> dict:
    overrides = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        if "=" not in item:
            raise ValueError(f"--dc-overrides: expected key=value, got {item!r}")
        key, value = (s.strip() for s in item.split("=", 1))
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
        if key in SHAPE_KEYS or key in ("vocab_size",):
            raise ValueError(f"--dc-overrides: {key} is part of the shared shape; use --shape/--hidden/... instead")
        if key not in DCFormerConfig.__dataclass_fields__:
            raise ValueError(f"--dc-overrides: {key!r} is not a DCFormerConfig option")
    return overrides


def resolve_shape(args) -> dict:
    shape = {"hidden_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4, "intermediate_size": None}
    if args.shape:
        path = Path(args.shape)
        if not path.is_file() and (PRESET_DIR / f"{args.shape}.json").is_file():
            path = PRESET_DIR / f"{args.shape}.json"
        if not path.is_file():
            raise ValueError(f"--shape: {args.shape!r} is neither a config JSON file nor a preset in configuration/")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"--shape: {path} is not valid JSON ({err})") from None
        aliases = {
            "hidden_size": ("hidden_size", "dim"),
            "num_hidden_layers": ("num_hidden_layers", "n_layer"),
            "num_attention_heads": ("num_attention_heads", "n_head"),
            "intermediate_size": ("intermediate_size",),
        }
        for key, names in aliases.items():
            for name in names:
                if data.get(name) is not None:
                    shape[key] = data[name]
                    break
        if data.get("use_gated_mlp") or data.get("norm_type") == "rmsnorm":
            logger.warning(f"--shape {path}: only its sizes are used; both models keep the Pythia body")
    for key, flag in zip(SHAPE_KEYS, ("hidden", "layers", "heads", "intermediate")):
        if getattr(args, flag) is not None:
            shape[key] = getattr(args, flag)
    if shape["intermediate_size"] is None:
        shape["intermediate_size"] = 4 * shape["hidden_size"]
    if shape["hidden_size"] % shape["num_attention_heads"]:
        raise ValueError(f"hidden size {shape['hidden_size']} is not divisible by {shape['num_attention_heads']} heads")
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    if int(head_dim * 0.25) % 2:
        raise ValueError(
            f"head dim {head_dim}: its rotary part (a quarter, {int(head_dim * 0.25)}) must be an even number; "
            "pick hidden/heads divisible by 8"
        )
    return shape


# ----------------------------------------------------------------------------------------------------------------
# Models


def make_configs(
    shape: dict,
    vocab_size: int,
    max_positions: int,
    baseline_attn: str,
    dc_overrides: dict | None = None,
    baseline_intermediate: int | None = None,
):
    common = dict(
        vocab_size=vocab_size,
        hidden_size=shape["hidden_size"],
        num_hidden_layers=shape["num_hidden_layers"],
        num_attention_heads=shape["num_attention_heads"],
        max_position_embeddings=max_positions,
        layer_norm_eps=1e-5,
        hidden_act="gelu",
        initializer_range=0.02,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    neox = GPTNeoXConfig(
        **common,
        intermediate_size=baseline_intermediate or shape["intermediate_size"],
        rotary_pct=0.25,
        rotary_emb_base=10000,
        use_parallel_residual=True,
        attention_bias=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    neox._attn_implementation = baseline_attn
    dc = DCFormerConfig(
        **common,
        intermediate_size=shape["intermediate_size"],
        partial_rotary_factor=0.25,
        norm_type="layernorm",
        use_parallel_residual=True,
        use_gated_mlp=False,
        attention_bias=True,
        mlp_bias=True,
        use_dcmha=True,
        use_qk_norm=False,
        window_size=None,
        **(dc_overrides or {}),
    )
    return neox, dc


def count_parameters(model_class, config) -> int:
    with torch.device("meta"):
        model = model_class(config)
    return sum(p.numel() for p in model.parameters())


def matched_configs(
    shape: dict,
    vocab_size: int,
    max_positions: int,
    baseline_attn: str = "sdpa",
    param_match: str = "auto",
    dc_overrides: dict | None = None,
):
    """The two configs and their parameter counts; raises ValueError when they are more than 2% apart."""
    neox, dc = make_configs(shape, vocab_size, max_positions, baseline_attn, dc_overrides)
    n_neox, n_dc = count_parameters(GPTNeoXForCausalLM, neox), count_parameters(DCFormerForCausalLM, dc)
    widened = param_match == "mlp" or (param_match == "auto" and abs(n_dc - n_neox) / n_neox > MAX_PARAM_GAP)
    if widened and n_dc != n_neox:
        # one more MLP unit costs (up weight D + up bias 1 + down weight D) per layer
        per_unit = shape["num_hidden_layers"] * (2 * shape["hidden_size"] + 1)
        width = shape["intermediate_size"] + round((n_dc - n_neox) / per_unit)
        if width < 1:
            raise ValueError(f"cannot match the parameter counts by the MLP width ({n_neox} vs {n_dc})")
        neox, dc = make_configs(
            shape, vocab_size, max_positions, baseline_attn, dc_overrides, baseline_intermediate=width
        )
        n_neox = count_parameters(GPTNeoXForCausalLM, neox)
    gap = (n_dc - n_neox) / n_neox
    info = {
        "transformer_params": n_neox,
        "dcformer_params": n_dc,
        "relative_difference": gap,
        "param_match": param_match,
        "transformer_intermediate_size": neox.intermediate_size,
        "dcformer_intermediate_size": dc.intermediate_size,
        "dcmha_params": n_dc
        - count_parameters(DCFormerForCausalLM, DCFormerConfig(**{**dc.to_dict(), "use_dcmha": False}))
        if dc.use_dcmha
        else 0,
    }
    if abs(gap) > MAX_PARAM_GAP:
        raise ValueError(
            f"parameter counts differ by {gap:+.2%} (> {MAX_PARAM_GAP:.0%}): Transformer {n_neox:,}, DCFormer {n_dc:,}. "
            "DCMHA adds ~20*D*N + 64*N^2 parameters a layer, a large share at small hidden/heads ratios; use "
            "--param-match auto/mlp (widens the Transformer's MLP) or a shape with a larger hidden size per head"
        )
    return neox, dc, info


# ----------------------------------------------------------------------------------------------------------------
# Metrics


def difficulty_of(row_ids: np.ndarray, task: str, vocab: TaskVocab) -> int:
    if task == "mqar":  # BOS, n (key, value) pairs, then the separator
        return (int(np.flatnonzero(row_ids == vocab.sep_id)[0]) - 1) // 2
    return int((row_ids == vocab.dot_id).sum())  # two-hop: one '.' per fact


def make_compute_metrics(task: str, vocab: TaskVocab, task_config: TaskConfig):
    lo, hi = task_config.difficulty_range(task)
    middle = (lo + hi) / 2

    def compute_metrics(eval_pred) -> dict:
        preds, labels, inputs = eval_pred.predictions, eval_pred.label_ids, eval_pred.inputs
        # the prediction for token i is the argmax of the logits at position i - 1
        preds, labels, inputs = preds[:, :-1], labels[:, 1:], inputs
        answer = labels != -100
        right = (preds == labels) & answer
        n_answers, n_right = answer.sum(1), right.sum(1)
        keep = n_answers > 0  # rows padded in by the evaluation loop have no answers
        difficulty = np.array([difficulty_of(inputs[r], task, vocab) if keep[r] else 0 for r in range(len(inputs))])
        easy, hard = keep & (difficulty <= middle), keep & (difficulty > middle)

        def acc(rows):
            return float(n_right[rows].sum() / max(n_answers[rows].sum(), 1))

        return {
            "accuracy": acc(keep),
            "seq_accuracy": float((n_right[keep] == n_answers[keep]).mean()),
            "accuracy_easy": acc(easy),
            "accuracy_hard": acc(hard),
        }

    return compute_metrics


def argmax_logits(logits, labels):
    if isinstance(logits, tuple):
        logits = logits[0]
    return logits.argmax(-1)


# ----------------------------------------------------------------------------------------------------------------
# One training run


def training_arguments(args, seed: int, output_dir: str) -> TrainingArguments:
    """The one TrainingArguments of a comparison: identical for both models apart from the run's directory."""
    return TrainingArguments(
        output_dir=output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.eval_batch_size,
        learning_rate=args.lr,
        lr_scheduler_type=args.schedule,
        warmup_steps=args.warmup,
        weight_decay=args.weight_decay,
        adam_beta1=0.9,
        adam_beta2=0.95,
        max_grad_norm=1.0,
        eval_strategy="steps",
        eval_steps=args.eval_every,
        eval_on_start=True,
        logging_strategy="steps",
        logging_steps=args.eval_every,
        save_strategy="no",
        report_to="none",
        seed=seed,
        data_seed=args.data_seed,
        train_sampling_strategy="sequential",  # the stream is i.i.d. already; the same order for every run
        remove_unused_columns=False,
        label_names=["labels"],
        include_for_metrics=["inputs"],
        dataloader_num_workers=0,
        use_cpu=args.device == "cpu",
        bf16=args.bf16,
        disable_tqdm=args.quiet,
    )


def train_one(kind: str, seed: int, args, configs: dict, data: dict, vocab: TaskVocab, workdir: str) -> dict:
    set_seed(seed)  # the initialisation: same seed for both models
    model = (GPTNeoXForCausalLM if kind == "transformer" else DCFormerForCausalLM)(configs[kind])
    compute = {task: make_compute_metrics(task, vocab, args.task_config) for task in args.tasks}

    trainer = _MultiTaskTrainer(
        model=model,
        args=training_arguments(args, seed, str(Path(workdir) / f"{kind}-seed{seed}")),
        train_dataset=data["train"],
        eval_dataset=data["validation"],
        data_collator=PadCollator(pad_id=vocab.pad_id),
        preprocess_logits_for_metrics=argmax_logits,
        task_metrics=compute,
    )
    start = time.perf_counter()
    result = trainer.train()
    seconds = time.perf_counter() - start
    history = {}
    for entry in trainer.state.log_history:
        for key, value in entry.items():
            if key.startswith("eval_") and key.count("_") >= 2 and not key.endswith(("_runtime", "_per_second")):
                history.setdefault(key[len("eval_") :], {})[entry["step"]] = value
    curves = {name: sorted(points.items()) for name, points in history.items()}
    final = {name: points[-1][1] for name, points in curves.items()}
    train_losses = [(e["step"], e["loss"]) for e in trainer.state.log_history if "loss" in e]
    del trainer, model
    return {
        "model": kind,
        "seed": seed,
        "train_seconds": seconds,
        "train_runtime": result.metrics.get("train_runtime"),
        "final_train_loss": train_losses[-1][1] if train_losses else None,
        "train_loss_curve": train_losses,
        "curves": curves,
        "final": final,
    }


class _MultiTaskTrainer(Trainer):
    """The stock Trainer; only routes each validation set to its task's metric function (the evaluation loop
    passes no dataset name to `compute_metrics`)."""

    def __init__(self, *args, task_metrics: dict, **kwargs):
        super().__init__(*args, **kwargs)
        self._task_metrics = task_metrics

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
        target = self.eval_dataset if eval_dataset is None else eval_dataset
        if not isinstance(target, dict):  # one task's set: by name (from the dict loop) or as a dataset
            task = eval_dataset if isinstance(eval_dataset, str) else metric_key_prefix.rsplit("_", 1)[-1]
            self.compute_metrics = self._task_metrics.get(task)
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)


# ----------------------------------------------------------------------------------------------------------------
# Aggregation and reports


def spread(values: list[float]) -> dict:
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def reach_step(curve: list[tuple[int, float]], target: float, lower_is_better: bool = True) -> float | None:
    """First step (linearly interpolated between evaluations) at which `curve` reaches `target`."""
    for (s0, v0), (s1, v1) in zip(curve, curve[1:]):
        if lower_is_better and v1 <= target < v0 or not lower_is_better and v0 < target <= v1:
            return s0 + (s1 - s0) * (v0 - target) / (v0 - v1)
        if (v0 <= target) if lower_is_better else (v0 >= target):
            return float(s0)
    if curve and ((curve[-1][1] <= target) if lower_is_better else (curve[-1][1] >= target)):
        return float(curve[-1][0])
    return None


def mean_curve(runs: list[dict], name: str) -> list[tuple[int, float, float, float]]:
    """(step, mean, min, max) over the runs' curves of metric `name`."""
    by_step: dict[int, list[float]] = {}
    for run in runs:
        for step, value in run["curves"].get(name, []):
            by_step.setdefault(step, []).append(value)
    return [(s, statistics.fmean(v), min(v), max(v)) for s, v in sorted(by_step.items()) if len(v) == len(runs)]


def aggregate(runs: list[dict], tasks: list[str]) -> dict:
    summary = {}
    for kind in MODELS:
        mine = [r for r in runs if r["model"] == kind]
        if not mine:
            continue
        summary[kind] = {
            "seeds": [r["seed"] for r in mine],
            "train_seconds": spread([r["train_seconds"] for r in mine]),
            "final_train_loss": spread(
                [r["final_train_loss"] for r in mine if r["final_train_loss"] is not None] or [math.nan]
            ),
        }
        for task in tasks:
            summary[kind][task] = {
                metric: spread([r["final"][f"{task}_{metric}"] for r in mine])
                for metric in ("loss", "accuracy", "seq_accuracy", "accuracy_easy", "accuracy_hard")
            }
    comparisons = {}
    if all(k in summary for k in MODELS):
        for task in tasks:
            tf = mean_curve([r for r in runs if r["model"] == "transformer"], f"{task}_loss")
            dc = mean_curve([r for r in runs if r["model"] == "dcformer"], f"{task}_loss")
            tf_curve, dc_curve = [(s, m) for s, m, _, _ in tf], [(s, m) for s, m, _, _ in dc]
            comparisons[task] = {
                "dcformer_steps_to_transformer_final_loss": reach_step(dc_curve, tf_curve[-1][1]),
                "transformer_steps_to_dcformer_final_loss": reach_step(tf_curve, dc_curve[-1][1]),
                "final_step": tf_curve[-1][0],
            }
    return {"models": summary, "comparisons": comparisons}


def fmt(s: dict, digits: int = 3, pct: bool = False) -> str:
    scale = 100 if pct else 1
    unit = "%" if pct else ""
    d = 1 if pct else digits
    return f"{s['mean'] * scale:.{d}f} ± {s['std'] * scale:.{d}f}{unit} [{s['min'] * scale:.{d}f}, {s['max'] * scale:.{d}f}]"


def write_markdown(path: Path, report: dict) -> str:
    setup, params, agg = report["setup"], report["parameters"], report["aggregate"]
    shape = setup["shape"]
    tasks = setup["tasks"]
    threads = f", {setup['threads']} thread(s)" if setup.get("threads") else ""
    lines = [
        "# DCFormer vs Transformer: small synthetic comparison",
        "",
        f"Shape: hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, {shape['num_attention_heads']} heads, "
        f"MLP {params['dcformer_intermediate_size']} (DCFormer) / {params['transformer_intermediate_size']} (Transformer), "
        f"vocab {setup['vocab_size']}. Parameters: Transformer {params['transformer_params']:,}, "
        f"DCFormer {params['dcformer_params']:,} ({params['relative_difference']:+.2%}; DCMHA itself {params['dcmha_params']:,}).",
        f"Training: {setup['steps']} steps x {setup['batch_size']} sequences ({setup['train_tokens']:,} tokens, "
        f"{setup['train_answer_tokens']:,} answer tokens with loss), lr {setup['lr']} {setup['schedule']}, warmup "
        f"{setup['warmup']}, AdamW (0.9, 0.95), weight decay {setup['weight_decay']}, eval every {setup['eval_every']} "
        f"steps on {setup['val_size']} held-out sequences per task. Seeds {setup['seeds']} (initialisation); data seed "
        f"{setup['data_seed']} (the same stream and validation sets for every run). Device {setup['device']}"
        f"{' bf16' if setup['bf16'] else ''}{threads}; wall time {report['wall_seconds'] / 60:.1f} min.",
        "",
        "Final validation numbers, mean ± std [min, max] over seeds. Accuracy: exact match of each answer token "
        "(greedy, given the true prefix); `seq acc`: every answer of a sequence right; `hard`: MQAR with more than "
        "the middle number of pairs, two-hop with more than the middle number of facts.",
        "",
        "| task | model | val loss | accuracy | seq acc | hard accuracy |",
        "|---|---|---|---|---|---|",
    ]
    for task in tasks:
        for kind in MODELS:
            if kind not in agg["models"]:
                continue
            m = agg["models"][kind][task]
            lines.append(
                f"| {task} | {LABELS[kind]} | {fmt(m['loss'])} | {fmt(m['accuracy'], pct=True)} | "
                f"{fmt(m['seq_accuracy'], pct=True)} | {fmt(m['accuracy_hard'], pct=True)} |"
            )
    lines += [
        "",
        "Per run (final validation loss / accuracy):",
        "",
        "| model | seed | " + " | ".join(tasks) + " | train time |",
        "|---|---|" + "---|" * len(tasks) + "---|",
    ]
    for run in report["runs"]:
        cells = [f"{run['final'][f'{t}_loss']:.3f} / {run['final'][f'{t}_accuracy']:.1%}" for t in tasks]
        lines.append(
            f"| {LABELS[run['model']]} | {run['seed']} | " + " | ".join(cells) + f" | {run['train_seconds']:.0f} s |"
        )
    expected = len(setup["seeds"]) * len(setup.get("models", MODELS))
    if len(report["runs"]) < expected:
        lines += ["", f"**Incomplete: {len(report['runs'])} of {expected} runs finished.**"]
    lines.append("")
    for kind in MODELS:
        if kind in agg["models"]:
            t = agg["models"][kind]["train_seconds"]
            lines.append(
                f"- {LABELS[kind]}: {t['mean']:.0f} s a run ({t['mean'] / setup['steps'] * 1000:.0f} ms a step, evaluations included)."
            )
    for task, c in agg["comparisons"].items():
        dc, tf = c["dcformer_steps_to_transformer_final_loss"], c["transformer_steps_to_dcformer_final_loss"]
        if dc is not None and dc < c["final_step"]:
            lines.append(
                f"- {task}: the DCFormer (mean curve) reaches the Transformer's final validation loss at step {dc:.0f} "
                f"of {c['final_step']} ({c['final_step'] / max(dc, 1):.2f}x fewer steps)."
            )
        elif tf is not None and tf < c["final_step"]:
            lines.append(
                f"- {task}: the Transformer (mean curve) reaches the DCFormer's final validation loss at step {tf:.0f} "
                f"of {c['final_step']} ({c['final_step'] / max(tf, 1):.2f}x fewer steps)."
            )
        else:
            lines.append(f"- {task}: neither mean curve reaches the other's final loss before the end.")
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def plot_curves(path: Path, runs: list[dict], tasks: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(tasks), figsize=(5.5 * len(tasks), 7), squeeze=False)
    colors = {"transformer": "tab:blue", "dcformer": "tab:red"}
    for col, task in enumerate(tasks):
        for row, (metric, ylabel) in enumerate((("loss", "validation loss"), ("accuracy", "validation accuracy"))):
            ax = axes[row][col]
            for kind in MODELS:
                mine = [r for r in runs if r["model"] == kind]
                if not mine:
                    continue
                curve = mean_curve(mine, f"{task}_{metric}")
                steps = [c[0] for c in curve]
                ax.plot(steps, [c[1] for c in curve], color=colors[kind], label=f"{LABELS[kind]}, mean of {len(mine)}")
                ax.fill_between(steps, [c[2] for c in curve], [c[3] for c in curve], color=colors[kind], alpha=0.2)
            ax.set_title(f"{task}: {ylabel}")
            ax.set_xlabel("step")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle("DCFormer vs Transformer (band: min-max over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------------------


def write_reports(out: Path, report: dict) -> str:
    tasks = report["setup"]["tasks"]
    report["aggregate"] = aggregate(report["runs"], tasks)
    plot_curves(out / "curves.png", report["runs"], tasks)
    return write_markdown(out / "results.md", report)


def report_only(out: Path) -> dict:
    path = out / "results.json"
    if not path.is_file():
        raise SystemExit(f"compare_small.py: error: --report-only: no {path}")
    report = json.loads(path.read_text())
    if not report.get("runs"):
        raise SystemExit(f"compare_small.py: error: --report-only: {path} holds no finished run")
    print(write_reports(out, report))
    path.write_text(json.dumps(report, indent=1))
    return report


def main(argv=None) -> dict:
    wall_start = time.perf_counter()
    args = parse_args(argv)
    if args.report_only:
        return report_only(Path(args.out))
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_warning()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    vocab = TaskVocab(args.task_config)
    max_len = max(args.task_config.max_length(t) for t in args.tasks)
    max_positions = -(-max_len // 8) * 8
    try:
        neox_config, dc_config, params = matched_configs(
            args.shape_dict,
            vocab.model_vocab_size,
            max_positions,
            args.baseline_attn,
            args.param_match,
            args.dc_overrides,
        )
    except (ValueError, TypeError) as err:
        raise SystemExit(f"compare_small.py: error: {err}") from None
    print(
        f"parameters: Transformer {params['transformer_params']:,} (MLP {params['transformer_intermediate_size']}), "
        f"DCFormer {params['dcformer_params']:,} (MLP {params['dcformer_intermediate_size']}, DCMHA "
        f"{params['dcmha_params']:,}); relative difference {params['relative_difference']:+.2%} (limit ±2%)"
    )

    train_size = args.steps * args.batch_size
    data = {
        "train": SyntheticDataset(args.tasks, train_size, args.data_seed, "train", vocab),
        "validation": {
            t: SyntheticDataset([t], args.val_size, args.data_seed, "validation", vocab) for t in args.tasks
        },
    }
    train_tokens = answer_tokens = 0
    for i in range(train_size):
        example = data["train"][i]
        train_tokens += len(example["input_ids"])
        answer_tokens += sum(label != -100 for label in example["labels"])
    for t in args.tasks:
        print(f"example {t}: {vocab.decode(data['validation'][t][0]['input_ids'])}")
    print(
        f"training: {train_size:,} sequences, {train_tokens:,} tokens ({answer_tokens:,} answers), the same for every run"
    )

    configs = {"transformer": neox_config, "dcformer": dc_config}
    setup = {
        "shape": args.shape_dict,
        "tasks": args.tasks,
        "models": args.models,
        "task_config": {k: v for k, v in vars(args.task_config).items()},
        "vocab_size": vocab.model_vocab_size,
        "symbols": len(vocab),
        "max_position_embeddings": max_positions,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "train_tokens": train_tokens,
        "train_answer_tokens": answer_tokens,
        "lr": args.lr,
        "schedule": args.schedule,
        "warmup": args.warmup,
        "weight_decay": args.weight_decay,
        "eval_every": args.eval_every,
        "val_size": args.val_size,
        "seeds": args.seeds,
        "data_seed": args.data_seed,
        "device": args.device,
        "bf16": args.bf16,
        "threads": args.threads if args.device == "cpu" else None,
        "baseline_attn": args.baseline_attn,
        "dc_overrides": args.dc_overrides,
        "param_match": args.param_match,
        "torch": torch.__version__,
        "command": [sys.argv[0]] + list(argv if argv is not None else sys.argv[1:]),
    }
    report = {"setup": setup, "parameters": params, "configs": {k: c.to_dict() for k, c in configs.items()}, "runs": []}
    json_path = out / "results.json"
    with tempfile.TemporaryDirectory(prefix="compare_small_") as workdir:
        for seed in args.seeds:
            for kind in args.models:
                print(f"=== {LABELS[kind]}, seed {seed} ===")
                run = train_one(kind, seed, args, configs, data, vocab, workdir)
                report["runs"].append(run)
                summary = ", ".join(
                    f"{t} loss {run['final'][f'{t}_loss']:.3f} acc {run['final'][f'{t}_accuracy']:.1%}"
                    for t in args.tasks
                )
                print(f"--- {LABELS[kind]}, seed {seed}: {summary} ({run['train_seconds']:.0f} s)")
                report["wall_seconds"] = time.perf_counter() - wall_start
                json_path.write_text(json.dumps(report, indent=1))  # partial results survive an interruption

    report["wall_seconds"] = time.perf_counter() - wall_start
    table = write_reports(out, report)  # the wall time reported: all the training and evaluation
    json_path.write_text(json.dumps(report, indent=1))
    print(table)
    total = (time.perf_counter() - wall_start) / 60
    print(f"wrote {out / 'results.md'}, {json_path}, {out / 'curves.png'} in {total:.1f} min")
    return report


if __name__ == "__main__":
    main()
