"""The longer language-modelling study (docs/evidence.md, "The longer study"): a queue of single
training runs of the small comparison, in a fixed priority order, that saves as it goes and resumes after an
interruption at any moment.

* `plan.json` in the study folder lists every run (id, phase, size, model, learning rate, seed, steps) and its
  status; the queue is deterministic: the rates of a later phase are chosen from the finished runs of an earlier
  one by a written rule (`resolve_plan`).
* Each run is one call of the comparison's runner (`runner.train_one`) with the comparison's own arguments
  (`compare.parse_args`); its result is written atomically to `runs/RUN_ID.json` when it ends, and a finished
  run is never trained again.
* Runs save a Trainer checkpoint every `--save-every` steps into `ckpt/RUN_ID/` (the two most recent kept, so
  one is always complete) and a restarted study continues from the last complete one (`resume_from_checkpoint`).
* `calibrate` measures the training step time of every model and size on one thread with nothing else of the
  study running (`calibration.json`); `report` rebuilds the tables and plots from the run files, with the seconds
  axis recomputed from the calibration (steps x calibrated step time), the measured seconds kept beside it.

    python -m dcformer_research.study run --out research/results/lm_study_long
    python -m dcformer_research.study calibrate --out research/results/lm_study_long
    python -m dcformer_research.study report --out research/results/lm_study_long
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from .ablation import build_model, matched_configs, variant_config
from .report import write_atomic
from .runner import STUDY_STATE, last_complete_checkpoint  # noqa: F401  (re-exported for the tests)

SIZES = {128: (128, 4, 3), 256: (256, 8, 3), 512: (512, 8, 3)}
MODEL_KINDS = ("transformer", "dcformer", "dcformer-qk")
BATCH, BLOCK, VOCAB = 16, 128, 2048


# ----------------------------------------------------------------------------------------------------------------
# Calibration: the step time of each model on one quiet thread


def calibration_configs(hidden: int, heads: int, layers: int) -> dict:
    """The configs the study trains at one size (the comparison's parameter matching; the Transformer is matched to
    the DCFormer without qk-norm, as in every comparison)."""
    shape = {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
             "intermediate_size": 4 * hidden}
    neox, dc, _ = matched_configs(shape, VOCAB, BLOCK, "sdpa", "auto", {"use_qk_norm": False})
    _, dc_qk, _ = matched_configs(shape, VOCAB, BLOCK, "sdpa", "auto", {"use_qk_norm": True})
    return {"transformer": neox, "dcformer": variant_config("dcformer", dc),
            "dcformer-qk": variant_config("dcformer", dc_qk)}


def calibrate(out: Path, sizes: list[int], steps: int = 8, warmup: int = 2, rounds: int = 2) -> dict:
    """Median seconds of one training step (forward, backward, clipping, AdamW) of a batch of 16 x 128 tokens,
    per size and model, on one thread: `warmup` steps of each model, then `steps * rounds` timed steps of each,
    the models of one size interleaved step by step (T, DC, DC-qk, T, ...) so that a change of load hits all of
    them alike (rounds of 10 steps a model, the earlier order, let two calibrations minutes apart disagree by 0.3
    on DC/T)."""
    torch.set_num_threads(1)
    result = {"threads": 1, "load_average_before": list(os.getloadavg()), "batch": BATCH, "block": BLOCK,
              "vocab": VOCAB, "torch": torch.__version__,
              "steps_per_round": steps, "rounds": rounds, "interleaved": "step", "step_seconds": {}}
    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(0, VOCAB, (BATCH, BLOCK), generator=generator)
    for hidden in sizes:
        configs = calibration_configs(*SIZES[hidden])
        states = {}
        for kind, config in configs.items():
            torch.manual_seed(0)
            model, _ = build_model("transformer" if kind == "transformer" else "dcformer", config)
            model.train()
            states[kind] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95)), [], [])
        for i in range(warmup + steps * rounds):
            for kind, (model, optimizer, times, cpu_times) in states.items():
                start, cpu_start = time.perf_counter(), time.process_time()
                loss = model(input_ids=batch, labels=batch, use_cache=False).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if i >= warmup:
                    times.append(time.perf_counter() - start)
                    cpu_times.append(time.process_time() - cpu_start)
        result["step_seconds"][str(hidden)] = {kind: statistics.median(s[2]) for kind, s in states.items()}
        result.setdefault("step_cpu_seconds", {})[str(hidden)] = {
            kind: statistics.median(s[3]) for kind, s in states.items()
        }
        print(f"calibration hidden {hidden}: " + ", ".join(
            f"{kind} {statistics.median(s[2]) * 1000:.0f} ms wall, {statistics.median(s[3]) * 1000:.0f} ms CPU"
            for kind, s in states.items()), flush=True)
    return result


def merge_calibration(earlier: dict | None, new: dict) -> dict:
    """`new` (a `calibrate` result) with the sizes of an `earlier` calibration that it did not measure kept as they
    were: `calibrate --sizes 256,512` must not drop the 128 entry. `measured` says when and under which load each
    size's entry was taken."""
    merged = json.loads(json.dumps(new))  # a copy: `new`'s tables stay as measured
    stamp = {k: new.get(k) for k in ("date", "load_average_before", "load_average_after")}
    merged["measured"] = {size: stamp for size in new["step_seconds"]}
    if not earlier:
        return merged
    earlier_stamp = {k: earlier.get(k) for k in ("date", "load_average_before", "load_average_after")}
    for table in ("step_seconds", "step_cpu_seconds"):
        for size, entry in (earlier.get(table) or {}).items():
            if size not in new["step_seconds"]:
                merged.setdefault(table, {})[size] = entry
                merged["measured"][size] = (earlier.get("measured") or {}).get(size, earlier_stamp)
    return merged


# ----------------------------------------------------------------------------------------------------------------
# The plan: a deterministic queue, re-derived from the finished runs after each one

GRID = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2)  # half-decade steps: the rates a sweep may try


def default_spec() -> dict:
    """The study of docs/evidence.md: the common flags of every run (those of the first study: 16 blocks of 128 BPE
    tokens a step, warm-up 10% of the steps, evaluation every 50 steps on 64 validation blocks), the short budget
    of the learning-rate sweep (150 steps, the first study's) and the long one of the comparison (600 steps: 4x the
    tokens), the sizes in priority order and the rates each sweep starts from."""
    return {
        "common": ["--task", "lm", "--batch-size", "16", "--block-size", "128", "--val-size", "64",
                   "--eval-every", "50", "--threads", "1", "--quiet"],
        "short_steps": 150,
        "long_steps": 600,
        "warmup_fraction": 0.1,
        "save_every": 50,
        "sizes": [[512, 8, 3], [256, 8, 3], [128, 4, 3]],
        "models": list(MODEL_KINDS),
        "sweep": {"transformer": [1e-3, 3e-3], "dcformer": [1e-3, 3e-3], "dcformer-qk": [1e-3, 3e-3]},
        "order": ["256:sweep", "256:long", "512:sweep", "256:seeds", "512:long", "256:lower", "512:lower",
                  "512:seeds", "128:sweep", "128:long", "128:lower", "128:seeds"],
        "seeds": [0, 1, 2],
        "grid": list(GRID),
        "import_from": "research/results/lm_study",
    }


def run_id(hidden: int, model: str, lr: float, seed: int, steps: int) -> str:
    return f"h{hidden}-{model}-lr{lr:g}-s{seed}-{steps}"


def grid_neighbour(lr: float, direction: int, grid=GRID) -> float | None:
    i = min(range(len(grid)), key=lambda k: abs(grid[k] - lr))
    j = i + direction
    return grid[j] if 0 <= j < len(grid) else None


def final_loss(result: dict | None) -> float:
    if result is None:
        return float("inf")
    loss = result["run"]["final"].get("lm_loss")
    return loss if loss is not None and loss == loss else float("inf")  # NaN (diverged) ranks last


def best_rate(results: dict, hidden: int, model: str, seed: int, steps: int, rates: list[float]) -> float | None:
    """The rate with the lowest final validation loss among `rates` (all finished), the lower rate on a tie; None
    while one is unfinished."""
    ids = [run_id(hidden, model, lr, seed, steps) for lr in rates]
    if not rates or any(i not in results for i in ids):
        return None
    return min(sorted(rates), key=lambda lr: final_loss(results[run_id(hidden, model, lr, seed, steps)]))


def bracket(results: dict, hidden, model, seed, steps, start: list[float], grid, lower_only: bool = False) -> tuple:
    """The rates of one sweep: `start`, extended by one grid step while the best finished rate is at an edge (at the
    top edge only when `lower_only` is False), so the best rate ends with a worse rate on both sides (or the edge of
    the grid). Returns (rates, best or None while unfinished)."""
    rates = sorted(start)
    while True:
        best = best_rate(results, hidden, model, seed, steps, rates)
        if best is None:
            return rates, None
        step = -1 if best == rates[0] else (1 if best == rates[-1] and not lower_only else 0)
        extra = grid_neighbour(best, step, grid) if step else None
        if extra is None or extra in rates:
            return rates, best
        rates = sorted(rates + [extra])


def build_plan(spec: dict, results: dict) -> list[dict]:
    """Every run of the study in priority order, with the rates chosen so far. Per size (512, then 256, then 128):
    (1) the sweep at the short budget, seed 0, bracketing each model's best rate on both sides; (2) the long budget,
    seed 0, at that rate and the next lower one (a longer schedule usually wants a lower rate), extended downwards
    while the lowest is best; then (3) the other seeds at each model's best long rate, for every size in the same
    order. A rate not yet known leaves the entry `waiting`."""
    plan = []
    short, long = spec["short_steps"], spec["long_steps"]

    def add(phase, hidden, model, lr, seed, steps, why):
        entry = {"phase": phase, "hidden": hidden, "model": model, "lr": lr, "seed": seed, "steps": steps, "why": why}
        if lr is None:
            entry.update(id=None, status="waiting")
        else:
            entry["id"] = run_id(hidden, model, lr, seed, steps)
            entry["status"] = "done" if entry["id"] in results else "pending"
        plan.append(entry)

    blocks = {}  # (hidden, "sweep" | "long" | "lower" | "seeds") -> entries
    for hidden, _, _ in spec["sizes"]:
        short_best = {}
        sweep, longs, lower_runs, seeded = [], [], [], []
        for model in spec["models"]:
            rates, best = bracket(results, hidden, model, spec["seeds"][0], short, spec["sweep"][model], spec["grid"])
            short_best[model] = best
            sweep += [(f"{hidden}-1-sweep", hidden, model, lr, spec["seeds"][0], short, "short sweep, bracketing")
                      for lr in rates]
        for model in spec["models"]:
            best = short_best[model]
            longs.append((f"{hidden}-2-long", hidden, model, best, spec["seeds"][0], long, "long, best short rate"))
        chosen = {}
        for model in spec["models"]:
            best = short_best[model]
            if best is None:
                lower_runs.append((f"{hidden}-3-lower", hidden, model, None, spec["seeds"][0], long, "long, lower"))
                chosen[model] = None
                continue
            lower = grid_neighbour(best, -1, spec["grid"])
            start = [best] + ([lower] if lower else [])
            rates, long_best = bracket(results, hidden, model, spec["seeds"][0], long, start, spec["grid"], True)
            lower_runs += [(f"{hidden}-3-lower", hidden, model, lr, spec["seeds"][0], long, "long, lower rates")
                           for lr in rates if lr != best]
            chosen[model] = long_best
        for seed in spec["seeds"][1:]:
            seeded += [(f"{hidden}-4-seeds", hidden, model, chosen[model], seed, long, "seed at the chosen rate")
                       for model in spec["models"]]
        blocks[hidden] = {"sweep": sweep, "long": longs, "lower": lower_runs, "seeds": seeded}
    for part in spec["order"]:  # e.g. ["512:sweep", "512:long", ...]
        hidden, name = part.split(":")
        for item in blocks[int(hidden)][name]:
            add(*item)
    return plan


# ----------------------------------------------------------------------------------------------------------------
# Running the queue


def run_argv(spec: dict, entry: dict, size: list[int], corpus: list[str] | None = None) -> list[str]:
    hidden, heads, layers = size
    steps = entry["steps"]
    argv = list(spec["common"]) + [
        "--steps", str(steps), "--warmup", str(max(1, round(spec["warmup_fraction"] * steps))),
        "--hidden", str(hidden), "--heads", str(heads), "--layers", str(layers),
        "--lr", repr(entry["lr"]), "--out", "unused",
    ]  # fmt: skip
    if entry["model"] == "dcformer-qk":
        argv.append("--qk-norm")
    return argv


def train_entry(spec: dict, entry: dict, out: Path, extra_callbacks: tuple = ()) -> dict:
    """Trains one planned run with the comparison's runner, checkpointing into out/ckpt/RUN_ID (resumed when a
    complete checkpoint is there); returns the run's result record."""
    from . import compare
    from .ablation import DC_MODELS
    from .runner import prepare_lm, train_one

    size = next(s for s in spec["sizes"] if s[0] == entry["hidden"])
    args = compare.parse_args(run_argv(spec, entry, size))
    torch.set_num_threads(args.threads)
    data, setup = prepare_lm(args)
    neox, dc, params = matched_configs(
        args.shape_dict, setup["vocab_size"], setup["max_position_embeddings"], args.baseline_attn,
        args.param_match, args.dc_overrides,
    )  # fmt: skip
    if entry["model"] == "dcformer-qk":  # the Transformer is matched to the DCFormer without qk-norm
        neox = matched_configs(
            args.shape_dict, setup["vocab_size"], setup["max_position_embeddings"], args.baseline_attn,
            args.param_match, {**args.dc_overrides, "use_qk_norm": False},
        )[0]  # fmt: skip
    configs = {"transformer": neox, **{k: variant_config(k, dc) for k in DC_MODELS}}
    kind = "transformer" if entry["model"] == "transformer" else "dcformer"
    ckpt = out / "ckpt" / entry["id"]
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    result = train_one(
        kind, entry["seed"], entry["lr"], args, configs, data, str(ckpt.parent), checkpoint_dir=str(ckpt),
        save_every=spec["save_every"], extra_callbacks=extra_callbacks,
    )  # fmt: skip
    return {
        "entry": entry,
        "setup": {k: v for k, v in setup.items() if k != "corpus"} | {"corpus": setup["corpus"]},
        "argv": run_argv(spec, entry, size),
        "parameters": params,
        "config": configs[kind].to_dict(),
        "transformer_config": neox.to_dict(),
        "run": result,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "load_average": list(os.getloadavg()),
    }


IMPORT_FLAGS = ("steps", "batch_size", "block_size", "warmup", "eval_every", "val_size", "data_seed", "schedule",
                "weight_decay", "baseline_attn", "param_match", "vocab_size", "max_position_embeddings")
VERSION_KEYS = ("transformers_version", "_name_or_path", "dtype", "torch_dtype", "architectures")


def comparable(config: dict) -> dict:
    """A config as stored in JSON (integer keys become strings), without the keys that name versions."""
    return {k: v for k, v in json.loads(json.dumps(config)).items() if k not in VERSION_KEYS}


def import_previous(out: Path, spec: dict, folder: Path) -> list[str]:
    """Copies the runs of the first study (`folder`/hHIDDEN-nHEADS-lLAYERS/results.json) into runs/ as finished
    short-budget runs, when they were made with exactly the flags, corpus (fingerprint) and model configs this study
    uses for its short budget; returns the ids imported. Anything that differs is left out with a message."""
    imported = []
    for hidden, heads, layers in spec["sizes"]:
        path = folder / f"h{hidden}-n{heads}-l{layers}" / "results.json"
        if not path.is_file():
            continue
        old = json.loads(path.read_text())
        entry = {"phase": "", "hidden": hidden, "model": "dcformer", "lr": 1e-3, "seed": 0,
                 "steps": spec["short_steps"]}
        size = [hidden, heads, layers]
        from . import compare
        from .runner import prepare_lm

        args = compare.parse_args(run_argv(spec, entry, size))
        _, setup = prepare_lm(args)
        mine = {"vocab_size": setup["vocab_size"], "max_position_embeddings": setup["max_position_embeddings"],
                **{k: getattr(args, k) for k in IMPORT_FLAGS if hasattr(args, k)}}
        differs = [k for k in IMPORT_FLAGS if old["setup"].get(k) != mine.get(k)]
        if old["setup"]["corpus"]["fingerprint"] != setup["corpus"]["fingerprint"]:
            differs.append("corpus fingerprint")
        neox, dc, _ = matched_configs(args.shape_dict, setup["vocab_size"], setup["max_position_embeddings"],
                                      args.baseline_attn, args.param_match, args.dc_overrides)
        for kind, config in (("transformer", neox), ("dcformer", dc)):
            if comparable(old["configs"][kind]) != comparable(config.to_dict()):
                differs.append(f"{kind} config")
        if differs:
            print(f"study: not importing {path}: it differs in {', '.join(differs)}")
            continue
        for run in old["runs"]:
            entry = {"phase": "imported", "hidden": hidden, "model": run["model"], "lr": run["lr"],
                     "seed": run["seed"], "steps": spec["short_steps"], "why": "the first study's run"}
            entry["id"] = run_id(hidden, run["model"], run["lr"], run["seed"], spec["short_steps"])
            target = out / "runs" / f"{entry['id']}.json"
            if target.exists():
                continue
            record = {"entry": entry, "setup": old["setup"], "parameters": old["parameters"],
                      "config": old["configs"][run["model"]], "transformer_config": old["configs"]["transformer"],
                      "run": run, "imported_from": str(path)}
            write_atomic(target, json.dumps(record, indent=1))
            imported.append(entry["id"])
    return imported


def load_results(out: Path) -> dict:
    results = {}
    for path in sorted((out / "runs").glob("*.json")):
        results[path.stem] = json.loads(path.read_text())
    return results


def write_plan(out: Path, spec: dict, plan: list[dict]) -> None:
    write_atomic(out / "plan.json", json.dumps({"spec": spec, "plan": plan}, indent=1))
    lines = ["# The study's queue (`python -m dcformer_research.study run`)", "",
             "In the order it runs; rewritten after every run. `waiting`: its rate comes from runs not finished yet.",
             "", "| # | phase | hidden | model | lr | seed | steps | status | why |",
             "|---|---|---|---|---|---|---|---|---|"]
    for i, e in enumerate(plan, 1):
        lr = f"{e['lr']:g}" if e["lr"] is not None else "?"
        lines.append(f"| {i} | {e['phase']} | {e['hidden']} | {e['model']} | {lr} | {e['seed']} | {e['steps']} | "
                     f"{e['status']} | {e['why']} |")
    done = sum(e["status"] == "done" for e in plan)
    lines += ["", f"{done} of {len(plan)} runs done."]
    write_atomic(out / "plan.md", "\n".join(lines) + "\n")


def run_study(out: Path, spec: dict, max_runs: int | None = None, extra_callbacks: tuple = ()) -> int:
    """Runs the queue until it is empty (or `max_runs` runs were trained); returns the number trained now. A
    finished run (its runs/RUN_ID.json) is never trained again; an interrupted one continues from its checkpoint."""
    (out / "runs").mkdir(parents=True, exist_ok=True)
    stored = out / "plan.json"
    if stored.is_file():
        old = json.loads(stored.read_text())["spec"]
        if old != spec:
            raise SystemExit(f"study: error: {stored} was made with another spec; use another --out")
    if spec.get("import_from") and not (out / "plan.json").is_file():
        folder = Path(spec["import_from"])
        if not folder.is_absolute():  # relative to the repository (the package is installed editable from it)
            folder = Path(__file__).resolve().parents[2] / folder
        ids = import_previous(out, spec, folder)
        print(f"study: imported {len(ids)} runs of the first study: {', '.join(ids) or 'none'}")
    trained = 0
    while True:
        results = load_results(out)
        plan = build_plan(spec, results)
        write_plan(out, spec, plan)
        todo = [e for e in plan if e["status"] == "pending"]
        if not todo or (max_runs is not None and trained >= max_runs):
            return trained
        entry = todo[0]
        print(f"##### {entry['id']} ({entry['phase']}: {entry['why']})", flush=True)
        record = train_entry(spec, entry, out, extra_callbacks)
        write_atomic(out / "runs" / f"{entry['id']}.json", json.dumps(record, indent=1))
        shutil.rmtree(out / "ckpt" / entry["id"], ignore_errors=True)
        trained += 1
        print(f"##### {entry['id']} done: final loss {final_loss(record):.4f}", flush=True)


# ----------------------------------------------------------------------------------------------------------------
# Reports: the sweep, and the long comparison on three axes (seconds from the calibration)

LABEL = {"transformer": "Transformer", "dcformer": "DCFormer", "dcformer-qk": "DCFormer + qk-norm"}


def calibrated(calibration: dict | None, hidden: int, model: str) -> float | None:
    """The calibrated seconds of one training step: the CPU time of the step on its one thread where recorded (what
    the step costs a core: on a quiet machine it equals the wall time; on a loaded one the wall time also counts
    the waiting for a core), else the wall time."""
    if not calibration:
        return None
    table = calibration.get("step_cpu_seconds") or calibration["step_seconds"]
    return table.get(str(hidden), {}).get(model)


def chosen_long_rate(spec: dict, results: dict, hidden: int, model: str) -> float | None:
    """The long budget's rate of a model: the best of its finished seed-0 long runs (the plan's rule once they are
    all finished; until then, the best so far)."""
    seed, steps = spec["seeds"][0], spec["long_steps"]
    rates = [r["entry"]["lr"] for r in results.values() if r["entry"]["hidden"] == hidden
             and r["entry"]["model"] == model and r["entry"]["seed"] == seed and r["entry"]["steps"] == steps]
    return best_rate(results, hidden, model, seed, steps, rates) if rates else None


def comparison_report(spec: dict, results: dict, hidden: int, dc_model: str, calibration: dict | None) -> dict | None:
    """The long runs of the Transformer and one DCFormer (`dcformer` or `dcformer-qk`) at one size, at their
    chosen rates, as a comparison's results.json (`report.write_reports` draws it). The seconds axis is steps x the
    calibrated step time; the measured seconds stay in `measured_train_seconds_at_step`."""
    from . import compare

    runs, configs, base = [], {}, None
    chosen = {}
    for model, kind in (("transformer", "transformer"), (dc_model, "dcformer")):
        lr = chosen_long_rate(spec, results, hidden, model)
        if lr is None:
            return None
        chosen[kind] = lr
        for record in results.values():
            e = record["entry"]
            if (e["hidden"], e["model"], e["lr"], e["steps"]) != (hidden, model, lr, spec["long_steps"]):
                continue
            run = dict(record["run"], model=kind)
            step_time = calibrated(calibration, hidden, model)
            if step_time is not None:
                run["measured_train_seconds_at_step"] = run["train_seconds_at_step"]
                run["train_seconds_at_step"] = [(s, s * step_time) for s, _ in run["train_seconds_at_step"]]
            runs.append(run)
            configs[kind] = record["config"]
            base = base or record
            if kind == "dcformer":
                parameters = record["parameters"]
    if {r["model"] for r in runs} != {"transformer", "dcformer"}:
        return None
    args = compare.parse_args(base["argv"])
    setup = compare.comparison_setup(args, base["setup"], base["argv"])
    setup.update(models=["transformer", "dcformer"], seeds=sorted({r["seed"] for r in runs}), lr=chosen["transformer"],
                 dc_lr=chosen["dcformer"], dc_overrides={"use_qk_norm": dc_model == "dcformer-qk"},
                 seconds_axis="calibrated" if calibration else "measured")
    wall = sum(r["train_seconds"] for r in runs)  # the training runs' own wall time (measured, beside other jobs)
    return {"setup": setup, "parameters": parameters, "configs": configs, "runs": runs, "chosen_lr": chosen,
            "wall_seconds": wall}


def fmt_spread(values: list[float]) -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.3f} (1 seed)"
    return (f"{statistics.fmean(values):.3f} ± {statistics.stdev(values):.3f} [{min(values):.3f}, {max(values):.3f}] "
            f"({len(values)} seeds)")


def write_study_report(out: Path, spec: dict) -> str:
    from .flops import training_flops
    from .report import write_reports

    results = load_results(out)
    calibration = json.loads((out / "calibration.json").read_text()) if (out / "calibration.json").is_file() else None
    short, long = spec["short_steps"], spec["long_steps"]
    lines = ["# The longer study: DCFormer vs Transformer at 4x the tokens", "",
             f"{len(results)} finished runs in runs/ (the first study's short runs imported where identical). "
             "Queue and status: plan.md. Validation loss at the end of training (nats per token).", ""]
    lines += ["## Learning-rate sweeps (seed 0)", "",
              "| hidden | model | steps | " + " | ".join(f"lr {lr:g}" for lr in spec["grid"]) + " |",
              "|---|---|---|" + "---|" * len(spec["grid"])]
    for hidden, _, _ in spec["sizes"]:
        for model in spec["models"]:
            for steps in (short, long):
                row = {}
                for r in results.values():
                    e = r["entry"]
                    if (e["hidden"], e["model"], e["seed"], e["steps"]) == (hidden, model, spec["seeds"][0], steps):
                        row[e["lr"]] = final_loss(r)
                if not row:
                    continue
                best = min(row, key=row.get)
                cells = [("**{:.3f}**" if lr == best else "{:.3f}").format(row[lr]) if lr in row else "" for lr in
                         spec["grid"]]
                lines.append(f"| {hidden} | {LABEL[model]} | {steps} | " + " | ".join(cells) + " |")
    lines += ["", f"## The long budget ({long} steps x {BATCH} x {BLOCK} = {long * BATCH * BLOCK:,} tokens)", "",
              "Each model at its chosen long rate (best seed-0 long run so far); mean ± std [min, max] over the "
              "seeds finished. FLOPs: `experiments.flops` (training = 3 x forward). Calibrated seconds: steps x the "
              "step time of calibration.json (one thread; see there for the load it was measured under). Measured: "
              "wall and CPU seconds of the training steps while the study ran beside other jobs.", "",
              "| hidden | model | lr | val loss | Δ vs Transformer | training FLOPs | calibrated s | "
              "measured wall s | "
              "measured CPU s |", "|---|---|---|---|---|---|---|---|---|"]
    for hidden, _, _ in spec["sizes"]:
        ref = None
        for model in spec["models"]:
            lr = chosen_long_rate(spec, results, hidden, model)
            if lr is None:
                continue
            mine = [r for r in results.values() if (r["entry"]["hidden"], r["entry"]["model"], r["entry"]["lr"],
                                                    r["entry"]["steps"]) == (hidden, model, lr, long)]
            losses = [final_loss(r) for r in mine]
            mean = statistics.fmean(losses)
            ref = mean if model == "transformer" else ref
            delta = f"{mean - ref:+.3f}" if ref is not None and model != "transformer" else ""
            kind = "transformer" if model == "transformer" else "dcformer"
            flop = training_flops(mine[0]["config"], long * BATCH * BLOCK, BLOCK, kind)
            step_time = calibrated(calibration, hidden, model)
            cal = f"{long * step_time:,.0f}" if step_time else "–"
            wall = statistics.fmean(r["run"]["train_seconds_at_step"][-1][1] for r in mine)
            cpu = [r["run"].get("train_cpu_seconds_at_step") for r in mine]
            cpu = f"{statistics.fmean(c[-1][1] for c in cpu):,.0f}" if all(cpu) else "–"
            lines.append(f"| {hidden} | {LABEL[model]} | {lr:g} | {fmt_spread(losses)} | {delta} | {flop:.3g} | "
                         f"{cal} | {wall:,.0f} | {cpu} |")
    lines += ["", "Per size and DCFormer variant, the curves on the three axes and where one model reaches the "
              "other's final loss: the folders below (results.md, curves_axes.png).", ""]
    for hidden, _, _ in spec["sizes"]:
        for dc_model in ("dcformer", "dcformer-qk"):
            report = comparison_report(spec, results, hidden, dc_model, calibration)
            if report is None:
                continue
            folder = out / f"h{hidden}-long-{dc_model}"
            folder.mkdir(exist_ok=True)
            write_reports(folder, report)
            write_atomic(folder / "results.json", json.dumps(report, indent=1))
            lines.append(f"- `{folder.name}/`: Transformer vs {LABEL[dc_model]} at hidden {hidden}")
            axes = report["aggregate"].get("axis_comparisons", {}).get("lm", {})
            for axis, c in axes.items():
                if c:
                    lines.append(f"  - {axis}: at the common budget {c['common_budget']:.3g}, Transformer "
                                 f"{c['transformer_loss_at_budget']:.3f} / {LABEL[dc_model]} "
                                 f"{c['dcformer_loss_at_budget']:.3f}")
    text = "\n".join(lines) + "\n"
    write_atomic(out / "study.md", text)
    return text


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=("calibrate", "run", "report"))
    p.add_argument("--out", required=True, help="the study folder")
    p.add_argument("--sizes", default="128,256,512", help="calibrate: the hidden sizes")
    p.add_argument("--calibration-steps", type=int, default=8)
    p.add_argument("--max-runs", type=int, help="run: stop after this many runs")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.command == "calibrate":
        sizes = [int(s) for s in args.sizes.split(",")]
        result = calibrate(out, sizes, steps=args.calibration_steps)
        result["load_average_after"] = list(os.getloadavg())
        result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        path = out / "calibration.json"
        earlier = json.loads(path.read_text()) if path.is_file() else None
        write_atomic(path, json.dumps(merge_calibration(earlier, result), indent=1))
    elif args.command == "run":
        trained = run_study(out, default_spec(), max_runs=args.max_runs)
        print(f"study: trained {trained} runs; the queue is {'empty' if args.max_runs is None else 'paused'}")
        print(write_study_report(out, default_spec()))
    else:
        print(write_study_report(out, default_spec()))


if __name__ == "__main__":
    main(sys.argv[1:])
