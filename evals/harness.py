#!/usr/bin/env python
"""lm-eval 0.4.13 for DCFormer: lm-eval's own command line, plus a Python entry point.

Command line -- exactly lm-eval's (`run`, `ls`, `validate`, every option), with two additions: the model name
`dcformer` (see evals/dcformer_lm.py) and the tasks of evals/tasks (`lambada_openai_local`, `piqa_local`,
`hellaswag_local`, the tag `dcformer_local` for those three, and `dcformer_gen_local`):

    dcformer-eval run --model dcformer --model_args pretrained=Caiyun-AI/DCPythia-6.9B,dtype=float16 \\
        --tasks lambada_openai,piqa,hellaswag --batch_size 16 --device cuda:0 --output_path results/dcpythia-6.9b
    dcformer-eval run --model hf --model_args pretrained=EleutherAI/pythia-6.9b,dtype=float16 \\
        --tasks lambada_openai,piqa,hellaswag --batch_size 16 --device cuda:0 --output_path results/pythia-6.9b
    dcformer-eval run --model dcformer --model_args pretrained=./my-dcformer --device cpu \\
        --tasks dcformer_local --metadata data_dir=/data/evals      # offline (or DCFORMER_EVAL_DATA=/data/evals)
    dcformer-eval ls tasks

Python (notebooks, tests):

    from modeling_dcformer.evals.harness import evaluate
    results = evaluate(model, tokenizer, ["lambada_openai_local", "piqa_local", "hellaswag_local"], batch_size=8)
    results["results"]["piqa_local"]["acc,none"]
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

EVALS_DIR = Path(__file__).resolve().parent
TASKS_DIR = EVALS_DIR / "tasks"
DEFAULT_TASKS = ("lambada_openai_local", "piqa_local", "hellaswag_local")


def _as_paths(include_path: str | os.PathLike | Iterable[str | os.PathLike] | None) -> list[Path]:
    """User task paths: None, one path, a list, or one string of paths joined by os.pathsep."""
    if include_path is None:
        return []
    if isinstance(include_path, (str, os.PathLike)):
        return [Path(p) for p in str(include_path).split(os.pathsep) if p]
    return [Path(p) for p in include_path]


_local_index: dict | None = None


def local_task_names() -> set[str]:
    """Task, tag and group names defined in evals/tasks."""
    global _local_index
    if _local_index is None:
        from lm_eval.tasks._index import TaskIndex

        _local_index = TaskIndex.build([TASKS_DIR])
    return set(_local_index)


def _flatten_task_names(tasks: Iterable[Any] | str | None) -> list[Any]:
    if tasks is None:
        return []
    if isinstance(tasks, str):
        tasks = [tasks]
    names: list[Any] = []
    for task in tasks:
        names.extend(t for t in task.split(",") if t) if isinstance(task, str) else names.append(task)
    return names


def _only_local(tasks: Iterable[Any] | str | None, include_path=None) -> bool:
    """True when every requested task is one of ours and no other task path is asked for: lm-eval's own
    14,000-odd task files then need not be indexed (that takes most of a small run's time)."""
    names = _flatten_task_names(tasks)
    if not names or _as_paths(include_path):
        return False
    local = local_task_names()
    return all(isinstance(name, str) and name in local for name in names)


def make_task_manager(
    tasks=None, include_path=None, metadata: dict | None = None, include_defaults: bool | None = None
):
    """lm-eval's TaskManager over evals/tasks, any `include_path`, and (unless every one of `tasks` is ours)
    lm-eval's built-in tasks. `metadata` reaches every task (and our data loader: key `data_dir`)."""
    from lm_eval.tasks import TaskManager

    if include_defaults is None:
        include_defaults = not _only_local(tasks, include_path)
    return TaskManager(
        include_path=[TASKS_DIR, *_as_paths(include_path)],
        include_defaults=include_defaults,
        metadata=metadata or {},
    )


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_limit(limit) -> None:
    """lm-eval's limit is a number of rows (>= 1) or a fraction in (0, 1); 0 and negatives would reach its
    internals. (examples/demo.py's `--limit 0` means every row: here, leave the limit out.)"""
    if limit is None:
        return
    if not isinstance(limit, (int, float)) or isinstance(limit, bool) or not limit > 0:
        shown = f"{limit:g}" if isinstance(limit, (int, float)) else repr(limit)
        hint = " would score no row" if limit == 0 else " is not a number of rows"
        raise ValueError(
            f"--limit {shown}{hint}: give a number of rows a task (e.g. 100) or a fraction (e.g. 0.1), or leave "
            "--limit out to score every row"
        )


def check_model_path(pretrained) -> None:
    """A model given by name must be an existing directory or a Hub id: otherwise lm-eval reports "Repo id must be
    in the form..." from deep inside the Hub client."""
    if not isinstance(pretrained, (str, os.PathLike)):
        return
    from modeling_dcformer.hub import is_hub_id

    name = os.fspath(pretrained)
    path = Path(name).expanduser()
    if path.exists() and not path.is_dir():
        raise FileNotFoundError(f"model {name!r} is a file: give the model's directory (config.json and weights)")
    if not path.exists() and not is_hub_id(name):
        raise FileNotFoundError(
            f"model {name!r}: no such directory, and not a Hub id ('namespace/name'): check the path"
        )


def evaluate(
    model,
    tokenizer=None,
    tasks: Sequence[str] | str = DEFAULT_TASKS,
    batch_size: int | str = 1,
    limit: int | float | None = None,
    data_dir: str | os.PathLike | None = None,
    num_fewshot: int | None = None,
    *,
    lm_class: str = "dcformer",
    include_path=None,
    output_path: str | os.PathLike | None = None,
    model_name: str | None = None,
    **kwargs,
) -> dict:
    """Evaluate a model with lm-eval and return lm-eval's results dict (what `simple_evaluate` returns).

    model: an in-memory `transformers` model (with `tokenizer`, a tokenizer object or name; None loads the one
        saved beside the model), a checkpoint path or Hub id (loaded by `lm_class`), or a ready lm-eval `LM`.
    tasks: task names (ours, e.g. "lambada_openai_local", or lm-eval's, e.g. "piqa"), or one comma-joined string.
    data_dir: where the `*_local` tasks read their JSON-lines files (default: $DCFORMER_EVAL_DATA, else
        evals/fixtures).
    lm_class: the registered lm-eval model that wraps `model`: "dcformer" (default) or "hf".
    output_path: also write the results (JSON) there: a `.json` file, or a directory for `results_<date>.json`.
    model_name: recorded as the results' `model_name` (the report's row label); default: the checkpoint path or
        the model's `name_or_path`.
    kwargs: parameters of `lm_eval.simple_evaluate` (e.g. `bootstrap_iters`, `log_samples` -- False unless
        given --, `gen_kwargs`, `metadata`, `random_seed`) go there; the rest go to the model class
        (e.g. `device`, `dtype`, `max_length`, `add_bos_token`).
    """
    import lm_eval
    from lm_eval.api.model import LM
    from lm_eval.api.registry import get_model

    from . import dcformer_lm

    dcformer_lm.register()
    check_limit(limit)
    if not isinstance(model, LM):
        check_model_path(model)
    task_list = _flatten_task_names(tasks)
    evaluate_params = set(inspect.signature(lm_eval.simple_evaluate).parameters) - {"model", "model_args", "tasks"}
    eval_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in evaluate_params}
    eval_kwargs.setdefault("log_samples", False)
    metadata = dict(eval_kwargs.pop("metadata", None) or {})
    if data_dir is not None:
        metadata["data_dir"] = str(Path(data_dir).expanduser().resolve())

    if isinstance(model, LM):
        if tokenizer is not None or kwargs:
            raise TypeError("tokenizer and model keyword arguments do not apply to a ready lm-eval LM")
        lm = model
    else:
        model_kwargs = dict(kwargs)
        if isinstance(model, (str, os.PathLike)):
            model = str(model)
            model_kwargs.setdefault("device", _default_device())
        lm = get_model(lm_class)(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, **model_kwargs)

    task_manager = make_task_manager(task_list, include_path=include_path, metadata=metadata)
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=task_list,
        num_fewshot=num_fewshot,
        batch_size=batch_size,
        limit=limit,
        task_manager=task_manager,
        **eval_kwargs,
    )
    if results is None:  # not the main process of a distributed run
        return results
    if model_name is None:
        source = lm.model if isinstance(model, LM) else model
        model_name = source if isinstance(source, str) else getattr(source, "name_or_path", "") or type(source).__name__
    results["model_name"] = model_name
    if output_path is not None:
        save_results(results, output_path)
    return results


def save_results(results: dict, path: str | os.PathLike) -> Path:
    """Write a results dict as JSON (lm-eval's serialisation of dtypes and the like); samples are left out.
    `path`: a `.json` file, or a directory that gets `results_<date>.json` (lm-eval's name for it)."""
    from datetime import datetime

    from lm_eval.utils import handle_non_serializable

    path = Path(path)
    if path.suffix != ".json":
        path = path / f"results_{datetime.now().isoformat().replace(':', '-')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {k: v for k, v in results.items() if k != "samples"}
    text = json.dumps(payload, indent=2, default=handle_non_serializable, ensure_ascii=False) + "\n"
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")  # written beside, then renamed: never half a file
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _install_task_path(local_only: bool):
    """Make every TaskManager that lm-eval's CLI builds (run, ls, validate) see evals/tasks beside any
    --include_path, and skip lm-eval's built-in tasks when the run names only ours. Returns the class it
    replaced (`main` puts it back when done)."""
    import lm_eval.tasks
    from lm_eval.tasks.manager import TaskManager

    class TaskManagerWithLocalTasks(TaskManager):
        def __init__(self, verbosity=None, include_path=None, include_defaults=True, metadata=None):
            super().__init__(
                verbosity=verbosity,
                include_path=[TASKS_DIR, *_as_paths(include_path)],
                include_defaults=include_defaults and not local_only,
                metadata=metadata,
            )

    previous = lm_eval.tasks.TaskManager
    lm_eval.tasks.TaskManager = TaskManagerWithLocalTasks
    return previous


def main(argv: Sequence[str] | None = None) -> int:
    """lm-eval's command line (`run`, `ls`, `validate`) with the `dcformer` model and evals/tasks.
    `argv` (without the program name) defaults to sys.argv[1:]."""
    import lm_eval.tasks
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    from . import dcformer_lm

    dcformer_lm.register()
    saved_argv = sys.argv
    if argv is not None:
        sys.argv = [sys.argv[0] if sys.argv else "harness.py", *argv]
    previous = None
    try:
        setup_logging()
        parser = HarnessCLI()  # reads sys.argv; inserts `run` when no subcommand is given, as lm-eval does
        args = parser.parse_args()
        if getattr(args, "command", None) == "run":
            try:
                check_limit(getattr(args, "limit", None))
                check_model_path((getattr(args, "model_args", None) or {}).get("pretrained"))
            except (ValueError, OSError) as err:
                print(f"error: {err}", file=sys.stderr)
                return 2
        local_only = getattr(args, "command", None) == "run" and _only_local(
            getattr(args, "tasks", None), getattr(args, "include_path", None)
        )
        previous = _install_task_path(local_only)
        parser.execute(args)
    finally:
        sys.argv = saved_argv
        if previous is not None:
            lm_eval.tasks.TaskManager = previous
    return 0


if __name__ == "__main__":
    sys.exit(main())
