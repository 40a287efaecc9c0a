"""lm-eval results, read for a model card: which numbers measure a benchmark and which are smoke runs.

`read_eval_results` turns what lm-eval 0.4 (or `dcformer-eval`) writes or returns into one record per task and
metric, with the dataset, split, number of shots and rows it ran on, and `smoke`: why a record is no benchmark
result (a `limit`, an offline `*_local` task, local data files, no record of the dataset), None when lm-eval scored
every row of a Hub dataset's split. The model card (`model_card.py`) puts only the latter in its `model-index`.
Standard library only.
"""

import json
import math
import os
from pathlib import Path

EVAL_SKIP_KEYS = ("alias", "name", "sample_len", "samples")
EVAL_SOURCE_URL = "https://github.com/EleutherAI/lm-evaluation-harness"
# lm-eval `dataset_path` values that read local files, not a Hub dataset
LOCAL_DATASET_PATHS = ("json", "csv", "parquet", "text", "arrow")


def finite_number(value) -> float | None:
    """`value` as a finite float; None for anything else (a bool, None, text, NaN, an infinity)."""
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _load_eval_results(eval_results) -> dict:
    if isinstance(eval_results, (str, os.PathLike)):
        path = Path(eval_results)
        if path.is_dir():
            found = sorted(path.rglob("results*.json"), key=lambda f: f.stat().st_mtime)
            if not found:
                raise FileNotFoundError(f"no results*.json under {path}")
            path = found[-1]
        eval_results = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(eval_results, dict):
        raise ValueError(f"eval_results must be lm-eval results (a dict or a JSON file), got {type(eval_results)}")
    return eval_results


def _why_not_a_benchmark(task: str, task_config: dict | None, limit, samples: dict) -> str | None:
    """None when lm-eval scored the whole of a Hub dataset's split for `task`; else why the numbers do not measure
    the benchmark."""
    if limit:
        return f"lm-eval ran with limit={limit}: a subset of the rows"
    effective, original = samples.get("effective"), samples.get("original")
    if isinstance(effective, int) and isinstance(original, int) and effective < original:
        return f"{effective} of the task's {original} rows"
    if task.endswith("_local"):
        return "an offline copy of the task, on local rows (by default the small fixtures bundled with the package)"
    if task_config is None or not task_config.get("dataset_path") or not _eval_split(task_config):
        return "lm-eval recorded no dataset and split for it"
    if task_config["dataset_path"] in LOCAL_DATASET_PATHS or task_config.get("custom_dataset"):
        return "run on local data files, not a Hub dataset"
    return None


def _eval_split(task_config: dict) -> str | None:
    return task_config.get("test_split") or task_config.get("validation_split")  # the one lm-eval scores


def read_eval_results(eval_results) -> dict:
    """lm-eval results -> {"source": "lm-evaluation-harness VERSION", "results": [record, ...]}, one record per
    task and metric: task, metric, value, stderr, num_fewshot, dataset, dataset_config, split, samples, and
    `smoke`: None where lm-eval scored the whole of a Hub dataset's split, else why the numbers are no benchmark
    result (a `limit`, an offline `*_local` task, local data files, no record of the dataset). Only records with
    `smoke` None go into a card's `model-index`.

    `eval_results`: what `dcformer-eval` / lm-eval write or return (a dict with a "results" mapping, or that
    mapping itself: {task: {"acc,none": v, "acc_stderr,none": s, ...}}), the path of such a JSON file or of a
    directory (its newest `results*.json`, as `--output_path` leaves them), or this function's own output. A
    filter other than "none" stays in the metric's name ("exact_match,strip").
    """
    data = _load_eval_results(eval_results)
    if isinstance(data.get("results"), list):  # already read: a saved config's lm_eval_results
        return {"source": str(data.get("source") or "lm-evaluation-harness"), "results": list(data["results"])}
    section = lambda name: data[name] if isinstance(data.get(name), dict) else {}  # noqa: E731
    limit = section("config").get("limit")
    version = data.get("lm_eval_version")
    source = "lm-evaluation-harness" + (f" {version}" if isinstance(version, str) and version[:1].isdigit() else "")
    tasks = data["results"] if isinstance(data.get("results"), dict) else data
    records = []
    for task, metrics in tasks.items():
        if not isinstance(metrics, dict):
            raise ValueError(f"eval_results: task {task!r} has no metrics mapping (lm-eval's results[task][metric])")
        task_config = section("configs").get(task)
        task_config = task_config if isinstance(task_config, dict) else None
        samples = section("n-samples").get(task)
        samples = samples if isinstance(samples, dict) else {}
        common = dict(
            num_fewshot=section("n-shot").get(task),
            dataset=(task_config or {}).get("dataset_path"),
            dataset_config=(task_config or {}).get("dataset_name"),
            split=_eval_split(task_config or {}),
            samples=samples.get("effective"),
            smoke=_why_not_a_benchmark(task, task_config, limit, samples),
        )
        for key, value in metrics.items():
            if key in EVAL_SKIP_KEYS or "," not in key:
                continue
            metric, filt = key.split(",", 1)
            number = finite_number(value)
            if metric.endswith("_stderr") or number is None:
                continue
            name = metric if filt == "none" else f"{metric},{filt}"
            stderr = finite_number(metrics.get(f"{metric}_stderr,{filt}"))
            records.append(dict(task=task, metric=name, value=number, stderr=stderr, **common))
    if not records:
        raise ValueError("eval_results holds no metric (expected lm-eval's results[task]['acc,none'] and the like)")
    return {"source": source, "results": records}


__all__ = ["EVAL_SOURCE_URL", "read_eval_results"]
