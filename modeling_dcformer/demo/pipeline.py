"""The steps of the main job (`examples/demo.py`): a tiny Pythia, conversion to DCPythia, fine-tuning with
`dcformer-train`, lm-eval, `save_pretrained`, reloading natively and with remote code in an isolated process
where the installed package is blocked, and generation. Each step is a function that prints what it does and
returns a small summary dict.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, GPTNeoXConfig, GPTNeoXForCausalLM
from transformers.utils import logging as hf_logging

logger = hf_logging.get_logger("dcformer.demo")

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



def build_tiny_pythia(dst: Path, tokenizer_texts: list[str], seed: int) -> dict:
    """A random GPT-NeoX causal LM of Pythia's layout and a byte-level BPE tokenizer, saved to `dst`."""
    from ..checkpoints.atomic_dir import replacing
    from ..training.tokenizer import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(tokenizer_texts, TINY_PYTHIA["vocab_size"])
    torch.manual_seed(seed)
    model = GPTNeoXForCausalLM(GPTNeoXConfig(**TINY_PYTHIA)).eval()
    with replacing(dst, overwrite=False) as tmp:
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


def convert(src: str, dst: Path, revision: str | None) -> dict:
    """dcformer-convert-pythia's command line, with --verify; the measured difference is read back from
    the config it wrote (`conversion.max_logit_difference`)."""
    from ..conversion import pythia as p2d

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


def finetune(argv: list[str]):
    """dcformer-train's command line (`train_clm.main(argv)`, Trainer); returns (trainer, the step's summary)."""
    from ..training import train_clm

    print(f"$ dcformer-train {shlex.join(argv)}", flush=True)
    trainer = train_clm.main(argv)
    out_dir = trainer.args.output_dir
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


def evaluate(model, tokenizer, tasks: list[str], out: Path, model_name: str, limit: int | None = None,
             batch_size: int = 8, bootstrap_iters: int = 1000) -> dict:
    """lm-eval through evals.harness on the in-memory model; accuracies (and LAMBADA's perplexity) per task."""
    from ..evals.harness import evaluate as lm_eval_evaluate

    limit = limit or None
    print(f"lm-eval tasks {', '.join(tasks)}, limit {limit or 'none'} (rows a task), batch size {batch_size}",
          flush=True)
    results = lm_eval_evaluate(
        model, tokenizer, tasks, batch_size=batch_size, limit=limit, bootstrap_iters=bootstrap_iters,
        output_path=out / "eval_results.json", model_name=model_name,
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


def check_inputs(tokenizer, vocab_size: int) -> torch.Tensor:
    text = "The tide turns before dawn, and the boats leave the harbour one after another."
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    return ids.clamp(max=vocab_size - 1)


def save(model, tokenizer, dst: Path, eval_file: Path | None, repo_id: str | None) -> dict:
    """save_pretrained (tokenizer, then model: the model's card then loads the tokenizer from the directory) into a
    directory that appears only when complete. Where save_pretrained writes a model card, it gets the directory's (or
    the Hub repo's) name and the lm-eval results."""
    from ..checkpoints.atomic_dir import replacing

    card = {"model_name": repo_id.split("/")[-1] if repo_id else dst.name, "repo_id": repo_id}
    if eval_file is not None and eval_file.is_file():
        card["eval_results"] = str(eval_file)
    with replacing(dst, overwrite=True) as tmp:
        tokenizer.save_pretrained(tmp)
        model.save_pretrained(tmp, model_card=card)
    config = json.loads((dst / "config.json").read_text())
    auto_map = config.get("auto_map")
    files = sorted(p.name for p in dst.iterdir())
    py_files = [f for f in files if f.endswith(".py")]
    print(f"saved to {dst}: {', '.join(files)}")
    print(f"auto_map {auto_map}: the directory carries its own code (trust_remote_code=True)")
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
            raise ModuleNotFoundError(f"{name} is blocked: as if not installed", name="modeling_dcformer")
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
    if eval_file is not None and eval_file.is_file():
        kwargs["eval_results"] = str(eval_file)
    model.push_to_hub(repo_id, **kwargs)
    tokenizer.push_to_hub(repo_id, commit_message=f"{message}: tokenizer")
    url = f"https://huggingface.co/{repo_id}"
    print(f"pushed the model and its tokenizer to {url}")
    return url


def generate(model, tokenizer, prompt: str, max_new_tokens: int = 24, samples: int = 2, seed: int = 0) -> dict:
    """Greedy generation with and without the cache (they must agree) and `samples` sampled continuations."""
    inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    common = dict(max_new_tokens=max_new_tokens, pad_token_id=pad)
    runs = [("greedy, cache", dict(do_sample=False)), ("greedy, no cache", dict(do_sample=False, use_cache=False)),
            ("sampled, cache", dict(do_sample=True, temperature=0.8, top_k=40, num_return_sequences=samples))]
    outputs = {}
    with torch.inference_mode():
        for name, kwargs in tqdm(runs, desc="Generating", unit="run"):
            torch.manual_seed(seed)
            outputs[name] = model.generate(**inputs, **common, **kwargs)
    decode = lambda row: tokenizer.decode(row, skip_special_tokens=True)  # noqa: E731
    greedy, sampled = decode(outputs["greedy, cache"][0]), [decode(row) for row in outputs["sampled, cache"]]
    same = torch.equal(outputs["greedy, cache"], outputs["greedy, no cache"])
    print(f"prompt:   {prompt!r}\ngreedy:   {greedy!r}")
    for i, text in enumerate(sampled):
        print(f"sample {i}: {text!r}")
    print(f"greedy with the DCFormer cache == greedy without cache: {same}")
    new_tokens = outputs["greedy, cache"].shape[1] - inputs["input_ids"].shape[1]
    return {"prompt": prompt, "greedy": greedy, "sampled": sampled, "new_tokens": int(new_tokens),
            "cache_matches_no_cache": same}
