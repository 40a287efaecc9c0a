"""Statistics, tables and plots of the small comparison (`examples/compare_small.py`): `results.md`,
`curves.png`, `dyn_norms.png` of one comparison and `scaling.md` / `scaling.png` over several sizes, all rebuilt
from `results.json` alone (`report_only`).
"""

from __future__ import annotations

import io
import json
import math
import statistics
from pathlib import Path

from modeling_dcformer.checkpoints.atomic_dir import write_file as write_atomic  # the package's one atomic file write
from .ablation import DC_MODELS, LABELS, MODELS, SLOT_NAMES
from .flops import flops_per_step

SYNTHETIC_METRICS = ("loss", "accuracy", "seq_accuracy", "accuracy_easy", "accuracy_hard")
LM_METRICS = ("loss", "perplexity", "bits_per_byte")
AXES = ("tokens", "flops", "seconds")
AXIS_LABELS = {"tokens": "training tokens", "flops": "training FLOPs", "seconds": "training seconds"}


def save_figure(fig, path: Path) -> None:
    """`fig.savefig` in memory, then written beside `path` and swapped in (`atomic_dir.write_file`)."""
    image = io.BytesIO()
    fig.savefig(image, dpi=110, format=path.suffix.lstrip("."))
    write_atomic(path, image.getvalue())


def step_axes(report: dict, run: dict) -> dict:
    """How far run `run` got on each axis by step s: {"tokens": per step, "flops": per step (None without the
    model's config), "seconds": [(step, training seconds)] or None, "seconds_source": "measured" (recorded at each
    evaluation), "estimated" (step x the median step time, results of older versions) or None}."""
    setup = report["setup"]
    if setup.get("task") == "lm":
        tokens = setup["batch_size"] * setup["block_size"]
    else:
        tokens = setup["train_tokens"] / setup["steps"]
    seconds, source = run.get("train_seconds_at_step"), "measured"
    if not seconds:
        median = run.get("step_seconds_median")
        steps = sorted({s for points in run["curves"].values() for s, _ in points})
        seconds, source = ([(s, s * median) for s in steps], "estimated") if median else (None, None)
    return {
        "tokens": tokens,
        "flops": flops_per_step(report, run["model"]),
        "seconds": [tuple(p) for p in seconds] if seconds else None,
        "seconds_source": source,
    }


def axis_curve(curve: list, axes: dict, axis: str) -> list[tuple[float, float]] | None:
    """A (step, value) curve re-indexed by `axis` (None when the run lacks it)."""
    if axis == "seconds":
        if axes["seconds"] is None:
            return None
        at = dict(axes["seconds"])
        if any(s not in at for s, _ in curve):
            return None
        return [(at[s], v) for s, v in curve]
    per_step = axes[axis]
    return None if per_step is None else [(s * per_step, v) for s, v in curve]


def mean_axis_curve(report: dict, runs: list[dict], name: str, axis: str) -> list[tuple[float, float, float, float]]:
    """(mean axis value, mean, min, max) over the runs' curves of metric `name`, at the steps every run has."""
    curves = []
    for run in runs:
        curve = axis_curve(run["curves"].get(name, []), step_axes(report, run), axis)
        if curve is None:
            return []
        curves.append(dict(zip((s for s, _ in run["curves"][name]), curve)))
    steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    points = []
    for step in steps:
        xs, ys = [c[step][0] for c in curves], [c[step][1] for c in curves]
        points.append((statistics.fmean(xs), statistics.fmean(ys), min(ys), max(ys)))
    return points


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


def value_at(curve: list[tuple[float, float]], x: float) -> float | None:
    """The curve's value at axis position `x`, linear between its points (None outside them)."""
    for (x0, v0), (x1, v1) in zip(curve, curve[1:]):
        if x0 <= x <= x1:
            return v0 if x1 == x0 else v0 + (v1 - v0) * (x - x0) / (x1 - x0)
    return curve[-1][1] if curve and curve[-1][0] == x else None


def axis_comparisons(report: dict, runs: list[dict], tasks: list[str]) -> dict:
    """Per task and axis (tokens, FLOPs, seconds), the Transformer's and the DCFormer's mean validation-loss curves
    compared: the losses at the largest budget both reached, and where each reaches the other's final loss."""
    out = {}
    for task in tasks:
        out[task] = {}
        for axis in AXES:
            tf = mean_axis_curve(report, [r for r in runs if r["model"] == "transformer"], f"{task}_loss", axis)
            dc = mean_axis_curve(report, [r for r in runs if r["model"] == "dcformer"], f"{task}_loss", axis)
            if not tf or not dc:
                out[task][axis] = None
                continue
            tf_curve, dc_curve = [(x, m) for x, m, _, _ in tf], [(x, m) for x, m, _, _ in dc]
            budget = min(tf_curve[-1][0], dc_curve[-1][0])
            out[task][axis] = {
                "common_budget": budget,
                "transformer_loss_at_budget": value_at(tf_curve, budget),
                "dcformer_loss_at_budget": value_at(dc_curve, budget),
                "transformer_final": tf_curve[-1][0],
                "dcformer_final": dc_curve[-1][0],
                "dcformer_reaches_transformer_final_loss": reach_step(dc_curve, tf_curve[-1][1]),
                "transformer_reaches_dcformer_final_loss": reach_step(tf_curve, dc_curve[-1][1]),
            }
    return out


def run_axes_totals(report: dict, run: dict) -> dict:
    """The run's training tokens, FLOPs and seconds (training steps only) at its last step."""
    axes = step_axes(report, run)
    steps = report["setup"]["steps"]
    seconds = axes["seconds"][-1][1] if axes["seconds"] else None
    return {
        "tokens": axes["tokens"] * steps,
        "flops": axes["flops"] * steps if axes["flops"] is not None else None,
        "seconds": seconds,
        "seconds_source": axes["seconds_source"],
    }


def aggregate(runs: list[dict], tasks: list[str], report: dict | None = None) -> dict:
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
        if report is not None:
            totals = [run_axes_totals(report, r) for r in mine]
            summary[kind]["axes"] = {
                "tokens": totals[0]["tokens"],
                "flops": totals[0]["flops"],
                "seconds": spread([t["seconds"] for t in totals]) if all(t["seconds"] for t in totals) else None,
                "seconds_source": totals[0]["seconds_source"] if all(t["seconds"] for t in totals) else None,
            }
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
    result = {"models": summary, "comparisons": comparisons}
    if report is not None and comparisons:
        result["axis_comparisons"] = axis_comparisons(report, runs, tasks)
    return result


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


def model_labels(setup: dict) -> dict:
    """LABELS for one comparison: "dcformer" names qk-norm when the comparison's DCFormer has it (the study's
    `dcformer-qk` runs are drawn as "dcformer" beside the Transformer)."""
    labels = dict(LABELS)
    if (setup.get("dc_overrides") or {}).get("use_qk_norm"):
        labels["dcformer"] += " + qk-norm"
    return labels


def write_markdown(path: Path, report: dict) -> str:
    setup, agg = report["setup"], report["aggregate"]
    labels = model_labels(setup)
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
                f"| {labels[kind]} | {m['parameters']:,} | {m['lr']:g} | {fmt(m['lm']['loss'])} | "
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
                    f"| {task} | {labels[kind]} | {fmt(m['loss'])} | {fmt(m['accuracy'], pct=True)} | "
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
            f"| {labels[run['model']]} | {run['seed']} | " + " | ".join(cells) + f" | {run['train_seconds']:.0f} s |"
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
            f"- {labels[kind]}: {t['mean']:.0f} s a run ({t['mean'] / setup['steps'] * 1000:.0f} ms a step, "
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
    lines += axes_lines(report) + sweep_lines(report) + norms_lines(agg, labels)
    text = "\n".join(lines) + "\n"
    write_atomic(path, text)
    return text


def fmt_axis(axis: str, value: float | None) -> str:
    if value is None:
        return "n/a"
    if axis == "tokens":
        return f"{value:,.0f}"
    if axis == "flops":
        return f"{value:.3g}"
    return f"{value:,.0f} s"


def axes_lines(report: dict) -> list[str]:
    """The three axes: each model's budget in tokens, FLOPs and seconds, and the mean curves compared on each."""
    agg = report["aggregate"]
    labels = model_labels(report["setup"])
    kinds = [k for k in MODELS if "axes" in agg["models"].get(k, {})]
    if not kinds:
        return []
    sources = {agg["models"][k]["axes"]["seconds_source"] for k in kinds}
    note = {
        "measured": "measured: the training steps only, evaluations excluded",
        "estimated": "estimated as steps x the median step time: this JSON predates the per-evaluation record",
    }
    seconds_note = "; ".join(note[s] for s in sources if s in note) or "n/a: not recorded"
    lines = [
        "",
        "Three axes (docs/evidence.md, \"Three axes\"): training tokens; training FLOPs counted from the shapes "
        "(`dcformer_research.flops`: 3 x forward, causal attention pairs, DCMHA's projections and "
        f"Compose included); training seconds on this machine ({seconds_note}). Mean over seeds.",
        "",
        "| model | training tokens | training FLOPs | FLOPs / token | training seconds | final val loss |",
        "|---|---|---|---|---|---|",
    ]
    tasks = report["setup"]["tasks"]
    for kind in kinds:
        axes = agg["models"][kind]["axes"]
        loss = statistics.fmean(agg["models"][kind][t]["loss"]["mean"] for t in tasks)
        per_token = axes["flops"] / axes["tokens"] if axes["flops"] is not None else None
        seconds = fmt_axis("seconds", axes["seconds"]["mean"]) if axes["seconds"] else "n/a"
        lines.append(
            f"| {labels[kind]} | {fmt_axis('tokens', axes['tokens'])} | {fmt_axis('flops', axes['flops'])} | "
            f"{fmt_axis('flops', per_token)} | {seconds} | {loss:.3f} |"
        )
    for task, by_axis in agg.get("axis_comparisons", {}).items():
        for axis in AXES:
            c = by_axis.get(axis)
            if c is None:
                lines.append(f"- {task}, {AXIS_LABELS[axis]}: n/a (not recorded for every run).")
                continue
            tf_loss, dc_loss = c["transformer_loss_at_budget"], c["dcformer_loss_at_budget"]
            line = (
                f"- {task}, {AXIS_LABELS[axis]}: at the largest budget both reached "
                f"({fmt_axis(axis, c['common_budget'])}) the mean validation loss is {tf_loss:.3f} (Transformer) vs "
                f"{dc_loss:.3f} (DCFormer), linear between evaluations"
            )
            dc_reach = c["dcformer_reaches_transformer_final_loss"]
            tf_reach = c["transformer_reaches_dcformer_final_loss"]
            if dc_reach is not None and dc_reach > 0:
                tf_final = fmt_axis(axis, c["transformer_final"])
                line += (
                    f"; the DCFormer reaches the Transformer's final loss at {fmt_axis(axis, dc_reach)} "
                    f"({dc_reach / c['transformer_final']:.2f}x the Transformer's {tf_final})"
                )
            elif tf_reach is not None and tf_reach > 0:
                dc_final = fmt_axis(axis, c["dcformer_final"])
                line += (
                    f"; the Transformer reaches the DCFormer's final loss at {fmt_axis(axis, tf_reach)} "
                    f"({tf_reach / c['dcformer_final']:.2f}x the DCFormer's {dc_final})"
                )
            else:
                line += "; neither reaches the other's final loss"
            lines.append(line + ".")
    return lines


def sweep_lines(report: dict) -> list[str]:
    sweep = report.get("lr_sweep")
    if not sweep:
        return []
    labels = model_labels(report["setup"])
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
            lines.append(f"| {labels[kind]} | " + " | ".join(cells) + f" | {sweep['best'][kind]:g} |")
    return lines


def norms_lines(agg: dict, labels: dict = LABELS) -> list[str]:
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
        lines.append(f"| {labels[kind]} | " + " | ".join(cells) + " |")
    return lines


def plot_curves(path: Path, runs: list[dict], tasks: list[str], labels: dict = LABELS) -> None:
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
                ax.plot(steps, [c[1] for c in curve], color=colors[kind], label=f"{labels[kind]}, mean of {len(mine)}")
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
    save_figure(fig, path)
    plt.close(fig)


COLORS = dict(zip(MODELS, ("tab:blue", "tab:red", "tab:gray", "tab:green", "tab:purple", "tab:orange")))


def draw_axes_row(axes_row, report: dict, runs: list[dict], task: str, title: str = "") -> None:
    """Validation loss against tokens, FLOPs and seconds (one matplotlib axis each), mean and min-max band."""
    labels = model_labels(report.get("setup", {}))
    for ax, axis in zip(axes_row, AXES):
        drawn = False
        for kind in MODELS:
            mine = [r for r in runs if r["model"] == kind]
            curve = mean_axis_curve(report, mine, f"{task}_loss", axis) if mine else []
            if not curve:
                continue
            xs = [c[0] for c in curve]
            ax.plot(xs, [c[1] for c in curve], color=COLORS[kind], label=f"{labels[kind]}, mean of {len(mine)}")
            ax.fill_between(xs, [c[2] for c in curve], [c[3] for c in curve], color=COLORS[kind], alpha=0.2)
            drawn = True
        label = AXIS_LABELS[axis]
        if axis == "seconds" and runs:
            source = step_axes(report, runs[0])["seconds_source"]
            label += " (estimated: steps x median step time)" if source == "estimated" else ""
        ax.set_xlabel(label, fontsize=8)
        ax.set_ylabel("validation loss")
        ax.set_title(f"{title}{task}: loss vs {AXIS_LABELS[axis]}", fontsize=9)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "n/a (not recorded)", ha="center", va="center", transform=ax.transAxes)


def plot_axes(path: Path, report: dict, runs: list[dict], tasks: list[str]) -> None:
    """curves_axes.png: each task's validation loss against the three axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(tasks), 3, figsize=(16, 4.2 * len(tasks)), squeeze=False)
    for row, task in enumerate(tasks):
        draw_axes_row(axes[row], report, runs, task)
    fig.suptitle("DCFormer vs Transformer on three axes (band: min-max over seeds)")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def plot_norms(path: Path, runs: list[dict], labels: dict = LABELS) -> bool:
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
        ax.set_title(labels[kind], fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("RMS on the probe batch")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)
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
                "axes": m.get("axes"),
            }
        rows.append(row)
    return rows


def write_scaling(out: Path, reports: list[dict]) -> str:
    rows = scaling_rows(reports)
    write_atomic(out / "scaling.json", json.dumps({"folders": [r["folder"] for r in rows], "rows": rows}, indent=1))
    lines = [
        "# DCFormer vs Transformer at several sizes",
        "",
        "Final validation loss, mean ± std [min, max] over seeds; Δ = DCFormer − Transformer (negative: DCFormer "
        "ahead). Each size's own tables are in its folder.",
        "",
        "| hidden / heads / layers | model | parameters | lr | val loss | perplexity | tokens/s | training FLOPs | "
        "training seconds | Δ loss |",
        "|---|---|---|---|---|---|---|---|---|---|",
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
            axes = m.get("axes") or {}
            flops = fmt_axis("flops", axes.get("flops"))
            seconds = axes.get("seconds")
            seconds = "n/a" if not seconds else ("≈ " if axes["seconds_source"] == "estimated" else "") + fmt_axis(
                "seconds", seconds["mean"]
            )
            cells = [size, LABELS[kind], params, lr, fmt(m["loss"]), ppl, speed, flops, seconds, delta]
            lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Training seconds: the training steps only, mean over seeds; ≈: estimated as steps x the median step time "
        "(results written before the per-evaluation record). FLOPs: `dcformer_research.flops`. Loss "
        "against tokens, FLOPs and seconds per size: scaling_axes.png.",
    ]
    text = "\n".join(lines) + "\n"
    write_atomic(out / "scaling.md", text)

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
    save_figure(fig, out / "scaling.png")
    plt.close(fig)

    fig, axes = plt.subplots(len(reports), 3, figsize=(16, 4.2 * len(reports)), squeeze=False)
    for row, (report, info) in enumerate(zip(reports, rows)):
        s = info["shape"]
        title = f"hidden {s['hidden_size']}, {s['num_hidden_layers']} layers — "
        draw_axes_row(axes[row], report, main_runs(report), report["setup"]["tasks"][0], title)
    fig.suptitle("DCFormer vs Transformer per size on three axes (band: min-max over seeds)")
    fig.tight_layout()
    save_figure(fig, out / "scaling_axes.png")
    plt.close(fig)
    return text


# ----------------------------------------------------------------------------------------------------------------


def write_reports(out: Path, report: dict) -> str:
    tasks = report["setup"]["tasks"]
    runs = main_runs(report)
    report["aggregate"] = aggregate(runs, tasks, report)
    labels = model_labels(report["setup"])
    plot_curves(out / "curves.png", runs, tasks, labels)
    plot_axes(out / "curves_axes.png", report, runs, tasks)
    plot_norms(out / "dyn_norms.png", runs, labels)
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
    write_atomic(path, json.dumps(report, indent=1))
    return report


