#!/usr/bin/env python
"""lm-eval results files -> a markdown table (model x task: acc / acc_norm / perplexity with stderr) and a bar chart.

    python -m modeling_dcformer.evals.report results/dcpythia-6.9b results/pythia-6.9b --published evals/published.yaml -o report
    python -m modeling_dcformer.evals.report "DCPythia-6.9B=results/dcpythia-6.9b" "Pythia-6.9B=results/pythia-6.9b"

Each input is a results JSON file (what `harness.py run --output_path` or `evaluate(..., output_path=...)` writes)
or a directory searched recursively for `results*.json`; `LABEL=PATH` names the model (default: the results'
`model_name`, the last part of a local path). Several files of one model are merged, the newest winning per task.
Writes PREFIX.md and PREFIX.png (default `report`) and prints the table.

`--published FILE` (YAML or JSON) adds rows of numbers published elsewhere (see evals/published.yaml for the
schema). A published task is matched to our column of the same name, or to the column of its `*_local` copy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from modeling_dcformer.publishing.eval_results import finite_number

PREFERRED_TASKS = ("lambada_openai", "piqa", "hellaswag")
PREFERRED_METRICS = ("acc", "acc_norm", "perplexity")
# Metrics reported as fractions in [0, 1] (published percentages above 1 are divided by 100).
FRACTION_METRICS = ("acc", "acc_norm", "exact_match", "f1", "mcc")
LOWER_IS_BETTER = ("perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte")
SKIP_KEYS = ("alias", "name", "sample_len", "samples")


@dataclass
class Row:
    """One line of the table: a model's numbers, {task: {metric: (value, stderr or None)}}."""

    label: str
    values: dict[str, dict[str, tuple[float, float | None]]] = field(default_factory=dict)
    published: bool = False
    notes: list[str] = field(default_factory=list)


def canonical_task(task: str) -> str:
    """The upstream task a column stands for: our offline copies are named `<upstream>_local`."""
    return task[: -len("_local")] if task.endswith("_local") else task


def _is_fraction_metric(metric: str) -> bool:
    return metric.split(",")[0] in FRACTION_METRICS


# ----------------------------------------------------------------------------------------------------- inputs
def find_results_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("results*.json") if p.is_file())
        if files:
            return files
        raise FileNotFoundError(f"no results*.json under {path}")
    raise FileNotFoundError(f"{path} does not exist")


def default_label(results: dict, path: Path) -> str:
    config = results.get("config") or {}
    model_args = config.get("model_args")
    candidates = [results.get("model_name")]
    if isinstance(model_args, dict):
        candidates.append(model_args.get("pretrained"))
    elif isinstance(model_args, str):
        for part in model_args.split(","):
            if part.startswith("pretrained="):
                candidates.append(part[len("pretrained=") :])
    candidates.append(config.get("model"))
    for name in candidates:
        if isinstance(name, str) and name.strip():
            name = name.strip()
            local = name.startswith((".", "/", "~")) or os.path.exists(name)
            return Path(name).name if local else name
    return path.stem


def metrics_of(task_results: dict) -> dict[str, tuple[float, float | None]]:
    """lm-eval's {"acc,none": v, "acc_stderr,none": s, ...} -> {"acc": (v, s)}; a filter other than "none"
    stays in the name ("exact_match,strip")."""
    values, stderrs = {}, {}
    for key, value in task_results.items():
        if key in SKIP_KEYS or "," not in key:
            continue
        metric, filt = key.split(",", 1)
        target = stderrs if metric.endswith("_stderr") else values
        metric = metric[: -len("_stderr")] if metric.endswith("_stderr") else metric
        name = metric if filt == "none" else f"{metric},{filt}"
        number = finite_number(value)
        if number is not None:
            target[name] = number
    return {name: (value, stderrs.get(name)) for name, value in values.items()}


def load_results(inputs: Sequence[str]) -> list[Row]:
    """Rows of our results, one per model label, in the order first seen."""
    rows: dict[str, Row] = {}
    for spec in inputs:
        label, path = None, Path(spec)
        if "=" in spec and not path.exists():
            label, _, rest = spec.partition("=")
            path = Path(rest)
        files = find_results_files(path)
        dated = []
        for file in files:
            try:
                data = json.loads(file.read_text())
            except json.JSONDecodeError as err:
                raise ValueError(f"{file}: not JSON ({err})") from None
            if not isinstance(data, dict) or not isinstance(data.get("results"), dict):
                raise ValueError(f"{file}: not an lm-eval results file (no 'results' mapping)")
            dated.append((finite_number(data.get("date")) or file.stat().st_mtime, file, data))
        for _, file, data in sorted(dated, key=lambda item: item[0]):  # newest last: it wins per task
            name = label or default_label(data, file)
            row = rows.setdefault(name, Row(name))
            config = data.get("config") or {}
            if config.get("limit"):
                note = f"limit={config['limit']}"
                if note not in row.notes:
                    row.notes.append(note)
            for task, task_results in data["results"].items():
                metrics = metrics_of(task_results)
                if metrics:
                    row.values[task] = metrics
    return list(rows.values())


def load_published(path: str | os.PathLike) -> list[Row]:
    """Rows of published numbers. Schema (YAML or JSON):

        models:
          - name: Pythia-6.9B (published)
            source: where the numbers come from
            results:
              lambada_openai: {acc: 0.67, perplexity: 4.5}     # a number, null (unknown), or
              piqa: {acc: {value: 0.76, stderr: 0.01}}          # a value with its stderr
    """
    path = Path(path)
    text = path.read_text()
    if path.suffix == ".json":
        data = json.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text)
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, list):
        raise ValueError(f"{path}: expected a mapping with a list under 'models'")
    rows = []
    for entry in models:
        if not isinstance(entry, dict) or not entry.get("name"):
            raise ValueError(f"{path}: every model needs a 'name'")
        row = Row(str(entry["name"]), published=True)
        if entry.get("source"):
            row.notes.append(str(entry["source"]))
        for task, metrics in (entry.get("results") or {}).items():
            for metric, raw in (metrics or {}).items():
                value, stderr = (raw.get("value"), raw.get("stderr")) if isinstance(raw, dict) else (raw, None)
                value, stderr = finite_number(value), finite_number(stderr)
                if value is None:
                    continue
                if _is_fraction_metric(metric) and value > 1:  # a percentage
                    value, stderr = value / 100, (stderr / 100 if stderr is not None else None)
                row.values.setdefault(str(task), {})[str(metric)] = (value, stderr)
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------------- table
def _task_order(task: str) -> tuple:
    canon = canonical_task(task)
    rank = PREFERRED_TASKS.index(canon) if canon in PREFERRED_TASKS else len(PREFERRED_TASKS)
    return rank, canon, task


def _metric_order(metric: str) -> tuple:
    base = metric.split(",")[0]
    rank = PREFERRED_METRICS.index(base) if base in PREFERRED_METRICS else len(PREFERRED_METRICS)
    return rank, metric


def columns_of(rows: Sequence[Row], tasks: Sequence[str] | None = None, metrics: Sequence[str] | None = None):
    """(task, metric) columns: every pair present in our (non-published) rows, filtered and ordered."""
    pairs = {(task, metric) for row in rows if not row.published for task, ms in row.values.items() for metric in ms}
    if tasks:
        wanted = set(tasks)
        pairs = {(t, m) for t, m in pairs if t in wanted or canonical_task(t) in wanted}
    if metrics:
        wanted = set(metrics)
        pairs = {(t, m) for t, m in pairs if m in wanted or m.split(",")[0] in wanted}
    return sorted(pairs, key=lambda tm: (_task_order(tm[0]), _metric_order(tm[1])))


def cell_value(row: Row, task: str, metric: str) -> tuple[float, float | None] | None:
    metrics = row.values.get(task)
    if metrics is None and row.published:
        metrics = row.values.get(canonical_task(task))
    if not metrics:
        return None
    if row.published:  # published files name plain metrics ("acc"), ours may carry a filter ("acc,strip")
        return metrics.get(metric) or metrics.get(metric.split(",")[0])
    return metrics.get(metric)


def formatfinite_number(value: float, metric: str) -> str:
    if _is_fraction_metric(metric):
        return f"{value:.4f}"
    if abs(value) >= 1e5:
        return f"{value:.4g}"
    return f"{value:.3f}"


def format_cell(cell: tuple[float, float | None] | None, metric: str) -> str:
    if cell is None:
        return "–"
    value, stderr = cell
    text = formatfinite_number(value, metric)
    return f"{text} ± {formatfinite_number(stderr, metric)}" if stderr is not None else text


def arrow(metric: str) -> str:
    return "↓" if metric.split(",")[0] in LOWER_IS_BETTER else "↑"


def markdown_table(rows: Sequence[Row], columns) -> str:
    header = ["model", *[f"{task} {metric} {arrow(metric)}" for task, metric in columns]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" + "---:|" * len(columns)]
    footnotes = []
    for row in rows:
        label = row.label
        if row.notes:
            footnotes.append(f"{label}: {'; '.join(row.notes)}")
            label = f"{label} [{len(footnotes)}]"
        if row.published:
            label = f"*{label}*"
        cells = [format_cell(cell_value(row, task, metric), metric) for task, metric in columns]
        lines.append("| " + " | ".join([label, *cells]) + " |")
    text = "\n".join(lines) + "\n"
    if any(row.published for row in rows):
        text += "\n*Italics*: published numbers, not measured here.\n"
    if footnotes:
        text += "\n" + "\n".join(f"[{i}] {note}  " for i, note in enumerate(footnotes, 1)) + "\n"
    return text


# ----------------------------------------------------------------------------------------------------- chart
def bar_chart(rows: Sequence[Row], columns, path: str | os.PathLike, title: str | None = None) -> Path:
    """Grouped bars, one group per (task, metric) and one bar per model, stderr as error bars; fraction metrics
    and perplexity-like metrics on separate panels (perplexity on a log scale when it spans a wide range)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("accuracy", [c for c in columns if _is_fraction_metric(c[1])]),
        ("lower is better", [c for c in columns if c[1].split(",")[0] in LOWER_IS_BETTER]),
    ]
    panels.append(("other", [c for c in columns if c not in panels[0][1] and c not in panels[1][1]]))
    panels = [(name, cols) for name, cols in panels if cols]
    if not panels:
        raise ValueError("nothing to plot: no metric columns")
    widths = [max(2.0, 1.2 * len(cols) * max(1, len(rows)) ** 0.5) for _, cols in panels]
    fig, axes = plt.subplots(
        1, len(panels), figsize=(min(24.0, sum(widths) + 2), 4.8), squeeze=False,
        gridspec_kw={"width_ratios": [len(cols) for _, cols in panels]},
    )
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    bar_width = 0.8 / max(1, len(rows))
    for ax, (name, cols) in zip(axes[0], panels):
        positive = []
        for i, row in enumerate(rows):
            xs, heights, errs = [], [], []
            for j, (task, metric) in enumerate(cols):
                cell = cell_value(row, task, metric)
                if cell is None:
                    continue
                xs.append(j - 0.4 + bar_width * (i + 0.5))
                heights.append(cell[0])
                errs.append(cell[1] if cell[1] is not None else float("nan"))  # no bar
                positive.append(cell[0])
            if not xs:
                continue
            ax.bar(
                xs, heights, bar_width, yerr=errs, capsize=3, label=row.label,
                color=colors[i % len(colors)], hatch="//" if row.published else None,
                edgecolor="black" if row.published else None, linewidth=0.5,
            )
        ax.set_xticks(range(len(cols)))
        ax.set_xticklabels([f"{task}\n{metric}" for task, metric in cols], fontsize=8)
        ax.set_title(name)
        if name == "lower is better" and positive and min(positive) > 0 and max(positive) / min(positive) > 50:
            ax.set_yscale("log")
        if name == "accuracy":
            ax.set_ylim(0, 1)
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes[0][1:]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    fig.legend(handles, labels, loc="upper center", ncol=min(4, max(1, len(labels))), fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, y=0.02, fontsize=9)
    fig.tight_layout(rect=(0, 0.03, 1, 0.9))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------------- main
def build_report(
    inputs: Sequence[str],
    published: str | os.PathLike | None = None,
    output: str | os.PathLike | None = "report",
    tasks: Sequence[str] | None = None,
    metrics: Sequence[str] | None = None,
) -> tuple[str, Path | None]:
    """Markdown text (also written to OUTPUT.md) and the chart path (OUTPUT.png); `output=None` writes nothing."""
    rows = load_results(inputs)
    if not rows:
        raise ValueError("no results")
    published_rows = load_published(published) if published else []
    columns = columns_of(rows, tasks, metrics)
    if not columns:
        raise ValueError("no metric columns left (check --tasks / --metrics)")
    shown_published = [r for r in published_rows if any(cell_value(r, t, m) for t, m in columns)]
    skipped = [r.label for r in published_rows if r not in shown_published]
    all_rows = [*rows, *shown_published]
    text = markdown_table(all_rows, columns)
    if skipped:
        text += "\nPublished entries with no value for these columns (fill them in): " + ", ".join(skipped) + "\n"
    chart = None
    if output is not None:
        output = Path(output)
        output.parent.mkdir(parents=True, exist_ok=True)
        Path(f"{output}.md").write_text(text)
        chart = bar_chart(all_rows, columns, f"{output}.png")
    return text, chart


def _split_list(values: Sequence[str] | None) -> list[str] | None:
    if not values:
        return None
    return [part for value in values for part in value.split(",") if part]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="results JSON files or directories, optionally LABEL=PATH")
    parser.add_argument("--published", help="YAML/JSON file of published numbers (see evals/published.yaml)")
    parser.add_argument("-o", "--output", default="report", help="write OUTPUT.md and OUTPUT.png (default: report)")
    parser.add_argument("--tasks", nargs="+", help="only these tasks (names or their upstream names)")
    parser.add_argument("--metrics", nargs="+", help="only these metrics (e.g. acc acc_norm perplexity)")
    args = parser.parse_args(argv)
    try:
        text, chart = build_report(
            args.results, args.published, args.output, _split_list(args.tasks), _split_list(args.metrics)
        )
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(text)
    print(f"wrote {args.output}.md and {chart}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
