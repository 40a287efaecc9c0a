"""The command line of the small DCFormer vs Transformer comparison (`examples/compare_small.py`, whose docstring
describes the study): flags, the recipe overrides, one comparison (`run_comparison`) and several sizes (`run_sizes`).
The models, the training runs, the data and the reports are `ablation`, `runner`, `lm_corpus`, `synthetic_tasks`
and `report`.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from .ablation import (
    DC_MODELS,
    LABELS,
    MODELS,
    matched_configs,
    parse_overrides,
    resolve_shape,
    variant_config,
)
from .arguments import (
    fraction,
    lr_list,
    non_negative_int,
    positive_float,
    positive_int,
    seed_list,
    size_list,
)
from .lm_corpus import TOKENIZERS
from .report import report_only, sweep_summary, write_atomic, write_reports, write_scaling
from .runner import prepare_lm, prepare_synthetic, train_one
from .synthetic_tasks import TASKS, TaskConfig

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Train a Pythia-style Transformer and the DCPythia of the same shape on synthetic in-context "
        "tasks (MQAR, two-hop) or on real text (--task lm) with the same Trainer setup, several seeds; write "
        "results.md, results.json, curves.png.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--task", choices=("synthetic", "lm"), default="synthetic", help="what both models learn")
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
        "--sizes",
        type=size_list,
        help="run the whole comparison at each HIDDEN/HEADS[/LAYERS] (e.g. 128/4,256/8,512/8; MLP 4 x hidden), one "
        "folder each under --out, and write scaling.md / scaling.png",
    )
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

    g = p.add_argument_group("DCFormer recipe (the DCFormer models only)")
    g.add_argument(
        "--dc-init",
        choices=("authors", "normal"),
        help="DCFormerConfig.dynamic_init: the authors' scales for dw1, qkw, dd (the config's default) or "
        "N(0, 0.02) for all three",
    )
    g.add_argument(
        "--qk-norm",
        action=argparse.BooleanOptionalAction,
        help="RMS-normalise q and k per head, as every released DCFormer does (default: off)",
    )
    g.add_argument("--window", type=positive_int, help="local layers see this many keys (default: every layer global)")
    g.add_argument(
        "--window-type",
        default="LG",
        help="which layers are local with --window: LG (even layers, as in DCPythia-6.9B and DCFormer-2.8B), LGLL, ...",
    )
    g.add_argument(
        "--dc-overrides",
        default="",
        help="more DCFormerConfig options for the DC models, e.g. 'use_qk_norm=true,dynamic_rank=1' (JSON values)",
    )

    g = p.add_argument_group("training (the same for both models)")
    g.add_argument("--steps", type=positive_int, default=800, help="optimizer steps")
    g.add_argument("--batch-size", type=positive_int, default=32, help="sequences per step")
    g.add_argument("--lr", type=positive_float, default=3e-3, help="peak learning rate (AdamW)")
    g.add_argument("--dc-lr", type=positive_float, help="peak learning rate of the DCFormer models (default: --lr)")
    g.add_argument(
        "--lr-sweep",
        type=lr_list,
        help="learning rates to try (e.g. 1e-3,3e-3,1e-2): every model at every rate with the first seed, then the "
        "other seeds at each model's best rate (lowest final validation loss)",
    )
    g.add_argument("--warmup", type=non_negative_int, default=80, help="linear warmup steps (0: none)")
    g.add_argument("--schedule", default="cosine", help="lr_scheduler_type of TrainingArguments")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--eval-every", type=positive_int, default=100, help="evaluate on the validation sets every k steps")
    g.add_argument(
        "--val-size", type=positive_int, default=256, help="validation sequences per task (lm: validation blocks)"
    )
    g.add_argument("--eval-batch-size", type=positive_int, help="default: 128 (synthetic), --batch-size (lm)")
    g.add_argument(
        "--seeds",
        type=seed_list,
        default=seed_list("3"),
        help="model seeds: a count N (seeds 0..N-1) or a comma-separated list",
    )
    g.add_argument(
        "--models",
        default="transformer,dcformer",
        help=f"which models to train, from {', '.join(MODELS)} (one alone for quick tuning)",
    )
    g.add_argument(
        "--ablation",
        action="store_true",
        help="train every model: the Transformer, the DCFormer and its variants static, pre, post, query-wise",
    )
    g.add_argument(
        "--data-seed",
        type=int,
        default=1234,
        help="seed of the training stream and of the validation sets (the same for every model seed)",
    )

    g = p.add_argument_group("synthetic tasks (--task synthetic)")
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

    g = p.add_argument_group("language modelling (--task lm)")
    g.add_argument(
        "--corpus",
        nargs="+",
        help="text files or folders (.txt/.rst/.md, searched recursively), each file a document (default: "
        "Python's documentation from apt-get install python3.11-doc)",
    )
    g.add_argument(
        "--tokenizer", choices=TOKENIZERS, default="bpe", help="UTF-8 bytes, or a BPE trained on the train split"
    )
    g.add_argument("--bpe-vocab", type=positive_int, default=2048, help="BPE vocabulary size (--tokenizer bpe)")
    g.add_argument("--block-size", type=positive_int, default=128, help="tokens per training sequence")
    g.add_argument("--val-fraction", type=fraction, default=0.1, help="share of the documents held out for validation")

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
        help="train nothing: rebuild results.md and the plots (curves on the three axes: tokens, FLOPs, seconds "
        "included) from --out/results.json, or every size's and the scaling tables from --out/scaling.json (e.g. "
        "of an interrupted run: the runs finished so far are kept there; older JSON without per-evaluation "
        "seconds gets them estimated from the median step time)",
    )
    return p


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.task == "lm":
        if args.tasks != parser.get_default("tasks"):
            parser.error("--tasks chooses synthetic tasks; it does not apply to --task lm")
        args.tasks = ["lm"]
    else:
        tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
        if not tasks or any(t not in TASKS for t in tasks) or len(set(tasks)) != len(tasks):
            parser.error(f"--tasks: a comma-separated subset of {', '.join(TASKS)}, got {args.tasks!r}")
        args.tasks = tasks
        if args.corpus:
            parser.error("--corpus is for --task lm")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models or any(m not in MODELS for m in models) or len(set(models)) != len(models):
        parser.error(f"--models: a comma-separated subset of {', '.join(MODELS)}, got {args.models!r}")
    if args.ablation:
        if args.models != parser.get_default("models"):
            parser.error("--ablation trains every model; leave out --models")
        models = list(MODELS)
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
    if args.sizes and (args.shape or args.hidden or args.heads or args.intermediate):
        parser.error(
            "--sizes sets each size's hidden size and heads; leave out --shape, --hidden, --heads, --intermediate"
        )
    if args.window_type != parser.get_default("window_type") and args.window is None:
        parser.error("--window-type says which layers are local; give --window too")
    if args.window is not None and args.task == "lm" and args.window >= args.block_size:
        parser.error(f"--window ({args.window}) must be smaller than --block-size ({args.block_size}) to be local")
    if args.eval_batch_size is None:
        args.eval_batch_size = args.batch_size if args.task == "lm" else 128
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available here (use --device cpu)")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.bf16 and args.device == "cuda" and not torch.cuda.is_bf16_supported():
        parser.error("--bf16: this GPU does not support bfloat16")
    try:
        args.shape_dict = resolve_shape(args)
        args.dc_overrides = {**recipe_overrides(args), **parse_overrides(args.dc_overrides, recipe_overrides(args))}
    except ValueError as err:
        parser.error(str(err))
    return args


def recipe_overrides(args) -> dict:
    """The DCFormerConfig options the recipe flags set (only the flags given)."""
    overrides = {}
    if args.dc_init is not None:
        overrides["dynamic_init"] = args.dc_init
    if args.qk_norm is not None:
        overrides["use_qk_norm"] = args.qk_norm
    if args.window is not None:
        overrides["window_size"] = args.window
        overrides["window_type"] = args.window_type
    return overrides



def comparison_setup(args, data_setup: dict, command: list[str]) -> dict:
    """The `setup` of a comparison's results.json: every flag that shapes the runs and the data's summary."""
    return {
        "task": args.task,
        "shape": args.shape_dict,
        "tasks": args.tasks,
        "models": args.models,
        **data_setup,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "dc_lr": args.dc_lr,
        "lr_sweep": args.lr_sweep,
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
        "command": command,
    }


def run_comparison(args, command: list[str]) -> dict:
    wall_start = time.perf_counter()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_warning()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    data, data_setup = prepare_lm(args) if args.task == "lm" else prepare_synthetic(args)
    try:
        neox_config, dc_config, params = matched_configs(
            args.shape_dict,
            data_setup["vocab_size"],
            data_setup["max_position_embeddings"],
            args.baseline_attn,
            args.param_match,
            args.dc_overrides,
        )
        configs = {"transformer": neox_config, **{k: variant_config(k, dc_config) for k in DC_MODELS}}
    except (ValueError, TypeError) as err:
        raise SystemExit(f"compare_small.py: error: {err}") from None
    print(
        f"parameters: Transformer {params['transformer_params']:,} (MLP {params['transformer_intermediate_size']}), "
        f"DCFormer {params['dcformer_params']:,} (MLP {params['dcformer_intermediate_size']}, DCMHA "
        f"{params['dcmha_params']:,}); relative difference {params['relative_difference']:+.2%} (limit ±2%)"
    )

    setup = comparison_setup(args, data_setup, command)
    report = {"setup": setup, "parameters": params, "configs": {k: c.to_dict() for k, c in configs.items()}, "runs": []}
    json_path = out / "results.json"
    rates = {kind: args.lr if kind == "transformer" else (args.dc_lr or args.lr) for kind in args.models}

    def run(kind: str, seed: int, lr: float, workdir: str) -> None:
        print(f"=== {LABELS[kind]}, seed {seed}, lr {lr:g} ===")
        result = train_one(kind, seed, lr, args, configs, data, workdir)
        report["runs"].append(result)
        summary = ", ".join(f"{t} loss {result['final'][f'{t}_loss']:.3f}" for t in args.tasks)
        print(
            f"--- {LABELS[kind]}, seed {seed}, lr {lr:g}: {summary} ({result['train_seconds']:.0f} s, "
            f"{result['tokens_per_second']:,.0f} tokens/s)"
        )
        report["wall_seconds"] = time.perf_counter() - wall_start
        write_atomic(json_path, json.dumps(report, indent=1))  # partial results survive an interruption

    with tempfile.TemporaryDirectory(prefix="compare_small_") as workdir:
        seeds = args.seeds
        if args.lr_sweep:
            for lr in args.lr_sweep:
                for kind in args.models:
                    run(kind, seeds[0], lr, workdir)
            report["lr_sweep"] = sweep_summary(report["runs"], args.models, args.tasks, args.lr_sweep, seeds[0])
            rates = report["lr_sweep"]["best"]
            print("best learning rates: " + ", ".join(f"{LABELS[k]} {v:g}" for k, v in rates.items()))
            seeds = seeds[1:]
        report["chosen_lr"] = rates
        for seed in seeds:
            for kind in args.models:
                run(kind, seed, rates[kind], workdir)

    report["wall_seconds"] = time.perf_counter() - wall_start
    table = write_reports(out, report)  # the wall time reported: all the training and evaluation
    write_atomic(json_path, json.dumps(report, indent=1))
    print(table)
    total = (time.perf_counter() - wall_start) / 60
    written = ", ".join(str(p) for p in (out / "results.md", json_path, out / "curves.png", out / "curves_axes.png"))
    print(f"wrote {written} in {total:.1f} min")
    return report


def run_sizes(args, command: list[str]) -> dict:
    out = Path(args.out)
    reports = []
    for hidden, heads, layers in args.sizes:
        sub = copy.copy(args)
        sub.sizes, sub.hidden, sub.heads, sub.intermediate = None, hidden, heads, None
        sub.layers = layers if layers is not None else args.layers
        try:
            sub.shape_dict = resolve_shape(sub)
        except ValueError as err:
            raise SystemExit(f"compare_small.py: error: --sizes {hidden}/{heads}: {err}") from None
        folder = f"h{hidden}-n{heads}-l{sub.shape_dict['num_hidden_layers']}"
        sub.out = str(out / folder)
        print(f"##### size hidden {hidden}, heads {heads}, layers {sub.shape_dict['num_hidden_layers']} -> {sub.out}")
        reports.append(run_comparison(sub, command))
        reports[-1]["folder"] = folder
    text = write_scaling(out, reports)
    print(text)
    print(f"wrote {out / 'scaling.md'}, {out / 'scaling.json'}, {out / 'scaling.png'}")
    return {"sizes": reports}


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.report_only:
        return report_only(Path(args.out))
    command = [sys.argv[0]] + list(argv if argv is not None else sys.argv[1:])
    if args.sizes:
        return run_sizes(args, command)
    return run_comparison(args, command)


if __name__ == "__main__":
    main()
