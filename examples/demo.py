#!/usr/bin/env python3
"""The main job, end to end: Pythia -> DCPythia -> fine-tune -> evaluate -> save -> reload -> generate.

    python examples/demo.py                       # what `make demo` runs: a tiny model, offline, about a minute
    python examples/demo.py --output-dir /tmp/d   # elsewhere than ./demo_out
    python examples/demo.py --no-bench            # skip benchmarks/bench_model.py --quick

With its defaults nothing is downloaded; every step is the real-size path run on a tiny model:

1. Pythia: a tiny random GPTNeoXForCausalLM (Pythia's layout: parallel residual, rotary on 1/4 of each head,
   a vocabulary padded beyond the tokenizer) with a byte-level BPE tokenizer trained here on the bundled corpus
   (examples/tokenizer_utils.py), saved as a checkpoint directory.   Real size: --pythia EleutherAI/pythia-160m
2. Conversion: dcformer-convert-pythia (its command line, `main(argv)`) with --verify: the DCPythia's
   fp32 logits must equal the Pythia's (max |difference| <= 1e-4) or nothing is written.
3. Fine-tuning: examples/train_clm.py (its command line, `main(argv)`: Trainer) on examples/data/, with the
   validation loss measured before and after.   Real size: --dataset wikitext --dataset-config wikitext-2-raw-v1
4. Evaluation: lm-eval 0.4.13 through evals.harness on offline copies of LAMBADA, PIQA and HellaSwag
   (evals/fixtures; `--limit` rows a task).   Real size: --tasks lambada_openai,piqa,hellaswag --limit 0
5. Saving: `save_pretrained` (+ the tokenizer) into OUTPUT_DIR/dcpythia-<size>-finetuned; when the saved config
   has an `auto_map`, the directory carries its own modeling code (`trust_remote_code=True`) and a model card
   with the lm-eval results.   --push-to-hub REPO pushes the model once the checks of step 6 have passed.
6. Reloading: natively (AutoModelForCausalLM.from_pretrained, logits equal to the in-memory model's) and, with
   remote code, in an isolated `python -I` process started from an empty directory, in which the installed
   `modeling_dcformer` package is blocked from importing (the saved code alone must do).
7. Generation: greedy (cached == uncached) and sampled, with the KV cache.
8. A summary table (also OUTPUT_DIR/summary.json, written last: a directory without it is unfinished), and the
   DCFormer/GPT-NeoX ratios of `benchmarks/bench_model.py --quick` (a subprocess: it forks).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_T_MODULE = time.perf_counter()  # the script's wall time counts its imports too
EXAMPLES = Path(__file__).resolve().parent
ROOT = EXAMPLES.parent
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DISABLE_MULTIPROC", "1")  # lm-eval's bootstrap stderr in this process: no fork after torch

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, GPTNeoXConfig, GPTNeoXForCausalLM
from transformers.utils import logging as hf_logging

import modeling_dcformer  # noqa: F401  (registers "dcformer" with the Auto classes)

logger = hf_logging.get_logger("dcformer.demo")

DATA_DIR = EXAMPLES / "data"
TRAIN_TXT = DATA_DIR / "harbour_train.txt"
VALID_TXT = DATA_DIR / "harbour_validation.txt"
BENCH = ROOT / "benchmarks" / "bench_model.py"
LOCAL_TASKS = "lambada_openai_local,piqa_local,hellaswag_local"
MARKER = ".dcformer-demo"  # marks a directory this script created (and may clear on the next run)
SUMMARY = "summary.json"
# The tiny Pythia: Pythia-70m's layout at toy size (hidden 64, 2 layers, 4 heads, rotary on 1/4 of each head,
# parallel residual, untied head, a vocabulary of 512 rows that the tokenizer need not fill).
TINY_PYTHIA = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=256,
    max_position_embeddings=256,
    rotary_pct=0.25,
    use_parallel_residual=True,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=0,
)


def source_name(src: str) -> str:
    """dcpythia-160m for EleutherAI/pythia-160m, dcpythia-tiny for the tiny one, dc-<name> for other GPT-NeoX."""
    name = Path(src.rstrip("/")).name
    return "dc" + name if name.startswith("pythia") else f"dc-{name}"


def banner(step: int, title: str) -> None:
    print(f"\n== {step}/8 {title} ==", flush=True)


# ----------------------------------------------------------------------------------------------------------------
# Output directory
# ----------------------------------------------------------------------------------------------------------------
def prepare_output_dir(out: Path) -> None:
    """An empty directory marked as ours. A previous demo run's directory is cleared; anything else that is not
    empty is refused (nothing of the user's is deleted)."""
    if out.exists() and any(out.iterdir()):
        if not (out / MARKER).is_file():
            raise SystemExit(f"error: {out} is not empty and was not made by this demo: choose another --output-dir")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("created by examples/demo.py; summary.json appears only when a run completes\n")


def write_json_atomic(path: Path, payload: dict) -> None:
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------------------------
# 1. The tiny Pythia
# ----------------------------------------------------------------------------------------------------------------
def build_tiny_pythia(dst: Path, tokenizer_texts: list[str], seed: int) -> dict:
    """A random GPT-NeoX causal LM of Pythia's layout and a byte-level BPE tokenizer, saved to `dst`."""
    from modeling_dcformer.conversion.common import atomic_output_dir
    from tokenizer_utils import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(tokenizer_texts, TINY_PYTHIA["vocab_size"])
    torch.manual_seed(seed)
    model = GPTNeoXForCausalLM(GPTNeoXConfig(**TINY_PYTHIA)).eval()
    with atomic_output_dir(dst) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"tiny Pythia: GPTNeoXForCausalLM, {n_params:,} parameters (hidden {TINY_PYTHIA['hidden_size']}, "
        f"{TINY_PYTHIA['num_hidden_layers']} layers, {TINY_PYTHIA['num_attention_heads']} heads, vocabulary "
        f"{TINY_PYTHIA['vocab_size']}); tokenizer: byte-level BPE, {len(tokenizer)} tokens; saved to {dst}"
    )
    return {"source": "tiny random GPT-NeoX built here", "dir": str(dst), "parameters": n_params,
            "tokenizer_size": len(tokenizer)}


# ----------------------------------------------------------------------------------------------------------------
# 2. Conversion
# ----------------------------------------------------------------------------------------------------------------
def convert(src: str, dst: Path, revision: str | None) -> dict:
    """dcformer-convert-pythia's command line, with --verify; the measured difference is read back from
    the config it wrote (`conversion.max_logit_difference`)."""
    from modeling_dcformer.conversion import pythia_to_dcpythia as p2d

    argv = [src, str(dst), "--verify", "--overwrite"]
    if revision:
        argv += ["--revision", revision]
    print(f"$ dcformer-convert-pythia {shlex.join(argv)}", flush=True)
    code = p2d.main(argv)
    if code != 0:
        raise SystemExit(f"error: the conversion failed (exit code {code}); see the message above")
    conversion = json.loads((dst / "config.json").read_text())["conversion"]
    diff = conversion["max_logit_difference"]
    return {"dir": str(dst), "verified": diff <= p2d.DEFAULT_TOLERANCE, "max_logit_difference": diff,
            "tolerance": p2d.DEFAULT_TOLERANCE}


# ----------------------------------------------------------------------------------------------------------------
# 3. Fine-tuning
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


def finetune(args, model_dir: Path, out_dir: Path, tiny: bool):
    """examples/train_clm.py's command line (`main(argv)`, Trainer); returns (trainer, the step's summary)."""
    import train_clm

    argv = finetune_argv(args, model_dir, out_dir, tiny)
    print(f"$ python examples/train_clm.py {shlex.join(argv)}", flush=True)
    trainer = train_clm.main(argv)
    history = trainer.state.log_history
    train_losses = [(h["step"], h["loss"]) for h in history if "loss" in h]
    evals = [h for h in history if "eval_loss" in h]
    end = next(h for h in history if "train_runtime" in h)
    # train_runtime includes the evaluation at step 0 (eval_on_start): take it out of the time per step.
    in_loop_eval = sum(h.get("eval_runtime", 0.0) for h in evals[:-1])
    steps = trainer.state.global_step
    summary = {
        "dir": str(out_dir),
        "steps": steps,
        "seconds_per_step": (end["train_runtime"] - in_loop_eval) / max(steps, 1),
        "train_loss_first": train_losses[0][1] if train_losses else None,
        "train_loss_last": train_losses[-1][1] if train_losses else None,
        "logging_steps": trainer.args.logging_steps,
        "eval_loss_before": evals[0]["eval_loss"] if len(evals) > 1 else None,
        "eval_loss_after": evals[-1]["eval_loss"] if evals else None,
    }
    if summary["eval_loss_after"] is not None:
        summary["perplexity_after"] = math.exp(min(summary["eval_loss_after"], 700.0))
    return trainer, summary


# ----------------------------------------------------------------------------------------------------------------
# 4. Evaluation
# ----------------------------------------------------------------------------------------------------------------
def evaluate(model, tokenizer, args, out: Path, model_name: str) -> dict:
    """lm-eval through evals.harness on the in-memory model; accuracies (and LAMBADA's perplexity) per task."""
    from modeling_dcformer.evals.harness import evaluate as lm_eval_evaluate

    tasks = [t for t in args.tasks.split(",") if t]
    limit = args.limit or None
    print(f"lm-eval tasks {', '.join(tasks)}, limit {limit or 'none'} (rows a task), batch size {args.eval_batch_size}",
          flush=True)
    results = lm_eval_evaluate(
        model, tokenizer, tasks, batch_size=args.eval_batch_size, limit=limit,
        bootstrap_iters=args.bootstrap_iters, output_path=out / "eval_results.json", model_name=model_name,
    )
    per_task = {}
    for task in tasks:
        metrics = results["results"].get(task, {})
        per_task[task] = {
            name.split(",")[0]: value for name, value in metrics.items()
            if name.split(",")[0] in ("acc", "acc_norm", "perplexity") and isinstance(value, (int, float))
        }
        per_task[task]["samples"] = results.get("n-samples", {}).get(task, {}).get("effective")
    return {"tasks": per_task, "limit": limit, "results_file": str(out / "eval_results.json")}


# ----------------------------------------------------------------------------------------------------------------
# 5-6. Saving and reloading
# ----------------------------------------------------------------------------------------------------------------
def check_inputs(tokenizer, vocab_size: int) -> torch.Tensor:
    text = "The tide turns before dawn, and the boats leave the harbour one after another."
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    return ids.clamp(max=vocab_size - 1)


def card_options_supported(model) -> bool:
    """Whether this version of modeling_dcformer's save_pretrained writes a model card with options."""
    return "model_card" in inspect.signature(model.save_pretrained).parameters


def save(model, tokenizer, dst: Path, eval_file: Path | None, repo_id: str | None) -> dict:
    """save_pretrained (model and tokenizer) into a directory that appears only when complete. Where
    save_pretrained writes a model card, it gets the directory's (or the Hub repo's) name and the lm-eval results."""
    from modeling_dcformer.conversion.common import atomic_output_dir

    kwargs = {}
    if card_options_supported(model):
        card = {"model_name": repo_id.split("/")[-1] if repo_id else dst.name, "repo_id": repo_id}
        if eval_file is not None and eval_file.is_file():
            card["eval_results"] = str(eval_file)
        kwargs["model_card"] = card
    with atomic_output_dir(dst, overwrite=True) as tmp:
        model.save_pretrained(tmp, **kwargs)
        tokenizer.save_pretrained(tmp)
    config = json.loads((dst / "config.json").read_text())
    auto_map = config.get("auto_map")
    files = sorted(p.name for p in dst.iterdir())
    py_files = [f for f in files if f.endswith(".py")]
    print(f"saved to {dst}: {', '.join(files)}")
    if auto_map:
        print(f"auto_map {auto_map}: the directory carries its own code (trust_remote_code=True)")
    else:
        logger.warning("NOTE: the saved config.json has no auto_map: this version of modeling_dcformer's "
                       "save_pretrained does not write remote code yet, so the directory loads only where "
                       "modeling_dcformer is installed (`import modeling_dcformer` first); the remote-code reload "
                       "check is skipped")
    return {"dir": str(dst), "files": files, "auto_map": auto_map, "remote_code_files": py_files,
            "model_card": "README.md" in files}


@torch.no_grad()
def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids.to(model.device), use_cache=False).logits.float().cpu()


def reload_native(model_dir: Path, reference: torch.Tensor, ids: torch.Tensor, device: str) -> dict:
    reloaded = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    diff = float((logits_of(reloaded, ids) - reference).abs().max())
    ok = diff <= 1e-5
    print(f"native reload ({type(reloaded).__name__}): max |logit difference| vs the in-memory model = {diff:.2e}: "
          f"{'OK' if ok else 'FAILED'}")
    return {"ok": ok, "max_abs_diff": diff, "class": type(reloaded).__name__}


# Runs in `python -I` from an empty directory: loads the saved model with trust_remote_code=True while the
# installed modeling_dcformer package is blocked, and writes its logits and a small report.
REMOTE_CHILD = r"""
import importlib.abc, importlib.util, json, os, sys
report = {"modeling_dcformer_importable": importlib.util.find_spec("modeling_dcformer") is not None}

class BlockInstalledPackage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "modeling_dcformer" or name.startswith("modeling_dcformer."):
            raise ImportError(f"{name} is blocked: the saved remote code must not need the installed package")
        return None

sys.meta_path.insert(0, BlockInstalledPackage())
import torch
from transformers import AutoModelForCausalLM
model_dir, ids_file, out_file = sys.argv[1:4]
torch.set_num_threads(1)
model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True, dtype=torch.float32).eval()
report["class"] = f"{type(model).__module__}.{type(model).__qualname__}"
report["installed_package_loaded"] = any(m.split(".")[0] == "modeling_dcformer" for m in sys.modules)
ids = torch.tensor(json.load(open(ids_file)))
with torch.no_grad():
    torch.save(model(ids, use_cache=False).logits.float(), out_file)
json.dump(report, open(out_file + ".json", "w"))
"""


def reload_remote(model_dir: Path, reference: torch.Tensor, ids: torch.Tensor, tolerance: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="dcformer-remote-") as tmp:
        tmp = Path(tmp)
        (tmp / "ids.json").write_text(json.dumps(ids.tolist()))
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp / "modules"), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-I", "-c", REMOTE_CHILD, str(model_dir.resolve()), "ids.json", "logits.pt"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            print("remote-code reload: FAILED (the isolated process could not load or run the saved model)")
            return {"status": "failed", "ok": False, "error": proc.stderr.strip().splitlines()[-1:]}
        report = json.loads((tmp / "logits.pt.json").read_text())
        logits = torch.load(tmp / "logits.pt")
    diff = float((logits - reference).abs().max())
    ok = diff <= tolerance and report["class"].startswith("transformers_modules.") and not report[
        "installed_package_loaded"]
    print(f"remote-code reload in an isolated process ({time.perf_counter() - t0:.0f}s, class {report['class']}): "
          f"max |logit difference| = {diff:.2e}: {'OK' if ok else 'FAILED'}")
    if report["modeling_dcformer_importable"]:
        print("  note: modeling_dcformer is importable even under `python -I` from an empty directory (the editable "
              "install puts it on every interpreter's path); the child blocked it, so only the saved code ran")
    return {"status": "ok" if ok else "failed", "ok": ok, "max_abs_diff": diff, **report}


def push_to_hub(model, tokenizer, repo_id: str, eval_file: Path | None) -> str:
    """`push_to_hub` of the model (weights, config, and what save_pretrained writes beside them: remote code and
    model card, with the lm-eval results where supported) and of the tokenizer, to the Hub repository `repo_id`."""
    message = "DCPythia fine-tuned by examples/demo.py"
    kwargs = {"commit_message": message}
    if card_options_supported(model) and eval_file is not None and eval_file.is_file():
        kwargs["eval_results"] = str(eval_file)
    model.push_to_hub(repo_id, **kwargs)
    tokenizer.push_to_hub(repo_id, commit_message=f"{message}: tokenizer")
    url = f"https://huggingface.co/{repo_id}"
    print(f"pushed the model and its tokenizer to {url}")
    return url


# ----------------------------------------------------------------------------------------------------------------
# 7. Generation
# ----------------------------------------------------------------------------------------------------------------
def generate(model, tokenizer, args) -> dict:
    inputs = tokenizer(args.prompt, return_tensors="pt").to(model.device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    common = dict(max_new_tokens=args.max_new_tokens, pad_token_id=pad)
    runs = [("greedy, cache", dict(do_sample=False)), ("greedy, no cache", dict(do_sample=False, use_cache=False)),
            ("sampled, cache", dict(do_sample=True, temperature=0.8, top_k=40, num_return_sequences=args.samples))]
    outputs = {}
    with torch.inference_mode():
        for name, kwargs in tqdm(runs, desc="Generating", unit="run"):
            torch.manual_seed(args.seed)
            outputs[name] = model.generate(**inputs, **common, **kwargs)
    decode = lambda row: tokenizer.decode(row, skip_special_tokens=True)  # noqa: E731
    greedy, sampled = decode(outputs["greedy, cache"][0]), [decode(row) for row in outputs["sampled, cache"]]
    same = torch.equal(outputs["greedy, cache"], outputs["greedy, no cache"])
    print(f"prompt:   {args.prompt!r}\ngreedy:   {greedy!r}")
    for i, text in enumerate(sampled):
        print(f"sample {i}: {text!r}")
    print(f"greedy with the DCFormer cache == greedy without cache: {same}")
    new_tokens = outputs["greedy, cache"].shape[1] - inputs["input_ids"].shape[1]
    return {"prompt": args.prompt, "greedy": greedy, "sampled": sampled, "new_tokens": int(new_tokens),
            "cache_matches_no_cache": same}


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
    if r["status"] == "skipped":
        text = f"skipped: {r['reason']}"
    elif r["status"] == "failed" and "max_abs_diff" not in r:
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
    data = p.add_argument_group("fine-tuning data and settings (examples/train_clm.py)")
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
        from tokenizer_utils import read_lines

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

    banner(3, "Fine-tune with Trainer (examples/train_clm.py)")
    t0 = time.perf_counter()
    trainer, summary["training"] = finetune(args, converted_dir, out / "finetune", tiny)
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
    summary["evaluation"] = evaluate(model, tokenizer, args, out, model_dir.name)
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
    if summary["save"]["auto_map"]:
        tolerance = 1e-5 if args.device == "cpu" else 1e-3  # the child runs on the CPU
        summary["reload"]["remote_code"] = reload_remote(model_dir, reference, ids, tolerance)
    else:
        reason = "no auto_map in the saved config.json (save_pretrained does not write remote code yet)"
        print(f"remote-code reload: skipped ({reason})")
        summary["reload"]["remote_code"] = {"status": "skipped", "ok": None, "reason": reason}
    stage("reload", t0)
    checks_ok = summary["reload"]["native"]["ok"] and summary["reload"]["remote_code"]["ok"] is not False
    if args.push_to_hub:
        if checks_ok:
            t0 = time.perf_counter()
            summary["pushed_to"] = push_to_hub(model, tokenizer, args.push_to_hub, eval_file)
            stage("push", t0)
        else:
            logger.warning(f"not pushing to {args.push_to_hub}: a reload check failed")

    banner(7, "Generate (greedy and sampled, with the KV cache)")
    t0 = time.perf_counter()
    summary["generation"] = generate(model, tokenizer, args)
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
    return 0 if run(argv, t_start)["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(t_start=_T_MODULE))
