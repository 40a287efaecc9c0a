#!/usr/bin/env python
"""A reproducible small-scale DCFormer (DCPythia) vs Transformer (Pythia / GPT-NeoX) comparison.

Both models have the Pythia body (LayerNorm, parallel residual, GELU MLP with biases, rotary on 25% of each
head, untied output head) and the same hidden size, layers, heads and vocabulary; the only difference is the
attention: plain multi-head attention (`GPTNeoXForCausalLM`, sdpa or eager) or DCMHA (`DCFormerForCausalLM`).
They are trained from the same seed, on the same examples in the same order, with the same `transformers.Trainer`
and `TrainingArguments` (cosine schedule, warmup, batch, steps, evaluation every k steps; the learning rate is the
same too unless `--dc-lr` or `--lr-sweep` gives each model its own).

Tasks (`--task`):
* `synthetic` (default): a mixture of two synthetic in-context tasks generated on the fly (`synthetic_tasks.py`),
  multi-query associative recall (MQAR) and two-hop fact composition, with the loss on the answer tokens only.
  Validation: a fixed held-out generated set per task; accuracy is the exact match of each answer token (greedy
  argmax given the true prefix), also per sequence (all answers right).
* `lm`: language modelling on real text (`lm_corpus.py`): by default the English documentation of Python as
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
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import (
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)
from transformers.utils import logging as hf_logging

import modeling_dcformer  # noqa: F401
import modeling_dcformer.configuration
from lm_corpus import TOKENIZERS, BlockDataset, bits_per_byte, load_corpus, predicted_bytes_per_token
from modeling_dcformer import DCFormerConfig, DCFormerForCausalLM
from modeling_dcformer.modeling_dcformer import DW_RMS_EPS, DynamicWeightProjection
from synthetic_tasks import TASKS, PadCollator, SyntheticDataset, TaskConfig, TaskVocab

PRESET_DIR = Path(modeling_dcformer.configuration.__file__).parent  # the presets, installed with the package

logger = hf_logging.get_logger("dcformer.compare_small")

MODELS = ("transformer", "dcformer", "static", "pre", "post", "query-wise")
DC_MODELS = MODELS[1:]
LABELS = {
    "transformer": "Transformer (GPT-NeoX)",
    "dcformer": "DCFormer (DCMHA)",
    "static": "DCFormer, static composition only",
    "pre": "DCFormer, pre-softmax composition only",
    "post": "DCFormer, post-softmax composition only",
    "query-wise": "DCFormer, query-wise terms only",
}
SLOT_NAMES = {4: ("pre_q", "pre_k", "post_q", "post_k"), 2: ("pre_q", "post_q")}
FROZEN_SLOTS = {"pre": (2, 3), "post": (0, 1)}  # the slots an ablation keeps at zero
SYNTHETIC_METRICS = ("loss", "accuracy", "seq_accuracy", "accuracy_easy", "accuracy_hard")
LM_METRICS = ("loss", "perplexity", "bits_per_byte")
MAX_PARAM_GAP = 0.02
SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
RECIPE_KEYS = {"dc_init": "dynamic_init", "qk_norm": "use_qk_norm", "window": "window_size"}
TIMING_SKIP_STEPS = 5  # the first steps pay for compilation and warm caches: left out of tokens/s


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


def fraction(text: str) -> float:
    value = positive_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {text!r}")
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


def lr_list(text: str) -> list[float]:
    """'1e-3,3e-3' -> [0.001, 0.003]: at least two distinct positive learning rates."""
    try:
        rates = [positive_float(s) for s in text.split(",") if s.strip()]
    except argparse.ArgumentTypeError:
        rates = []
    if len(rates) < 2 or len(set(rates)) != len(rates):
        raise argparse.ArgumentTypeError(
            f"--lr-sweep takes at least two distinct positive learning rates separated by commas, got {text!r}"
        )
    return sorted(rates)


def size_list(text: str) -> list[tuple[int, int, int | None]]:
    """'128/4,256/8/6' -> [(128, 4, None), (256, 8, 6)]: hidden/heads[/layers] per size."""
    sizes = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        parts = item.split("/")
        try:
            if len(parts) not in (2, 3):
                raise ValueError
            numbers = [positive_int(p) for p in parts]
        except (ValueError, argparse.ArgumentTypeError):
            raise argparse.ArgumentTypeError(
                f"--sizes takes HIDDEN/HEADS[/LAYERS] items separated by commas (e.g. 128/4,256/8), got {item!r}"
            ) from None
        sizes.append((numbers[0], numbers[1], numbers[2] if len(numbers) == 3 else None))
    if not sizes:
        raise argparse.ArgumentTypeError(f"--sizes: no size given in {text!r}")
    return sizes


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
        help="train nothing: rebuild results.md and the plots from --out/results.json (e.g. of an "
        "interrupted run: the runs finished so far are kept there)",
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


def parse_overrides(text: str, recipe: dict | None = None) -> dict:
    overrides = {}
    recipe = recipe or {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        if "=" not in item:
            raise ValueError(f"--dc-overrides: expected key=value, got {item!r}")
        key, value = (s.strip() for s in item.split("=", 1))
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
        if key in SHAPE_KEYS or key in ("vocab_size", "max_position_embeddings"):
            raise ValueError(f"--dc-overrides: {key} is part of the shared shape; use --shape/--hidden/... instead")
        if key not in DCFormerConfig.__dataclass_fields__:
            raise ValueError(f"--dc-overrides: {key!r} is not a DCFormerConfig option")
        if key in recipe and recipe[key] != overrides[key]:
            flag = {"dynamic_init": "--dc-init", "use_qk_norm": "--qk-norm", "window_size": "--window"}.get(key)
            raise ValueError(f"--dc-overrides sets {key}={value} but {flag or '--window-type'} says {recipe[key]!r}")
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
    dc_options = dict(
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
    )
    dc_options.update(dc_overrides or {})  # the overrides replace these defaults (e.g. use_qk_norm=true)
    dc = DCFormerConfig(**common, **dc_options)
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
            f"parameter counts differ by {gap:+.2%} (> {MAX_PARAM_GAP:.0%}): Transformer {n_neox:,}, "
            f"DCFormer {n_dc:,}. "
            "DCMHA adds ~20*D*N + 64*N^2 parameters a layer, a large share at small hidden/heads ratios; use "
            "--param-match auto/mlp (widens the Transformer's MLP) or a shape with a larger hidden size per head"
        )
    return neox, dc, info


def variant_config(kind: str, dc: DCFormerConfig) -> DCFormerConfig:
    """The config of a DCFormer ablation variant (`kind` in DC_MODELS)."""
    if kind == "query-wise":
        return DCFormerConfig(**{**dc.to_dict(), "query_wise": True})
    if kind == "static":  # full rank: each slot composes with the identity + a learned M x M matrix + a diagonal
        return DCFormerConfig(**{**dc.to_dict(), "dynamic_rank": dc.heads_per_group})
    return dc


class StaticComposition(nn.Module):
    """The ablation `static`: in place of DynamicWeightProjection, the same composition terms
    [B, T, G, C, 2I+1, M] (w1 RMS-normalised, w2, tanh diagonal) as learned constants, equal for every input.
    w2 and the diagonal start at zero (the identity composition) and w1 random, so that both get gradients."""

    def __init__(self, config: DCFormerConfig):
        super().__init__()
        G, C, I, M = config.num_head_groups, config.num_composition_slots, config.dynamic_rank, config.heads_per_group
        self.w1 = nn.Parameter(torch.randn(G, C, I, M))
        self.w2 = nn.Parameter(torch.zeros(G, C, I, M))
        self.dd = nn.Parameter(torch.zeros(G, C, 1, M))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        w1 = self.w1 * torch.rsqrt(self.w1.pow(2).mean(-1, keepdim=True) + DW_RMS_EPS)
        terms = torch.cat((w1, self.w2, torch.tanh(self.dd)), dim=2).float()  # [G, C, 2I+1, M]
        return terms.expand(B, T, *terms.shape).contiguous()


def freeze_slots(model: nn.Module, slots: tuple[int, ...]) -> int:
    """Sets the composition slots `slots` of every layer to zero and keeps them there (their gradients are masked),
    so they add nothing: the ablations `pre` and `post`. Returns the number of parameters frozen."""
    frozen = 0
    for module in model.modules():
        if not isinstance(module, DynamicWeightProjection):
            continue
        masks = {
            "dw1": torch.ones_like(module.dw1),
            "qkw": torch.ones_like(module.qkw),
            "dd": torch.ones_like(module.dd).view(module.dd.shape[0], module.num_groups, module.num_slots, -1),
        }
        for slot in slots:
            masks["dw1"][:, :, slot] = 0
            masks["qkw"][:, slot] = 0
            masks["dd"][:, :, slot] = 0
        masks["dd"] = masks["dd"].reshape(module.dd.shape)
        for name, mask in masks.items():
            param = getattr(module, name)
            with torch.no_grad():
                param.mul_(mask)
            param.register_hook(lambda grad, mask=mask: grad * mask)
            frozen += int((mask == 0).sum())
    return frozen


def build_model(kind: str, config) -> tuple[nn.Module, int]:
    """The model of `kind` (its config from `variant_config`) and its number of trainable parameters."""
    if kind == "transformer":
        model = GPTNeoXForCausalLM(config)
        return model, sum(p.numel() for p in model.parameters())
    model = DCFormerForCausalLM(config)
    frozen = 0
    if kind == "static":
        for layer in model.model.layers:
            layer.self_attn.dyn_w_proj = StaticComposition(config)
    elif kind in FROZEN_SLOTS:
        frozen = freeze_slots(model, FROZEN_SLOTS[kind])
    return model, sum(p.numel() for p in model.parameters()) - frozen


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


def training_arguments(args, seed: int, output_dir: str, lr: float | None = None) -> TrainingArguments:
    """The one TrainingArguments of a comparison: identical for every model apart from the run's directory (and
    the learning rate, when `--dc-lr` or `--lr-sweep` gives each model its own)."""
    return TrainingArguments(
        output_dir=output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.eval_batch_size,
        learning_rate=args.lr if lr is None else lr,
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
        train_sampling_strategy="sequential",  # the stream is in its seeded order already; the same for every run
        remove_unused_columns=False,
        label_names=["labels"],
        include_for_metrics=["inputs"],
        dataloader_num_workers=0,
        use_cpu=args.device == "cpu",
        bf16=args.bf16,
        disable_tqdm=args.quiet,
    )


class StepTimer(TrainerCallback):
    """Wall time of each optimizer step, evaluations excluded (the Trainer evaluates after `on_step_end`)."""

    def __init__(self):
        self.seconds: list[float] = []
        self._start = None

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self._start)

    def steady_seconds(self) -> list[float]:
        return self.seconds[TIMING_SKIP_STEPS:] if len(self.seconds) > 2 * TIMING_SKIP_STEPS else self.seconds


class DynamicNormsCallback(TrainerCallback):
    """The size of the dynamic terms over training: at step 0 and every `every` steps, the RMS of w2 (the
    input-dependent weights of the low-rank terms; w1 is RMS-normalised) and of the tanh diagonal, per composition
    slot, averaged over layers and over a fixed probe batch."""

    def __init__(self, probe_ids: torch.Tensor, every: int):
        self.probe_ids, self.every = probe_ids, every
        self.history: list[dict] = []
        self.seconds = 0.0

    def record(self, model, step: int) -> None:
        start = time.perf_counter()
        projections = [m for m in model.modules() if isinstance(m, (DynamicWeightProjection, StaticComposition))]
        outputs = []
        hooks = [
            p.register_forward_hook(lambda mod, inp, out: outputs.append(out.detach().float())) for p in projections
        ]
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                model(input_ids=self.probe_ids.to(next(model.parameters()).device), use_cache=False)
        finally:
            for hook in hooks:
                hook.remove()
            model.train(was_training)
        terms = torch.stack(outputs)  # [layers, B, T, G, C, 2I+1, M]
        rank = (terms.shape[-2] - 1) // 2
        entry = {"step": step, "w2": {}, "dd": {}}
        for c, slot in enumerate(SLOT_NAMES[terms.shape[4]]):
            entry["w2"][slot] = terms[:, :, :, :, c, rank : 2 * rank].pow(2).mean().sqrt().item()
            entry["dd"][slot] = terms[:, :, :, :, c, 2 * rank].pow(2).mean().sqrt().item()
        self.history.append(entry)
        self.seconds += time.perf_counter() - start

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.record(model, 0)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every == 0 or state.global_step == state.max_steps:
            self.record(model, state.global_step)


def train_one(kind: str, seed: int, lr: float, args, configs: dict, data: dict, workdir: str) -> dict:
    set_seed(seed)  # the initialisation: same seed for every model
    model, n_params = build_model(kind, configs[kind])
    timer = StepTimer()
    callbacks = [timer]
    norms = None
    if kind != "transformer":
        norms = DynamicNormsCallback(data["probe_ids"], args.eval_every)
        callbacks.append(norms)
    trainer = _MultiTaskTrainer(
        model=model,
        args=training_arguments(args, seed, str(Path(workdir) / f"{kind}-seed{seed}-lr{lr:g}"), lr),
        train_dataset=data["train"],
        eval_dataset=data["validation"],
        data_collator=data["collator"],
        preprocess_logits_for_metrics=argmax_logits,
        task_metrics=data["metrics"],
        callbacks=callbacks,
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
    if "lm_loss" in curves:
        curves["lm_perplexity"] = [(s, math.exp(min(v, 50.0))) for s, v in curves["lm_loss"]]
        curves["lm_bits_per_byte"] = [(s, bits_per_byte(v, data["bytes_per_token"])) for s, v in curves["lm_loss"]]
    final = {name: points[-1][1] for name, points in curves.items()}
    train_losses = [(e["step"], e["loss"]) for e in trainer.state.log_history if "loss" in e]
    step_seconds = statistics.median(timer.steady_seconds())
    del trainer, model
    return {
        "model": kind,
        "seed": seed,
        "lr": lr,
        "parameters": n_params,
        "train_seconds": seconds,
        "train_runtime": result.metrics.get("train_runtime"),
        "step_seconds_median": step_seconds,
        "tokens_per_second": data["tokens_per_step"] / step_seconds,
        "final_train_loss": train_losses[-1][1] if train_losses else None,
        "train_loss_curve": train_losses,
        "curves": curves,
        "final": final,
        "dyn_norms": norms.history if norms else None,
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


def task_metrics(task: str) -> tuple[str, ...]:
    return LM_METRICS if task == "lm" else SYNTHETIC_METRICS


def final_loss(run: dict, tasks: list[str]) -> float:
    """The run's final validation loss, the mean over tasks (inf when it diverged)."""
    value = statistics.fmean(run["final"][f"{t}_loss"] for t in tasks)
    return value if math.isfinite(value) else math.inf


def sweep_summary(runs: list[dict], models: list[str], tasks: list[str], rates: list[float], seed: int) -> dict:
    """Final validation loss of every (model, rate) of the sweep, and each model's best rate."""
    losses = {kind: {} for kind in models}
    for run in runs:
        if run["seed"] == seed and run["lr"] in rates:
            losses[run["model"]][repr(run["lr"])] = final_loss(run, tasks)
    best = {kind: float(min(table, key=table.get)) for kind, table in losses.items() if table}
    return {"rates": rates, "seed": seed, "final_loss": losses, "best": best}


def main_runs(report: dict) -> list[dict]:
    """The runs of the comparison itself: with a sweep, those at each model's chosen rate."""
    chosen = report.get("chosen_lr")
    if not chosen:
        return report["runs"]
    return [r for r in report["runs"] if r.get("lr") == chosen.get(r["model"])]


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
        if all("tokens_per_second" in r for r in mine):
            summary[kind]["lr"] = mine[0]["lr"]
            summary[kind]["parameters"] = mine[0]["parameters"]
            summary[kind]["tokens_per_second"] = spread([r["tokens_per_second"] for r in mine])
        for task in tasks:
            summary[kind][task] = {
                metric: spread([r["final"][f"{task}_{metric}"] for r in mine]) for metric in task_metrics(task)
            }
        if all(r.get("dyn_norms") for r in mine):
            summary[kind]["dyn_norms"] = {
                part: {
                    slot: {
                        "start": statistics.fmean(r["dyn_norms"][0][part][slot] for r in mine),
                        "end": statistics.fmean(r["dyn_norms"][-1][part][slot] for r in mine),
                    }
                    for slot in mine[0]["dyn_norms"][0][part]
                }
                for part in ("w2", "dd")
            }
    comparisons = {}
    if all(k in summary for k in ("transformer", "dcformer")):
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
    mean, std, lo, hi = (s[k] * scale for k in ("mean", "std", "min", "max"))
    return f"{mean:.{d}f} ± {std:.{d}f}{unit} [{lo:.{d}f}, {hi:.{d}f}]"


def describe_recipe(setup: dict) -> str:
    overrides = setup.get("dc_overrides") or {}
    window = overrides.get("window_size")
    parts = [
        f"init {overrides.get('dynamic_init', 'authors')}",
        f"qk-norm {'on' if overrides.get('use_qk_norm') else 'off'}",
        f"window {window} ({overrides.get('window_type')})" if window else "every layer global",
    ]
    recipe = ("dynamic_init", "use_qk_norm", "window_size", "window_type")
    others = {k: v for k, v in overrides.items() if k not in recipe}
    if others:
        parts.append(", ".join(f"{k}={v}" for k, v in others.items()))
    return "; ".join(parts)


def setup_lines(report: dict) -> list[str]:
    setup, params = report["setup"], report["parameters"]
    shape = setup["shape"]
    threads = f", {setup['threads']} thread(s)" if setup.get("threads") else ""
    if setup.get("task") == "lm":
        corpus = setup["corpus"]
        data = (
            f"Data: {corpus['train_documents']} training and {corpus['val_documents']} validation documents "
            f"({corpus['train_bytes']:,} / {corpus['val_bytes']:,} bytes) from {', '.join(corpus['sources'])}; "
            f"{corpus['tokenizer']} tokens (vocabulary {corpus['vocab_size']}), {corpus['train_tokens']:,} training "
            f"tokens, blocks of {setup['block_size']}; validation on {setup['val_size']} blocks spread over the "
            f"validation stream. Stream fingerprint {corpus['fingerprint'][:12]}."
        )
        seen = f"{setup['train_tokens']:,} tokens, {setup['train_epochs']:.2f} epochs"
    else:
        data = None
        seen = f"{setup['train_tokens']:,} tokens, {setup['train_answer_tokens']:,} answer tokens with loss"
    lr = f"lr {setup['lr']}"
    if setup.get("lr_sweep"):
        lr = f"lr swept over {setup['lr_sweep']} (seed {setup['seeds'][0]}), then each model at its best"
    elif setup.get("dc_lr"):
        lr = f"lr {setup['lr']} (Transformer) / {setup['dc_lr']} (DCFormer)"
    lines = [
        f"Shape: hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, {shape['num_attention_heads']} "
        f"heads, MLP {params['dcformer_intermediate_size']} (DCFormer) / {params['transformer_intermediate_size']} "
        f"(Transformer), vocab {setup['vocab_size']}. Parameters: Transformer {params['transformer_params']:,}, "
        f"DCFormer {params['dcformer_params']:,} ({params['relative_difference']:+.2%}; DCMHA itself "
        f"{params['dcmha_params']:,}). DCFormer recipe: {describe_recipe(setup)}.",
    ]
    if data:
        lines.append(data)
    lines.append(
        f"Training: {setup['steps']} steps x {setup['batch_size']} sequences ({seen}), {lr} {setup['schedule']}, "
        f"warmup {setup['warmup']}, AdamW (0.9, 0.95), weight decay {setup['weight_decay']}, eval every "
        f"{setup['eval_every']} steps. Seeds {setup['seeds']} (initialisation); data seed {setup['data_seed']} (the "
        f"same stream and validation sets for every run). Device {setup['device']}{' bf16' if setup['bf16'] else ''}"
        f"{threads}; wall time {report['wall_seconds'] / 60:.1f} min."
    )
    return lines


def write_markdown(path: Path, report: dict) -> str:
    setup, agg = report["setup"], report["aggregate"]
    tasks = setup["tasks"]
    lm = setup.get("task") == "lm"
    runs = main_runs(report)
    present = [k for k in MODELS if k in agg["models"]]
    title = "language modelling on real text" if lm else "small synthetic comparison"
    lines = [f"# DCFormer vs Transformer: {title}", "", *setup_lines(report), ""]
    if lm:
        lines += [
            "Final validation numbers, mean ± std [min, max] over seeds. Perplexity per token; bits per byte of "
            "text; tokens/s: training steps only (median step, the first steps left out).",
            "",
            "| model | parameters | lr | val loss | perplexity | bits/byte | tokens/s |",
            "|---|---|---|---|---|---|---|",
        ]
        for kind in present:
            m = agg["models"][kind]
            lines.append(
                f"| {LABELS[kind]} | {m['parameters']:,} | {m['lr']:g} | {fmt(m['lm']['loss'])} | "
                f"{fmt(m['lm']['perplexity'], 2)} | {fmt(m['lm']['bits_per_byte'])} | "
                f"{m['tokens_per_second']['mean']:,.0f} |"
            )
    else:
        lines += [
            "Final validation numbers, mean ± std [min, max] over seeds. Accuracy: exact match of each answer token "
            "(greedy, given the true prefix); `seq acc`: every answer of a sequence right; `hard`: MQAR with more "
            "than the middle number of pairs, two-hop with more than the middle number of facts.",
            "",
            "| task | model | val loss | accuracy | seq acc | hard accuracy |",
            "|---|---|---|---|---|---|",
        ]
        for task in tasks:
            for kind in present:
                m = agg["models"][kind][task]
                lines.append(
                    f"| {task} | {LABELS[kind]} | {fmt(m['loss'])} | {fmt(m['accuracy'], pct=True)} | "
                    f"{fmt(m['seq_accuracy'], pct=True)} | {fmt(m['accuracy_hard'], pct=True)} |"
                )
    per_run = "loss / perplexity" if lm else "loss / accuracy"
    lines += [
        "",
        f"Per run (final validation {per_run}):",
        "",
        "| model | seed | " + " | ".join(tasks) + " | train time |",
        "|---|---|" + "---|" * len(tasks) + "---|",
    ]
    for run in runs:
        if lm:
            cells = [f"{run['final']['lm_loss']:.3f} / {run['final']['lm_perplexity']:.2f}"]
        else:
            cells = [f"{run['final'][f'{t}_loss']:.3f} / {run['final'][f'{t}_accuracy']:.1%}" for t in tasks]
        lines.append(
            f"| {LABELS[run['model']]} | {run['seed']} | " + " | ".join(cells) + f" | {run['train_seconds']:.0f} s |"
        )
    expected = len(setup["seeds"]) * len(setup.get("models", MODELS))
    if len(runs) < expected:
        lines += ["", f"**Incomplete: {len(runs)} of {expected} runs finished.**"]
    lines.append("")
    for kind in present:
        t = agg["models"][kind]["train_seconds"]
        speed = agg["models"][kind].get("tokens_per_second")
        speed = f"; {speed['mean']:,.0f} training tokens/s" if speed else ""
        lines.append(
            f"- {LABELS[kind]}: {t['mean']:.0f} s a run ({t['mean'] / setup['steps'] * 1000:.0f} ms a step, "
            f"evaluations included{speed})."
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
    lines += sweep_lines(report) + norms_lines(agg)
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def sweep_lines(report: dict) -> list[str]:
    sweep = report.get("lr_sweep")
    if not sweep:
        return []
    rates = sweep["rates"]
    over_tasks = ", mean over tasks" if len(report["setup"]["tasks"]) > 1 else ""
    lines = [
        "",
        f"Learning-rate sweep (seed {sweep['seed']}; final validation loss{over_tasks}):",
        "",
        "| model | " + " | ".join(f"lr {r:g}" for r in rates) + " | best |",
        "|---|" + "---|" * (len(rates) + 1),
    ]
    for kind in MODELS:
        table = sweep["final_loss"].get(kind)
        if table:
            cells = [f"{table[repr(r)]:.3f}" if repr(r) in table else "–" for r in rates]
            lines.append(f"| {LABELS[kind]} | " + " | ".join(cells) + f" | {sweep['best'][kind]:g} |")
    return lines


def norms_lines(agg: dict) -> list[str]:
    kinds = [k for k in DC_MODELS if "dyn_norms" in agg["models"].get(k, {})]
    if not kinds:
        return []
    slots = SLOT_NAMES[4]
    lines = [
        "",
        "Dynamic terms, RMS on a fixed probe batch averaged over layers and seeds, at step 0 → the end: w2 (the "
        "input-dependent weights of the low-rank terms) and the tanh diagonal, per slot (pre/post softmax, "
        "query/key):",
        "",
        "| model | " + " | ".join(f"w2 {s}" for s in slots) + " | " + " | ".join(f"diag {s}" for s in slots) + " |",
        "|---|" + "---|" * (2 * len(slots)),
    ]
    for kind in kinds:
        norms = agg["models"][kind]["dyn_norms"]
        cells = []
        for part in ("w2", "dd"):
            for slot in slots:
                v = norms[part].get(slot)
                cells.append(f"{v['start']:.3g} → {v['end']:.3g}" if v else "–")
        lines.append(f"| {LABELS[kind]} | " + " | ".join(cells) + " |")
    return lines


def plot_curves(path: Path, runs: list[dict], tasks: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(tasks), figsize=(5.5 * len(tasks) + 1, 7), squeeze=False)
    colors = dict(zip(MODELS, ("tab:blue", "tab:red", "tab:gray", "tab:green", "tab:purple", "tab:orange")))
    for col, task in enumerate(tasks):
        rows = (("loss", "validation loss"), ("perplexity", "validation perplexity"))
        if task != "lm":
            rows = (("loss", "validation loss"), ("accuracy", "validation accuracy"))
        for row, (metric, ylabel) in enumerate(rows):
            ax = axes[row][col]
            for kind in MODELS:
                mine = [r for r in runs if r["model"] == kind]
                if not mine:
                    continue
                curve = mean_curve(mine, f"{task}_{metric}")
                steps = [c[0] for c in curve]
                ax.plot(steps, [c[1] for c in curve], color=colors[kind], label=f"{LABELS[kind]}, mean of {len(mine)}")
                ax.fill_between(steps, [c[2] for c in curve], [c[3] for c in curve], color=colors[kind], alpha=0.2)
            if metric == "perplexity":
                ax.set_yscale("log")
            ax.set_title(f"{task}: {ylabel}")
            ax.set_xlabel("step")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle("DCFormer vs Transformer (band: min-max over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_norms(path: Path, runs: list[dict]) -> bool:
    """The dynamic terms' RMS over training, per DCFormer model and slot (mean over seeds); False if none."""
    kinds = [k for k in DC_MODELS if any(r["model"] == k and r.get("dyn_norms") for r in runs)]
    if not kinds:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(kinds), figsize=(5 * len(kinds), 4), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        mine = [r["dyn_norms"] for r in runs if r["model"] == kind and r.get("dyn_norms")]
        steps = [e["step"] for e in mine[0]]
        for part, style in (("w2", "-"), ("dd", "--")):
            for slot in mine[0][0][part]:
                values = [statistics.fmean(h[i][part][slot] for h in mine) for i in range(len(steps))]
                ax.plot(steps, values, style, label=f"{'w2' if part == 'w2' else 'diag'} {slot}")
        ax.set_title(LABELS[kind], fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("RMS on the probe batch")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------------------------------------------
# Several sizes


def scaling_rows(reports: list[dict]) -> list[dict]:
    rows = []
    for report in reports:
        agg, setup = report["aggregate"]["models"], report["setup"]
        task = setup["tasks"][0] if len(setup["tasks"]) == 1 else None
        row = {"shape": setup["shape"], "folder": report.get("folder"), "models": {}}
        for kind, m in agg.items():
            loss = m[task]["loss"] if task else spread([statistics.fmean(m[t]["loss"]["mean"] for t in setup["tasks"])])
            row["models"][kind] = {
                "parameters": m.get("parameters"),
                "lr": m.get("lr"),
                "loss": loss,
                "perplexity": m[task]["perplexity"] if task == "lm" else None,
                "tokens_per_second": m.get("tokens_per_second", {}).get("mean"),
                "seeds": len(m["seeds"]),
            }
        rows.append(row)
    return rows


def write_scaling(out: Path, reports: list[dict]) -> str:
    rows = scaling_rows(reports)
    (out / "scaling.json").write_text(json.dumps({"folders": [r["folder"] for r in rows], "rows": rows}, indent=1))
    lines = [
        "# DCFormer vs Transformer at several sizes",
        "",
        "Final validation loss, mean ± std [min, max] over seeds; Δ = DCFormer − Transformer (negative: DCFormer "
        "ahead). Each size's own tables are in its folder.",
        "",
        "| hidden / heads / layers | model | parameters | lr | val loss | perplexity | tokens/s | Δ loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        s = row["shape"]
        size = f"{s['hidden_size']} / {s['num_attention_heads']} / {s['num_hidden_layers']}"
        ref = row["models"].get("transformer")
        for kind, m in row["models"].items():
            delta = f"{m['loss']['mean'] - ref['loss']['mean']:+.3f}" if ref and kind != "transformer" else ""
            ppl = fmt(m["perplexity"], 2) if m["perplexity"] else "–"
            speed = f"{m['tokens_per_second']:,.0f}" if m["tokens_per_second"] else "–"
            lr = f"{m['lr']:g}" if m["lr"] else "–"
            params = f"{m['parameters']:,}" if m["parameters"] else "–"
            cells = [size, LABELS[kind], params, lr, fmt(m["loss"]), ppl, speed, delta]
            lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    (out / "scaling.md").write_text(text)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for kind, color in (("transformer", "tab:blue"), ("dcformer", "tab:red")):
        points = [(r["models"][kind]["parameters"], r["models"][kind]["loss"]) for r in rows if kind in r["models"]]
        if not points or any(p is None for p, _ in points):
            continue
        xs = [p for p, _ in points]
        ys = [m["mean"] for _, m in points]
        err = [[m["mean"] - m["min"] for _, m in points], [m["max"] - m["mean"] for _, m in points]]
        ax.errorbar(xs, ys, yerr=err, color=color, marker="o", capsize=3, label=LABELS[kind])
    ax.set_xscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("final validation loss (mean, min-max over seeds)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "scaling.png", dpi=110)
    plt.close(fig)
    return text


# ----------------------------------------------------------------------------------------------------------------


def write_reports(out: Path, report: dict) -> str:
    tasks = report["setup"]["tasks"]
    runs = main_runs(report)
    report["aggregate"] = aggregate(runs, tasks)
    plot_curves(out / "curves.png", runs, tasks)
    plot_norms(out / "dyn_norms.png", runs)
    return write_markdown(out / "results.md", report)


def report_only(out: Path) -> dict:
    scaling = out / "scaling.json"
    if scaling.is_file() and not (out / "results.json").is_file():
        reports = []
        for folder in json.loads(scaling.read_text())["folders"]:
            reports.append(report_only(out / folder))
            reports[-1]["folder"] = folder
        print(write_scaling(out, reports))
        return {"sizes": reports}
    path = out / "results.json"
    if not path.is_file():
        raise SystemExit(f"compare_small.py: error: --report-only: no {path}")
    report = json.loads(path.read_text())
    if not report.get("runs"):
        raise SystemExit(f"compare_small.py: error: --report-only: {path} holds no finished run")
    print(write_reports(out, report))
    path.write_text(json.dumps(report, indent=1))
    return report


# ----------------------------------------------------------------------------------------------------------------
# Data


_CORPORA: dict = {}  # one tokenised corpus per (paths, tokenizer, vocabulary, split) in a process (--sizes)


def prepare_lm(args) -> tuple[dict, dict]:
    key = (tuple(args.corpus or ()), args.tokenizer, args.bpe_vocab, args.val_fraction)
    if key not in _CORPORA:
        try:
            _CORPORA[key] = load_corpus(args.corpus, args.tokenizer, args.bpe_vocab, args.val_fraction)
        except (FileNotFoundError, ValueError) as err:
            raise SystemExit(f"compare_small.py: error: --corpus: {err}") from None
    corpus = _CORPORA[key]
    size = args.steps * args.batch_size
    try:
        train = BlockDataset(corpus.train_ids, args.block_size, size, seed=args.data_seed)
        validation = BlockDataset(corpus.val_ids, args.block_size, args.val_size)
    except ValueError as err:
        raise SystemExit(f"compare_small.py: error: --block-size / --val-size: {err}") from None
    bytes_per_token = predicted_bytes_per_token(validation, corpus.tokenizer.bytes_per_token())
    summary = corpus.summary()
    print(
        f"corpus: {summary['train_documents']} + {summary['val_documents']} documents, {summary['tokenizer']} "
        f"tokens (vocabulary {summary['vocab_size']}), {summary['train_tokens']:,} training tokens in "
        f"{train.num_blocks:,} blocks of {args.block_size}; {size:,} blocks a run "
        f"({size / train.num_blocks:.2f} epochs)"
    )
    collator = PadCollator(pad_id=0)
    data = {
        "train": train,
        "validation": {"lm": validation},
        "collator": collator,
        "metrics": {},
        "probe_ids": collator([validation[i] for i in range(min(4, len(validation)))])["input_ids"],
        "tokens_per_step": args.batch_size * args.block_size,
        "bytes_per_token": bytes_per_token,
    }
    setup = {
        "vocab_size": -(-corpus.vocab_size // 8) * 8,
        "max_position_embeddings": args.block_size,
        "corpus": summary,
        "block_size": args.block_size,
        "train_tokens": size * args.block_size,
        "train_epochs": size / train.num_blocks,
        "val_tokens": len(validation) * args.block_size,
        "bytes_per_predicted_token": bytes_per_token,
    }
    return data, setup


def prepare_synthetic(args) -> tuple[dict, dict]:
    vocab = TaskVocab(args.task_config)
    max_len = max(args.task_config.max_length(t) for t in args.tasks)
    size = args.steps * args.batch_size
    train = SyntheticDataset(args.tasks, size, args.data_seed, "train", vocab)
    validation = {t: SyntheticDataset([t], args.val_size, args.data_seed, "validation", vocab) for t in args.tasks}
    train_tokens = answer_tokens = 0
    for i in range(size):
        example = train[i]
        train_tokens += len(example["input_ids"])
        answer_tokens += sum(label != -100 for label in example["labels"])
    for t in args.tasks:
        print(f"example {t}: {vocab.decode(validation[t][0]['input_ids'])}")
    print(f"training: {size:,} sequences, {train_tokens:,} tokens ({answer_tokens:,} answers), the same for every run")
    collator = PadCollator(pad_id=vocab.pad_id)
    first = validation[args.tasks[0]]
    data = {
        "train": train,
        "validation": validation,
        "collator": collator,
        "metrics": {task: make_compute_metrics(task, vocab, args.task_config) for task in args.tasks},
        "probe_ids": collator([first[i] for i in range(min(4, len(first)))])["input_ids"],
        "tokens_per_step": train_tokens / args.steps,
        "bytes_per_token": None,
    }
    setup = {
        "vocab_size": vocab.model_vocab_size,
        "symbols": len(vocab),
        "max_position_embeddings": -(-max_len // 8) * 8,
        "task_config": {k: v for k, v in vars(args.task_config).items()},
        "train_tokens": train_tokens,
        "train_answer_tokens": answer_tokens,
    }
    return data, setup


# ----------------------------------------------------------------------------------------------------------------


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

    setup = {
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
        json_path.write_text(json.dumps(report, indent=1))  # partial results survive an interruption

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
    json_path.write_text(json.dumps(report, indent=1))
    print(table)
    total = (time.perf_counter() - wall_start) / 60
    print(f"wrote {out / 'results.md'}, {json_path}, {out / 'curves.png'} in {total:.1f} min")
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
