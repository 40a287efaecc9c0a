#!/usr/bin/env python3
"""The main job, end to end: Pythia -> DCPythia -> fine-tune -> evaluate -> save -> reload -> generate.

    python examples/demo.py                       # what `make demo` runs: a tiny model, offline, about a minute
    python examples/demo.py --output-dir /tmp/d   # elsewhere than ./demo_out
    python examples/demo.py --no-bench            # skip benchmarks/bench_model.py --quick

With its defaults nothing is downloaded; every step is the real-size path run on a tiny model:

1. Pythia: a tiny random GPTNeoXForCausalLM (Pythia's layout: parallel residual, rotary on 1/4 of each head,
   a vocabulary padded beyond the tokenizer) with a byte-level BPE tokenizer trained here on the bundled corpus,
   saved as a checkpoint directory.   Real size: --pythia EleutherAI/pythia-160m
2. Conversion: dcformer-convert-pythia (its command line, `main(argv)`) with --verify: the DCPythia's
   fp32 logits must equal the Pythia's (max |difference| <= 1e-4) or nothing is written.
3. Fine-tuning: dcformer-train (its command line, `main(argv)`: Trainer) on examples/data/, with the
   validation loss measured before and after.   Real size: --dataset wikitext --dataset-config wikitext-2-raw-v1
4. Evaluation: lm-eval 0.4.13 through evals.harness on offline copies of LAMBADA, PIQA and HellaSwag
   (evals/fixtures; `--limit` rows a task).   Real size: --tasks lambada_openai,piqa,hellaswag --limit 0
5. Saving: `save_pretrained` (+ the tokenizer) into OUTPUT_DIR/dcpythia-<size>-finetuned: the directory carries
   its own modeling code (`trust_remote_code=True`) and a model card with the lm-eval results.
   --push-to-hub REPO pushes the model once the checks of step 6 have passed.
6. Reloading: natively (AutoModelForCausalLM.from_pretrained, logits equal to the in-memory model's) and, with
   remote code, in an isolated `python -I` process started from an empty directory, in which the installed
   `modeling_dcformer` package is blocked from importing (the saved code alone must do).
7. Generation: greedy (cached == uncached) and sampled, with the KV cache.
8. A summary table (also OUTPUT_DIR/summary.json, written last: a directory without it is unfinished), and the
   DCFormer/GPT-NeoX ratios of `benchmarks/bench_model.py --quick` (a subprocess: it forks).

Steps 1-7 are functions of `modeling_dcformer.demo.pipeline`; this script chains them and reports.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

_T_MODULE = time.perf_counter()  # the script's wall time counts its imports too
EXAMPLES = Path(__file__).resolve().parent
ROOT = EXAMPLES.parent
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DISABLE_MULTIPROC", "1")  # lm-eval's bootstrap stderr in this process: no fork after torch

import torch
from transformers.utils import logging as hf_logging

from modeling_dcformer.demo.pipeline import (
    build_tiny_pythia,
    check_inputs,
    convert,
    evaluate,
    finetune,
    generate,
    logits_of,
    push_to_hub,
    reload_native,
    reload_remote,
    save,
    source_name,
)
from modeling_dcformer.training.tokenizer import read_lines

logger = hf_logging.get_logger("dcformer.demo")

DATA_DIR = EXAMPLES / "data"
TRAIN_TXT = DATA_DIR / "harbour_train.txt"
VALID_TXT = DATA_DIR / "harbour_validation.txt"
BENCH = ROOT / "benchmarks" / "bench_model.py"
LOCAL_TASKS = "lambada_openai_local,piqa_local,hellaswag_local"
MARKER = ".dcformer-demo"  # marks a directory this script created (and may clear on the next run)
SUMMARY = "summary.json"
def banner(step: int, title: str) -> None:
    print(f"\n== {step}/8 {title} ==", flush=True)


# ----------------------------------------------------------------------------------------------------------------
# Output directory
# ----------------------------------------------------------------------------------------------------------------
def prepare_output_dir(out: Path) -> None:
    """An empty directory marked as ours. A previous demo run's directory is cleared; anything else that is not
    empty is refused (nothing of the user's is deleted), and so is a path that is no directory or cannot be made
    (one line naming it)."""
    if out.exists() and not out.is_dir():
        raise SystemExit(f"error: --output-dir {out} is a file, not a directory: choose another --output-dir")
    try:
        if out.exists() and any(out.iterdir()):
            if not (out / MARKER).is_file():
                raise SystemExit(f"error: {out} is not empty and was not made by this demo: choose another "
                                 "--output-dir")
            shutil.rmtree(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / MARKER).write_text("created by examples/demo.py; summary.json appears only when a run completes\n")
    except OSError as err:  # a file on the way (a/file/b), no permission, a read-only or full disk
        reason = os.strerror(err.errno) if err.errno else str(err)
        raise SystemExit(f"error: --output-dir {out} cannot be made or written ({reason}): choose another "
                         "--output-dir") from None


def write_json_atomic(path: Path, payload: dict) -> None:
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------------------------
# 3. Fine-tuning: dcformer-train's command line
# ----------------------------------------------------------------------------------------------------------------
def finetune_argv(args, model_dir: Path, out_dir: Path, tiny: bool) -> list[str]:
    argv = ["--model_name_or_path", str(model_dir), "--output_dir", str(out_dir), "--overwrite_output_dir"]
    if args.dataset:
        argv += ["--dataset_name", args.dataset]
        if args.dataset_config:
            argv += ["--dataset_config_name", args.dataset_config]
    else:
        argv += ["--train_file", args.train_file]
        if args.validation_file:
            argv += ["--validation_file", args.validation_file]
    block_size = args.block_size or (64 if tiny else None)  # None: the script's default (up to 1024)
    if block_size:
        argv += ["--block_size", str(block_size)]
    if args.max_eval_samples:
        argv += ["--max_eval_samples", str(args.max_eval_samples)]
    lr = args.learning_rate if args.learning_rate is not None else (3e-3 if tiny else 5e-5)
    argv += [
        "--do_train", "--do_eval", "--eval_on_start",  # validation loss before (step 0) and after training
        "--max_steps", str(args.train_steps),
        "--per_device_train_batch_size", str(args.batch_size),
        "--per_device_eval_batch_size", str(args.batch_size),
        "--learning_rate", str(lr),
        "--warmup_steps", str(min(10, args.train_steps // 10)),
        "--logging_steps", str(max(1, args.train_steps // 10)),
        "--save_strategy", "no",
        "--report_to", "none",
        "--seed", str(args.seed),
        "--dataloader_num_workers", "0",
        "--log_level", "warning",
    ]
    if args.device == "cpu":
        argv.append("--use_cpu")
    return argv + shlex.split(args.train_args)


# ----------------------------------------------------------------------------------------------------------------
# 8. Benchmark and summary
# ----------------------------------------------------------------------------------------------------------------
def run_quick_bench(out: Path) -> dict | None:
    """`benchmarks/bench_model.py --quick --json FILE` in its own process (it forks its measuring processes,
    which must happen before a process has run torch ops)."""
    json_file = out / "bench.json"
    print(f"$ python benchmarks/bench_model.py --quick --json {json_file}", flush=True)
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--json", str(json_file)], cwd=ROOT)
    if proc.returncode != 0 or not json_file.is_file():
        logger.warning(f"benchmarks/bench_model.py failed (exit code {proc.returncode}): no ratios in the summary")
        return None
    bench = json.loads(json_file.read_text())
    return {"baseline": bench["baseline"], "shape": bench.get("shape"), "ratios": finite_or_none(bench["ratios"]),
            "memory_ratios": finite_or_none(bench["memory_ratios"]), "file": str(json_file)}


def finite_or_none(ratios: dict) -> dict:
    """The bench writes NaN for a ratio over a baseline measured as 0 (e.g. a tiny model's prefill memory on a CPU):
    None instead, so that summary.json stays valid JSON and the summary says n/a."""
    return {k: v if isinstance(v, (int, float)) and math.isfinite(v) else None for k, v in ratios.items()}


def fmt(value, spec=".3f") -> str:
    return "n/a" if value is None else format(value, spec)


def fmt_ratios(ratios: dict) -> str:
    """`prefill 1.20x, train 1.35x`; a ratio that could not be measured is `n/a (baseline measured as 0)`."""
    parts = []
    for name, value in ratios.items():
        if value is None or not math.isfinite(value):
            parts.append(f"{name} n/a (baseline measured as 0)")
        else:
            parts.append(f"{name} {value:.2f}x")
    return ", ".join(parts)


def summary_rows(s: dict) -> list[tuple[str, str]]:
    rows = [("source", f"{s['source']['source']} ({s['source']['dir']})")]
    c = s["conversion"]
    rows.append(("conversion", f"{'verified' if c['verified'] else 'FAILED'}: max |logit diff| vs Pythia "
                               f"{c['max_logit_difference']:.2e} (bound {c['tolerance']:.0e})"))
    t = s["training"]
    rows.append(("fine-tuning", f"{t['steps']} steps, {t['seconds_per_step']:.3f} s/step"))
    rows.append(("train loss", f"{fmt(t['train_loss_first'])} (first {t['logging_steps']} steps) -> "
                               f"{fmt(t['train_loss_last'])} (last {t['logging_steps']})"))
    after = f"{fmt(t['eval_loss_after'])}" + (f" (perplexity {t['perplexity_after']:.1f})"
                                              if t.get("perplexity_after") else "")
    rows.append(("validation loss", f"{fmt(t['eval_loss_before'])} before -> {after} after"))
    for task, m in s["evaluation"]["tasks"].items():
        parts = [f"{k} {m[k]:.3f}" for k in ("acc", "acc_norm") if k in m]
        if "perplexity" in m:
            parts.append(f"perplexity {m['perplexity']:.1f}")
        rows.append((f"eval {task}", (", ".join(parts) or "no metrics") + f" ({m.get('samples')} rows)"))
    sv = s["save"]
    rows.append(("saved", f"{sv['dir']} ({'with' if sv['auto_map'] else 'without'} remote code"
                          f"{', model card' if sv['model_card'] else ''})"))
    n = s["reload"]["native"]
    rows.append(("reload, native", f"{'OK' if n['ok'] else 'FAILED'} (max |logit diff| {n['max_abs_diff']:.1e})"))
    r = s["reload"]["remote_code"]
    if r["status"] == "failed" and "max_abs_diff" not in r:
        text = f"FAILED: {' '.join(r.get('error', []))}"
    else:
        text = f"{'OK' if r['ok'] else 'FAILED'} (max |logit diff| {r['max_abs_diff']:.1e}, isolated process"
        text += ", installed package importable but blocked)" if r["modeling_dcformer_importable"] else ")"
    rows.append(("reload, remote code", text))
    if s.get("pushed_to"):
        rows.append(("pushed to", s["pushed_to"]))
    g = s["generation"]
    rows.append(("generated (greedy)", repr(g["greedy"])))
    rows.append(("generated (sampled)", repr(g["sampled"][0]) if g["sampled"] else "n/a"))
    rows.append(("cached == uncached greedy", str(g["cache_matches_no_cache"])))
    b = s.get("bench")
    if b:
        rows.append((f"bench DCFormer/{b['baseline']}",
                     f"{fmt_ratios(b['ratios'])}; peak memory {fmt_ratios(b['memory_ratios'])}"))
    rows.append(("wall time", f"{s['wall_time_s']:.0f} s (" + ", ".join(
        f"{k} {v:.0f}" for k, v in s["stage_seconds"].items()) + ")"))
    rows.append(("ok", str(s["ok"])))
    return rows


def print_summary(s: dict) -> None:
    rows = summary_rows(s)
    width = max(len(k) for k, _ in rows)
    print("\n== summary ==")
    print(f"| {'step'.ljust(width)} | result")
    print(f"|-{'-' * width}-|-------")
    for key, value in rows:
        print(f"| {key.ljust(width)} | {value}")


# ----------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--pythia", default=None, help="a GPT-NeoX checkpoint (Hub id such as EleutherAI/pythia-160m, or a "
                   "directory) instead of the tiny one built here")
    p.add_argument("--pythia-revision", default=None, help="Hub revision of --pythia (e.g. step100000)")
    p.add_argument("--output-dir", default=str(ROOT / "demo_out"), help="where everything is written (default "
                   "./demo_out; a previous demo's directory is replaced)")
    data = p.add_argument_group("fine-tuning data and settings (dcformer-train)")
    data.add_argument("--dataset", default=None, help="a Hub dataset instead of the files, e.g. wikitext")
    data.add_argument("--dataset-config", default=None, help="its configuration, e.g. wikitext-2-raw-v1")
    data.add_argument("--train-file", default=str(TRAIN_TXT), help="training text: .txt (a line an example), .json, "
                      ".jsonl (default: the bundled examples/data/harbour_train.txt)")
    data.add_argument("--validation-file", default=str(VALID_TXT), help="validation text (default: the bundled one)")
    data.add_argument("--train-steps", type=int, default=200, help="optimizer steps (default 200)")
    data.add_argument("--batch-size", type=int, default=8, help="blocks a step (default 8)")
    data.add_argument("--block-size", type=int, default=None, help="tokens a block (default 64 for the tiny model, "
                      "else train_clm's default: up to 1024)")
    data.add_argument("--learning-rate", type=float, default=None, help="default 3e-3 (tiny, from scratch) or 5e-5")
    data.add_argument("--max-eval-samples", type=int, default=None, help="validation blocks to score (default all)")
    data.add_argument("--train-args", default="", help="more train_clm.py / TrainingArguments flags, one string "
                      "(with '=' when it starts with a dash): --train-args=\"--bf16 --activation_checkpointing\"")
    ev = p.add_argument_group("evaluation (lm-eval through modeling_dcformer.evals.harness)")
    ev.add_argument("--tasks", default=LOCAL_TASKS, help=f"comma-separated lm-eval tasks (default {LOCAL_TASKS}: "
                    "offline copies on evals/fixtures; real ones: lambada_openai,piqa,hellaswag)")
    ev.add_argument("--limit", type=int, default=20, help="rows a task (default 20; 0: all)")
    ev.add_argument("--eval-batch-size", type=int, default=8)
    ev.add_argument("--bootstrap-iters", type=int, default=1000, help="lm-eval's bootstrap for stderrs (default "
                    "1000; lm-eval's own default is 100000)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:0, ... (default: cuda if available, else cpu)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: 1 for the tiny model, "
                   "torch's default otherwise)")
    p.add_argument("--push-to-hub", default=None, metavar="REPO", help="push the model (model.push_to_hub: weights, "
                   "config, remote code, model card) and the tokenizer to this Hub repo once the reload checks pass")
    p.add_argument("--prompt", default="The harbour town of")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--samples", type=int, default=2, help="sampled continuations")
    p.add_argument("--no-bench", action="store_true", help="skip benchmarks/bench_model.py --quick")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dataset:
        args.train_file = args.validation_file = None
    if args.train_steps < 1:
        p.error("--train-steps must be at least 1")
    if args.limit < 0:
        p.error(f"--limit {args.limit}: give a number of rows a task, or 0 for every row")
    return args


def run(argv=None, t_start: float | None = None) -> dict:
    """Runs the demo; returns the summary (also written to OUTPUT_DIR/summary.json). Wall time from `t_start`
    (a `time.perf_counter()` value; default: now)."""
    args = parse_args(argv)
    t_start = time.perf_counter() if t_start is None else t_start
    tiny = args.pythia is None
    threads = args.threads or (1 if tiny else None)
    if threads:
        torch.set_num_threads(threads)  # a tiny model: more threads only cost synchronisation
    hf_logging.set_verbosity_warning()
    out = Path(args.output_dir).resolve()
    prepare_output_dir(out)
    stages: dict[str, float] = {}
    summary: dict = {"output_dir": str(out), "device": args.device, "torch": torch.__version__}

    def stage(name: str, t0: float) -> None:
        stages[name] = time.perf_counter() - t0

    print(f"DCFormer demo: output in {out}, device {args.device}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s)")

    banner(1, "Pythia" + (f" ({args.pythia})" if args.pythia else ": a tiny GPT-NeoX and tokenizer, built here"))
    t0 = time.perf_counter()
    if tiny:
        texts_file = args.train_file if args.train_file and args.train_file.endswith(".txt") else str(TRAIN_TXT)
        summary["source"] = build_tiny_pythia(out / "pythia-tiny", read_lines([texts_file]), args.seed)
        src = str(out / "pythia-tiny")
    else:
        src = args.pythia
        summary["source"] = {"source": args.pythia, "dir": args.pythia, "revision": args.pythia_revision}
    stage("pythia", t0)

    banner(2, "Convert to DCPythia (dcformer-convert-pythia --verify)")
    t0 = time.perf_counter()
    converted_dir = out / source_name(src)
    summary["conversion"] = convert(src, converted_dir, args.pythia_revision)
    stage("convert", t0)

    banner(3, "Fine-tune with Trainer (dcformer-train)")
    t0 = time.perf_counter()
    trainer, summary["training"] = finetune(finetune_argv(args, converted_dir, out / "finetune", tiny))
    hf_logging.set_verbosity_warning()
    # Mixed precision (--bf16 / --fp16) leaves accelerate's autocast wrapper on the model's forward: take it off,
    # so that what is evaluated, checked and generated from is the model as saved (fp32 weights, fp32 compute).
    model = trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False)
    model, tokenizer = model.to(args.device).eval(), trainer.processing_class
    del trainer
    t = summary["training"]
    print(f"fine-tuned {t['steps']} steps at {t['seconds_per_step']:.3f} s/step: validation loss "
          f"{fmt(t['eval_loss_before'])} -> {fmt(t['eval_loss_after'])}")
    stage("finetune", t0)

    banner(4, "Evaluate with lm-eval (modeling_dcformer.evals.harness)")
    t0 = time.perf_counter()
    model_dir = out / f"{source_name(src)}-finetuned"
    summary["evaluation"] = evaluate(model, tokenizer, [t for t in args.tasks.split(",") if t], out, model_dir.name,
                                     args.limit, args.eval_batch_size, args.bootstrap_iters)
    for task, metrics in summary["evaluation"]["tasks"].items():
        print(f"{task}: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items() if isinstance(v, float)))
    stage("evaluate", t0)

    banner(5, "Save (save_pretrained)")
    t0 = time.perf_counter()
    eval_file = Path(summary["evaluation"]["results_file"])
    summary["save"] = save(model, tokenizer, model_dir, eval_file, args.push_to_hub)
    stage("save", t0)

    banner(6, "Reload: natively, and with trust_remote_code in an isolated process")
    t0 = time.perf_counter()
    ids = check_inputs(tokenizer, model.config.vocab_size)
    reference = logits_of(model, ids)
    summary["reload"] = {"native": reload_native(model_dir, reference, ids, args.device)}
    tolerance = 1e-5 if args.device == "cpu" else 1e-3  # the child runs on the CPU
    summary["reload"]["remote_code"] = reload_remote(model_dir, reference, ids, tolerance)
    stage("reload", t0)
    checks_ok = summary["reload"]["native"]["ok"] and summary["reload"]["remote_code"]["ok"]
    if args.push_to_hub:
        if checks_ok:
            t0 = time.perf_counter()
            summary["pushed_to"] = push_to_hub(model, tokenizer, args.push_to_hub, eval_file)
            stage("push", t0)
        else:
            logger.warning(f"not pushing to {args.push_to_hub}: a reload check failed")

    banner(7, "Generate (greedy and sampled, with the KV cache)")
    t0 = time.perf_counter()
    summary["generation"] = generate(model, tokenizer, args.prompt, args.max_new_tokens, args.samples, args.seed)
    stage("generate", t0)

    if not args.no_bench:
        banner(8, "Benchmark (benchmarks/bench_model.py --quick) and summary")
        t0 = time.perf_counter()
        summary["bench"] = run_quick_bench(out)
        stage("bench", t0)
    else:
        banner(8, "Summary")

    summary["ok"] = bool(summary["conversion"]["verified"] and checks_ok
                         and summary["generation"]["cache_matches_no_cache"])
    summary["stage_seconds"] = stages
    summary["wall_time_s"] = time.perf_counter() - t_start
    print_summary(summary)
    write_json_atomic(out / SUMMARY, summary)
    print(f"\n{out / SUMMARY} written; the fine-tuned model is in {model_dir}")
    return summary


def main(argv=None, t_start: float | None = None) -> int:
    from modeling_dcformer.evals.harness import DataUnreachableError

    try:
        return 0 if run(argv, t_start)["ok"] else 1
    except DataUnreachableError as err:  # a real task's data set offline: the harness's one line, no traceback
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(t_start=_T_MODULE))
