"""Offline data for the `*_local` tasks: JSON-lines files in the upstream data sets' schema, read from a directory.

Each task YAML in this folder names this loader as its `custom_dataset`; lm-eval calls it with the task's
metadata (where `data_dir` arrives from `--metadata data_dir=...` or `evaluate(..., data_dir=...)`) and the
task's `dataset_kwargs` (which file, which split). The directory is, in order:

1. the `data_dir` argument;
2. the environment variable ``DCFORMER_EVAL_DATA``;
3. ``evals/fixtures`` (a few dozen hand-written rows per task, for tests and smoke runs only; no answer-length
   cue: a model that has learned nothing scores near chance, tests/test_fixtures.py).

Files, one JSON object a line, in the schema of the upstream data set the task copies:

- ``lambada_openai.jsonl``: the test split of ``EleutherAI/lambada_openai`` (config ``default``): ``{"text"}``.
- ``piqa.jsonl``: the validation split of ``baber/piqa``: ``{"goal", "sol1", "sol2", "label"}``.
- ``hellaswag.jsonl``: the validation split of ``Rowan/hellaswag``: ``{"ind", "activity_label", "ctx_a",
  "ctx_b", "ctx", "endings", "source_id", "split", "split_type", "label"}``.
- ``dcformer_gen.jsonl``: our own generation smoke task: ``{"question", "answer"}``.

A task whose upstream draws few-shot examples from a training split (PIQA, HellaSwag) reads them from
``<name>.train.jsonl`` when that file exists; without it the training split is empty, which is all a zero-shot
run needs (``dcformer-eval`` and ``evaluate`` refuse a ``--num_fewshot`` above the examples there are before the
model loads).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import datasets

ENV_VAR = "DCFORMER_EVAL_DATA"
FIXTURES_DIR = Path(__file__).resolve().parent.parent / "fixtures"

logger = logging.getLogger(__name__)


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """The directory the local tasks read: `data_dir`, else $DCFORMER_EVAL_DATA, else evals/fixtures."""
    chosen = data_dir or os.environ.get(ENV_VAR) or FIXTURES_DIR
    return Path(chosen).expanduser().resolve()


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not a JSON object ({err})") from None
    if not rows:
        raise ValueError(f"{path} holds no rows")
    return rows


def load_local(
    local_name: str,
    local_split: str,
    local_fewshot_split: str | None = None,
    data_dir: str | os.PathLike | None = None,
    **_metadata,
) -> datasets.DatasetDict:
    """`custom_dataset` of the local tasks: ``<dir>/<local_name>.jsonl`` as split `local_split`, and, when the
    task names one, ``<dir>/<local_name>.train.jsonl`` (or an empty split of the same columns) as
    `local_fewshot_split`. Other keyword arguments (the rest of the task metadata) are ignored."""
    directory = resolve_data_dir(data_dir)
    path = directory / f"{local_name}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: point --metadata data_dir=DIR (or evaluate(..., data_dir=DIR), or ${ENV_VAR}) "
            f"at a directory holding {local_name}.jsonl"
        )
    rows = read_jsonl(path)
    splits = {local_split: datasets.Dataset.from_list(rows)}
    logger.info("%s: %d rows from %s", local_name, len(rows), path)
    if local_fewshot_split:
        train_path = directory / f"{local_name}.train.jsonl"
        if train_path.is_file():
            splits[local_fewshot_split] = datasets.Dataset.from_list(read_jsonl(train_path))
        else:
            features = splits[local_split].features
            splits[local_fewshot_split] = datasets.Dataset.from_dict(
                {name: [] for name in features}, features=features
            )
    return datasets.DatasetDict(splits)
