#!/usr/bin/env python
"""lm-eval 0.4.13 for DCFormer: lm-eval's own command line, plus a Python entry point.

Command line -- lm-eval's (`run`, `ls`, `validate`, every option), with these additions (`dcformer-eval --help`
lists them before lm-eval's help): the model name `dcformer` (see evals/dcformer_lm.py); the tasks of
evals/tasks (`lambada_openai_local`, `piqa_local`, `hellaswag_local`, the tag `dcformer_local` for those three,
and `dcformer_gen_local`) reading `--metadata data_dir=DIR`; and checks made before the model loads (task names,
--limit, --num_fewshot, the data directory, data sets that the Hub would have to serve while it cannot, the model
and its files, --batch_size, --device, --output_path), each fault one line `error: ...` with exit code 2:

    dcformer-eval run --model dcformer --model_args pretrained=Caiyun-AI/DCPythia-6.9B,dtype=float16 \\
        --tasks lambada_openai,piqa,hellaswag --batch_size 16 --device cuda:0 --output_path results/dcpythia-6.9b
    dcformer-eval run --model hf --model_args pretrained=EleutherAI/pythia-6.9b,dtype=float16 \\
        --tasks lambada_openai,piqa,hellaswag --batch_size 16 --device cuda:0 --output_path results/pythia-6.9b
    dcformer-eval run --model dcformer --model_args pretrained=./my-dcformer --device cpu \\
        --tasks dcformer_local --metadata data_dir=/data/evals      # offline (or DCFORMER_EVAL_DATA=/data/evals)
    dcformer-eval ls tasks

`--output_path DIR` puts a run's results in DIR/<model>/results_<date>.json (`results_folder_name`: the local
model's folder name, or namespace__name for a Hub id; lm-eval itself would name `./NAME` as the hidden `.__NAME`),
written beside and renamed into place; the run prints `results: FILE` last, or exits 1 with one line if the file
could not be written.

The same runs as `python -m modeling_dcformer.evals.harness ...` or as a file, `python evals/harness.py ...`.

Python (notebooks, tests), with the same checks (raised):

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
_builtin_index: dict | None = None


def local_task_names() -> set[str]:
    """Task, tag and group names defined in evals/tasks."""
    global _local_index
    if _local_index is None:
        from lm_eval.tasks._index import TaskIndex

        _local_index = TaskIndex.build([TASKS_DIR])
    return set(_local_index)


def builtin_task_index() -> dict:
    """lm-eval's index of its own 14,000-odd task files, built once a process (it takes most of a small run's
    start-up; the files do not change while a process runs)."""
    global _builtin_index
    if _builtin_index is None:
        import lm_eval.tasks
        from lm_eval.tasks._index import TaskIndex

        _builtin_index = TaskIndex.build([Path(lm_eval.tasks.__file__).parent])
    return _builtin_index


def _flatten_task_names(tasks: Iterable[Any] | str | None) -> list[Any]:
    """Task names from a list and/or comma-joined strings, in order; empty names are kept (and refused by
    `check_task_names`)."""
    if tasks is None:
        return []
    if isinstance(tasks, str):
        tasks = [tasks]
    names: list[Any] = []
    for task in tasks:
        names.extend(task.split(",")) if isinstance(task, str) else names.append(task)
    return names


def _only_local(tasks: Iterable[Any] | str | None, include_path=None) -> bool:
    """True when every requested task is one of ours and no other task path is asked for: lm-eval's own
    14,000-odd task files then need not be indexed (that takes most of a small run's time)."""
    names = _flatten_task_names(tasks)
    if not names or _as_paths(include_path):
        return False
    local = local_task_names()
    return all(isinstance(name, str) and name in local for name in names)


def _task_manager_class(local_only: bool = False):
    """lm-eval's TaskManager over evals/tasks and any include path, with lm-eval's built-in tasks unless
    `local_only`. The built-in index comes from `builtin_task_index` (built once a process); the include paths
    override built-in tasks of the same name, as in lm-eval."""
    from collections import defaultdict

    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._index import Kind

    class TaskManagerWithLocalTasks(TaskManager):
        def __init__(self, verbosity=None, include_path=None, include_defaults=True, metadata=None):
            super().__init__(
                verbosity=verbosity,
                include_path=[TASKS_DIR, *_as_paths(include_path)],
                include_defaults=False,
                metadata=metadata,
            )
            if include_defaults and not local_only:
                # the lists TaskManager.__init__ derives from its index (lm-eval 0.4.13), for the merged index
                self._index = {**builtin_task_index(), **self._index}
                buckets = defaultdict(list)
                for name, entry in self._index.items():
                    buckets[entry.kind].append(name)
                self._all_tasks = sorted(self._index)
                self._all_subtasks = sorted(buckets[Kind.TASK] + buckets[Kind.PY_TASK])
                self._all_groups = sorted(buckets[Kind.GROUP])
                self._all_tags = sorted(buckets[Kind.TAG])

    return TaskManagerWithLocalTasks


def make_task_manager(
    tasks=None, include_path=None, metadata: dict | None = None, include_defaults: bool | None = None
):
    """lm-eval's TaskManager over evals/tasks, any `include_path`, and (unless every one of `tasks` is ours)
    lm-eval's built-in tasks. `metadata` reaches every task (and our data loader: key `data_dir`)."""
    if include_defaults is None:
        include_defaults = not _only_local(tasks, include_path)
    return _task_manager_class()(include_path=include_path, include_defaults=include_defaults, metadata=metadata or {})


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


def check_num_fewshot(num_fewshot) -> None:
    """A number of few-shot examples is an integer >= 0 (0: zero-shot); None leaves each task's default."""
    if num_fewshot is None:
        return
    if isinstance(num_fewshot, bool) or not isinstance(num_fewshot, int) or num_fewshot < 0:
        raise ValueError(
            f"--num_fewshot {num_fewshot}: give a number of examples >= 0 (0: zero-shot), or leave --num_fewshot "
            "out for each task's default"
        )


def check_batch_size(batch_size) -> None:
    """lm-eval's batch size: a whole number >= 1, "auto" (the largest that fits, found once) or "auto:N" (found
    again N times in the run); None leaves the default (1)."""
    if batch_size is None:
        return
    text = str(batch_size).strip()
    mode, colon, times = text.partition(":")
    if isinstance(batch_size, bool):
        ok = False
    elif mode == "auto":
        ok = not colon or _positive_number(times)
    else:
        ok = not colon and text.isdigit() and int(text) >= 1
    if not ok:
        raise ValueError(
            f"--batch_size {text or repr(text)}: give a number of rows >= 1 (e.g. 8), 'auto' (the largest that fits) "
            "or 'auto:N' (found again N times during the run)"
        )


def _positive_number(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


def available_devices() -> list[str]:
    """The devices this process can place a model on, as `--device` names them (cpu, cuda:N, mps, xpu:N, ...)."""
    import torch

    devices = ["cpu"]
    if torch.cuda.is_available():
        devices += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        devices.append("mps")
    for kind in ("xpu", "npu", "hpu"):
        backend = getattr(torch, kind, None)
        if backend is not None and getattr(backend, "is_available", lambda: False)():
            devices += [f"{kind}:{i}" for i in range(backend.device_count())]
    return devices


def check_device(device) -> None:
    """`--device` names a device this machine has: lm-eval takes `cuda` without a GPU (and fails once the model is
    loaded) and silently uses another device for a name it does not know (`cuda:5` on a one-GPU machine)."""
    if device is None:
        return
    import torch

    name = str(device).strip()
    available = available_devices()
    try:
        parsed = torch.device(name)
    except (RuntimeError, ValueError):
        parsed = None
    if parsed is not None:
        kind, index = parsed.type, parsed.index
        if kind == "cpu" and index in (None, 0):
            return
        if kind == "mps" and index in (None, 0) and "mps" in available:
            return
        if index is None and any(d.startswith(f"{kind}:") for d in available):
            return
        if f"{kind}:{index}" in available:
            return
    if parsed is not None and parsed.type == "cuda" and not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise ValueError(f"--device {name}: {why}; give --device cpu (devices here: {', '.join(available)})")
    raise ValueError(f"--device {name}: not a device of this machine; give one of {', '.join(available)}")


def _nearest_existing(path: Path) -> Path:
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def check_output_path(output_path) -> Path | None:
    """Before the model loads: results can be written where `output_path` points (a directory, or a `.json` file
    whose directory gets the results). Returns that directory (None: no output path). The directory and its parents
    need not exist yet; the nearest existing one must be a directory this process can create entries in (tried
    with an empty folder, removed at once)."""
    import tempfile

    if output_path is None or str(output_path) == "":
        return None
    target = Path(output_path).expanduser()
    folder = target.parent if target.suffix == ".json" else target
    existing = _nearest_existing(Path(os.path.abspath(folder)))
    if not existing.is_dir():
        what = "a file" if existing.exists() else "a broken link"
        raise NotADirectoryError(
            f"--output_path {output_path}: {existing} is {what}, not a directory: give a directory"
        )
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".dcformer-eval-", dir=existing))
    except OSError as err:
        raise PermissionError(
            f"--output_path {output_path}: cannot write in {existing} ({err.strerror or err}): give a directory you "
            "can write"
        ) from None
    return folder


def results_folder_name(model_name: str | None) -> str:
    """The folder of a model's results under `--output_path DIR` (DIR/<this>/results_<date>.json): a local model's
    own folder name (`./my-dcformer`, `/data/my-dcformer/` -> `my-dcformer`), else lm-eval's name for a Hub id
    (`Caiyun-AI/DCPythia-6.9B` -> `Caiyun-AI__DCPythia-6.9B`); never a hidden name (lm-eval turns `./NAME` into
    `.__NAME`)."""
    from lm_eval.utils import sanitize_model_name

    name = str(model_name or "").strip()
    local = name.startswith((".", "/", "~")) or os.path.isabs(name) or os.path.isdir(name)
    if local:
        name = Path(name).expanduser().resolve().name
    return sanitize_model_name(name).lstrip(".") or "model"


def check_task_names(tasks) -> list:
    """The requested names, flattened; an empty list or an empty name (a stray comma) is refused here, before
    anything loads. Whether each name exists is `check_tasks`' question (it needs the task index)."""
    names = _flatten_task_names(tasks)
    shown = ",".join(name if isinstance(name, str) else "<config>" for name in names)
    if not names or names == [""]:
        raise ValueError(f"--tasks {shown!r} names no task: give task names, e.g. --tasks {','.join(DEFAULT_TASKS)}")
    if any(isinstance(name, str) and not name.strip() for name in names):
        raise ValueError(
            f"--tasks {shown!r} has an empty task name (a stray comma?): give names joined by single commas"
        )
    return names


def _is_hub_id(name: str) -> bool:
    """Whether `name` reads as a Hub repository id ("name" or "namespace/name") rather than a local path."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if name.startswith((".", "/", "~")) or os.path.isabs(name):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE, or HF_DATASETS_OFFLINE for data sets) is set, as the
    Hub client and `datasets` read them."""
    import datasets.config
    import huggingface_hub.constants

    return bool(huggingface_hub.constants.HF_HUB_OFFLINE or datasets.config.HF_HUB_OFFLINE)


def hub_unreachable() -> str | None:
    """None when the Hub answers a single request (any status), else why not (one short phrase). One try with a
    10 s timeout, no retries: the Hub client retries five times with back-off before it gives up."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session, httpx

    try:
        get_session().head(constants.ENDPOINT, timeout=10)
    except (httpx.TransportError, OSError) as err:
        return f"{constants.ENDPOINT} is unreachable ({type(err).__name__}: {err})"
    return None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                        "added_tokens.json")


def check_model_source(pretrained, tokenizer=None, model_args: dict | None = None) -> None:
    """A model given by name must be usable before anything loads (loading a 7B model takes minutes; lm-eval
    fails only after it, or never: a GPT-NeoX directory without tokenizer files loads an empty tokenizer):

    - a path: an existing directory (not a file), holding tokenizer files unless `tokenizer` names one;
    - else a Hub id ('namespace/name') that is in the Hub cache, or that the Hub can be asked for (not offline,
      the Hub answers).
    A tokenizer given by name passes the same checks. Raises FileNotFoundError / ConnectionError, one line naming
    the model (or tokenizer) and the option."""
    model_args = model_args or {}
    if isinstance(pretrained, (str, os.PathLike)):
        _check_source(
            os.fspath(pretrained), "model", "config.json",
            need_tokenizer=tokenizer is None and not model_args.get("gguf_file"),
            subfolder=model_args.get("subfolder"), revision=model_args.get("revision"),
        )
    if isinstance(tokenizer, (str, os.PathLike)):
        _check_source(os.fspath(tokenizer), "tokenizer", "tokenizer_config.json", need_tokenizer=True)


def _check_readable(folder: Path, option: str, files: Sequence[str]) -> None:
    """Each of `files` present in `folder` parses (JSON; tokenizer.json as the `tokenizers` library reads it): a
    corrupt file is refused here, not after lm-eval has started loading."""
    for file in files:
        path = folder / file
        if not path.is_file():
            continue
        try:
            if file == "tokenizer.json":
                from tokenizers import Tokenizer

                Tokenizer.from_file(str(path))
            else:
                json.loads(path.read_text(encoding="utf-8"))
        except Exception as err:  # noqa: BLE001 -- json, UnicodeDecodeError, OSError, or the tokenizers library's
            hint = ("save the model again" if file == "config.json" else
                    "save the tokenizer again, or give tokenizer=<directory or Hub id> in --model_args")
            raise ValueError(f"{path} ({option}) cannot be read ({_one_line(err)}): {hint}") from None


def _check_source(name: str, what: str, hub_file: str, need_tokenizer: bool, subfolder=None, revision=None) -> None:
    path = Path(name).expanduser()
    option = f"{'pretrained' if what == 'model' else what}={name} in --model_args"
    if path.exists() and not path.is_dir():
        raise FileNotFoundError(f"{what} {name!r} is a file: give the {what}'s directory")
    if path.is_dir():
        folder = path / subfolder if subfolder else path
        if need_tokenizer and not any((folder / file).is_file() for file in TOKENIZER_FILES):
            raise FileNotFoundError(
                f"{what} directory {name!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): add "
                "tokenizer=<directory or Hub id> to --model_args (DCPythia: tokenizer=EleutherAI/pythia-6.9b)"
            )
        files = (hub_file,) if what == "model" else ()
        _check_readable(folder, option, files + (TOKENIZER_JSON_FILES if need_tokenizer else ()))
        return
    if not _is_hub_id(name):
        raise FileNotFoundError(
            f"{what} {name!r} ({option}): no such directory, and not a Hub id ('namespace/name'): check the path"
        )
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, hub_file, revision=revision), str):
        return
    if hub_offline():
        raise ConnectionError(
            f"{what} {name!r} ({option}): no such directory, and not in the Hub cache while HF_HUB_OFFLINE is set: "
            f"give the {what}'s directory, or download it once with the Hub reachable"
        )
    reason = hub_unreachable()
    if reason:
        raise ConnectionError(
            f"{what} {name!r} ({option}): no such directory, not in the Hub cache, and {reason}: give the {what}'s "
            "directory"
        )


# ---------------------------------------------------------------------------------------------------- task checks
class DataUnreachableError(ConnectionError):
    """The data of a requested task is on the Hub, which cannot be reached (offline, or no network), and it is
    not in the `datasets` cache."""


def _local_copies(tasks: Iterable[str]) -> list[str]:
    local = local_task_names()
    return [f"{task}_local" for task in tasks if f"{task}_local" in local]


def data_unreachable_message(what: str, tasks: Iterable[str] = ()) -> str:
    """One line: what is unreachable, and the offline route (the `*_local` tasks and where they read)."""
    copies = _local_copies(tasks) or list(DEFAULT_TASKS)
    return (
        f"{what}; offline, run the local copies: --tasks {','.join(copies)} (tag dcformer_local: the three), "
        f"reading JSON-lines files from --metadata data_dir=DIR (or ${_data_env_var()}=DIR; default: the small "
        "fixtures shipped in evals/fixtures); docs/evaluation.md says how to export the full sets"
    )


def _data_env_var() -> str:
    from modeling_dcformer.evals.tasks import local_data

    return local_data.ENV_VAR


def _leaf_configs(name: str, index: dict, seen: set | None = None) -> list[tuple[str, dict]]:
    """(task name, index config) of every task that `name` (a task, group or tag of the index) runs."""
    from lm_eval.tasks._index import Kind

    seen = set() if seen is None else seen
    entry = index.get(name)
    if entry is None or name in seen:
        return []
    seen.add(name)
    if entry.kind is Kind.TAG:
        members = [other.name for other in index.values() if name in other.tags]
        return [leaf for member in members for leaf in _leaf_configs(member, index, seen)]
    if entry.kind is Kind.GROUP:
        children = (entry.cfg or {}).get("task") or []
        leaves = []
        for child in children if isinstance(children, list) else [children]:
            if isinstance(child, str):
                leaves.extend(_leaf_configs(child, index, seen))
            elif isinstance(child, dict) and isinstance(child.get("task"), str):
                base = index.get(child["task"])
                cfg = {**(base.cfg or {}), **child} if base is not None and base.cfg else child
                leaves.append((child["task"], cfg))
        return leaves
    return [(name, entry.cfg or {})]


def _hub_dataset(cfg: dict) -> str | None:
    """The Hub data set a task config loads (`dataset_path`), or None when it reads local files."""
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

    path = cfg.get("dataset_path")
    if cfg.get("custom_dataset") or not isinstance(path, str) or not path:
        return None
    if path in _PACKAGED_DATASETS_MODULES or os.path.exists(path) or not _is_hub_id(path):
        return None
    return path


def _dataset_cached(path: str) -> bool:
    """Whether `datasets` would load `path` from its cache without the Hub (its own lookup, warning silenced)."""
    import logging as std_logging

    from datasets.load import CachedDatasetModuleFactory

    logger = std_logging.getLogger("datasets.load")
    level = logger.level
    logger.setLevel(std_logging.ERROR)
    try:
        CachedDatasetModuleFactory(path).get_module()
    except Exception:  # noqa: BLE001 -- any failure means: not usable from the cache
        return False
    finally:
        logger.setLevel(level)
    return True


def _count_rows(path: Path) -> int:
    with open(path, encoding="utf-8") as handle:
        return sum(1 for line in handle if line.strip())


def _check_fewshot_pool(task: str, kwargs: dict, directory: Path, num_fewshot: int) -> None:
    """A `*_local` task has `num_fewshot` examples to draw: its `.train.jsonl` file when the task names a few-shot
    split (PIQA, HellaSwag), else the rows it scores (lm-eval's rule for a task with a test split only)."""
    if kwargs.get("local_fewshot_split"):
        source = directory / f"{kwargs['local_name']}.train.jsonl"
        if not source.is_file():
            raise FileNotFoundError(
                f"--num_fewshot {num_fewshot}: {task} draws its few-shot examples from {source}, which does not "
                "exist: give --num_fewshot 0 (zero-shot), or add that file (docs/evaluation.md says how to export it)"
            )
    else:
        source = directory / f"{kwargs['local_name']}.jsonl"
    rows = _count_rows(source)
    if num_fewshot > rows:
        raise ValueError(
            f"--num_fewshot {num_fewshot}: {task} has {rows} few-shot examples ({source}): give at most {rows}"
        )


def check_tasks(names: Sequence[Any], task_manager, metadata: dict | None = None, num_fewshot: int | None = None
                ) -> None:
    """Before the model loads: every name is a task, group or tag of `task_manager` (or a task file or directory,
    as lm-eval allows); the `*_local` tasks find their data directory and files, and `num_fewshot` examples to draw
    from; the data of Hub tasks is in the `datasets` cache or the Hub can be reached (not offline, and it answers
    one request)."""
    from lm_eval.utils import pattern_match

    from modeling_dcformer.evals.tasks import local_data

    index = task_manager.task_index
    leaves: list[tuple[str, dict]] = []
    for name in names:
        if not isinstance(name, str):  # an inline task config
            continue
        matched = pattern_match([name], task_manager.all_tasks)
        if not matched:
            if name.endswith(".yaml") or Path(name).is_dir():
                continue  # lm-eval reads task files and directories itself
            import difflib

            close = difflib.get_close_matches(name, task_manager.all_tasks, n=3, cutoff=0.8)
            hint = f" (close: {', '.join(close)})" if close else ""
            raise ValueError(
                f"--tasks {name!r}: no task, group or tag of that name{hint}; `dcformer-eval ls tasks` lists them "
                f"(offline copies: {', '.join(DEFAULT_TASKS)}, tag dcformer_local)"
            )
        for match in matched:
            leaves.extend(_leaf_configs(match, index))

    metadata = metadata or {}
    data_dir = metadata.get("data_dir")
    if data_dir is not None and not Path(str(data_dir)).expanduser().is_dir():
        raise FileNotFoundError(f"--metadata data_dir={data_dir}: no such directory")
    local_names = sorted({cfg["dataset_kwargs"]["local_name"] for _, cfg in leaves
                          if isinstance(cfg.get("dataset_kwargs"), dict) and "local_name" in cfg["dataset_kwargs"]})
    if local_names:
        if data_dir is None and os.environ.get(local_data.ENV_VAR):
            directory = os.environ[local_data.ENV_VAR]
            if not Path(directory).expanduser().is_dir():
                raise FileNotFoundError(f"${local_data.ENV_VAR}={directory}: no such directory")
        directory = local_data.resolve_data_dir(data_dir)
        missing = [f"{local}.jsonl" for local in local_names if not (directory / f"{local}.jsonl").is_file()]
        if missing:
            raise FileNotFoundError(
                f"data directory {directory} lacks {', '.join(missing)}: point --metadata data_dir=DIR (or "
                f"${local_data.ENV_VAR}) at a directory holding it"
            )
        if num_fewshot:
            for task, cfg in leaves:
                kwargs = cfg.get("dataset_kwargs")
                if isinstance(kwargs, dict) and "local_name" in kwargs:
                    _check_fewshot_pool(task, kwargs, directory, num_fewshot)

    remote = {}
    for task, cfg in leaves:
        path = _hub_dataset(cfg)
        if path is not None and not _dataset_cached(path):
            remote.setdefault(path, []).append(task)
    if not remote:
        return
    tasks = list(dict.fromkeys(task for group in remote.values() for task in group))  # in the order asked
    def named(group: list[str]) -> str:  # a group such as mmlu runs dozens of tasks on one data set
        return ", ".join(group) if len(group) <= 4 else f"{', '.join(group[:3])} and {len(group) - 3} more"

    shown = ", ".join(f"{named(group)} ({path})" for path, group in list(remote.items())[:6])
    if len(remote) > 6:
        shown += f" and {len(remote) - 6} more data sets"
    if hub_offline():
        raise DataUnreachableError(data_unreachable_message(
            f"the data of {shown} is on the Hub and not in the datasets cache, and HF_HUB_OFFLINE / "
            "HF_DATASETS_OFFLINE is set", tasks,
        ))
    reason = hub_unreachable()
    if reason:
        raise DataUnreachableError(data_unreachable_message(
            f"the data of {shown} is on the Hub and not in the datasets cache, and {reason}", tasks,
        ))


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

    from modeling_dcformer.evals import dcformer_lm

    dcformer_lm.register()
    check_limit(limit)
    check_num_fewshot(num_fewshot)
    check_batch_size(batch_size)
    task_list = check_task_names(tasks)
    # `device` and `max_batch_size` are the model's: simple_evaluate uses them only for a model it builds itself
    evaluate_params = set(inspect.signature(lm_eval.simple_evaluate).parameters) - {
        "model", "model_args", "tasks", "device", "max_batch_size"}
    eval_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in evaluate_params}
    eval_kwargs.setdefault("log_samples", False)
    metadata = dict(eval_kwargs.pop("metadata", None) or {})
    if data_dir is not None:
        metadata["data_dir"] = str(Path(data_dir).expanduser().resolve())
    if isinstance(model, LM):
        if tokenizer is not None or kwargs:
            raise TypeError("tokenizer and model keyword arguments do not apply to a ready lm-eval LM")
    else:
        check_model_source(model, tokenizer, kwargs)
        check_device(kwargs.get("device"))
    check_output_path(output_path)
    # every check that can fail before the model loads (a 7B model takes minutes)
    task_manager = make_task_manager(task_list, include_path=include_path, metadata=metadata)
    check_tasks(task_list, task_manager, metadata, num_fewshot=num_fewshot)

    if isinstance(model, LM):
        lm = model
    else:
        model_kwargs = dict(kwargs)
        if isinstance(model, (str, os.PathLike)):
            model = str(model)
            model_kwargs.setdefault("device", _default_device())
        lm = get_model(lm_class)(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, **model_kwargs)

    try:
        results = lm_eval.simple_evaluate(
            model=lm,
            tasks=task_list,
            num_fewshot=num_fewshot,
            batch_size=batch_size,
            limit=limit,
            task_manager=task_manager,
            **eval_kwargs,
        )
    except DataUnreachableError:
        raise
    except ConnectionError as err:  # data that the checks above took for cached, or a network that went away
        raise DataUnreachableError(data_unreachable_message(str(err), task_list)) from err
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

    from modeling_dcformer.checkpoints import atomic_dir

    path = Path(path).expanduser()
    if path.suffix != ".json":
        path = path / f"results_{datetime.now().isoformat().replace(':', '-')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {k: v for k, v in results.items() if k != "samples"}
    text = json.dumps(payload, indent=2, default=handle_non_serializable, ensure_ascii=False) + "\n"
    atomic_dir.write_file(path, text)  # written beside, then renamed: never half a file
    return path


def _results_tracker_class(made: list):
    """lm-eval's EvaluationTracker (0.4.13) for `dcformer-eval run`: the results of `--output_path DIR` go to
    DIR/<results_folder_name(model)>/results_<date>.json (lm-eval's own file name, in a folder that is never
    hidden), written beside and renamed into place (never half a file), and a write that fails is kept in
    `error` for `main` to report (lm-eval logs it and goes on to exit 0). Each tracker made is appended to
    `made`. With --push_results_to_hub, lm-eval's own saving runs (its upload reads the file it wrote) and the file
    is checked afterwards."""
    from dataclasses import asdict
    from datetime import datetime

    from lm_eval.loggers import EvaluationTracker
    from lm_eval.utils import handle_non_serializable, hash_string

    from modeling_dcformer.checkpoints import atomic_dir

    class ResultsTracker(EvaluationTracker):
        error: str | None = None
        results_file: Path | None = None

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

        def _results_file(self) -> Path:
            path = Path(self.output_path).expanduser()
            if path.suffix == ".json":  # lm-eval's rule for a file name: <stem>_<date>.json beside it
                return path.with_name(f"{path.stem}_{self.date_id}.json")
            return path / str(self.general_config_tracker.model_name_sanitized) / f"results_{self.date_id}.json"

        def save_results_aggregated(self, results: dict, samples: dict | None = None) -> None:
            general = self.general_config_tracker
            general.model_name_sanitized = results_folder_name(general.model_name)
            if not self.output_path or self.push_results_to_hub:
                super().save_results_aggregated(results=results, samples=samples)
                if self.output_path:
                    self._check_written()
                return
            general.log_end_time()
            task_hashes = {}
            for task_name, task_samples in (samples or {}).items():  # as lm-eval computes them
                task_hashes[task_name] = hash_string(
                    "".join(s["doc_hash"] + s["prompt_hash"] + s["target_hash"] for s in task_samples)
                )
            results.update({"task_hashes": task_hashes})
            results.update(asdict(general))
            dumped = json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)
            self.date_id = datetime.now().isoformat().replace(":", "-")
            path = self._results_file()
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                atomic_dir.write_file(path, dumped)
            except OSError as err:
                self.error = f"could not write {path} ({err.strerror or err})"
                return
            self.results_file = path

        def _check_written(self) -> None:
            """After lm-eval's own saving: its file is there and whole (a partial one is removed)."""
            path = self._results_file() if getattr(self, "date_id", None) else None
            if path is not None:
                try:
                    json.loads(path.read_text(encoding="utf-8"))
                except (OSError, ValueError):
                    if path.is_file():
                        path.unlink(missing_ok=True)
                else:
                    self.results_file = path
                    return
            self.error = "lm-eval could not write the results file (its log above says why)"

    return ResultsTracker


def _install_results_tracker(made: list):
    """Make the `run` subcommand's EvaluationTracker the one of `_results_tracker_class`; returns the class it
    replaced (`main` puts it back when done)."""
    import lm_eval.loggers

    previous = lm_eval.loggers.EvaluationTracker
    lm_eval.loggers.EvaluationTracker = _results_tracker_class(made)
    return previous


def _install_task_path(local_only: bool):
    """Make every TaskManager that lm-eval's CLI builds (run, ls, validate) see evals/tasks beside any
    --include_path, and skip lm-eval's built-in tasks when the run names only ours. Returns the class it
    replaced (`main` puts it back when done)."""
    import lm_eval.tasks

    previous = lm_eval.tasks.TaskManager
    lm_eval.tasks.TaskManager = _task_manager_class(local_only)
    return previous


WRAPPER_HELP = f"""\
dcformer-eval: lm-eval's command line for DCFormer (modeling_dcformer.evals.harness; docs/evaluation.md).
Every lm-eval subcommand and option below works as in lm-eval (`lm-eval` in its examples reads `dcformer-eval`).
What the wrapper adds:
  --model dcformer    DCFormer / DCPythia checkpoints (this package's layout, a converted Pythia, the authors'
                      released layout) with this package's code, trust_remote_code off; --model hf works too
  *_local tasks       offline copies of lm-eval's tasks: {", ".join(DEFAULT_TASKS)}
                      (tag dcformer_local: the three), dcformer_gen_local; always on the include path
  --metadata data_dir=DIR
                      where the *_local tasks read their JSON-lines files (else $DCFORMER_EVAL_DATA, else the
                      small fixtures shipped in evals/fixtures)
  checks first        before the model loads: --tasks names, the data directory and files, whether each data set
                      is cached or the Hub reachable (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE respected), the model
                      directory or Hub id and its config and tokenizer files, --limit, --num_fewshot (and the
                      few-shot examples the *_local tasks have), --batch_size, --device, --output_path: each fault
                      is one line, exit 2 (so are an unknown --model_args key and a tokenizer that fails to load)
  --output_path DIR   results in DIR/<model>/results_<date>.json (<model>: a local model's folder name, or
                      namespace__name for a Hub id), printed last as `results: FILE`; a write that fails: exit 1.
                      `python -m modeling_dcformer.evals.report` turns results files into a markdown table and a
                      chart beside published numbers

lm-eval's own help follows.
"""


def _describe_wrapper(cli) -> None:
    """Put WRAPPER_HELP before lm-eval's descriptions (the top level and `run`) and name the program."""
    parser = cli._parser  # lm-eval 0.4.13's HarnessCLI keeps its parser and subparsers here
    parser.prog = "dcformer-eval"
    parser.description = f"{WRAPPER_HELP}\n{parser.description}"
    for name, sub in cli._subparsers.choices.items():
        sub.prog = f"dcformer-eval {name}"
        if sub.usage:
            sub.usage = sub.usage.replace("lm-eval ", "dcformer-eval ", 1)
        if name == "run":
            sub.description = f"{WRAPPER_HELP}\n{sub.description or ''}"


def _run_settings(args) -> dict:
    """The `run` settings as lm-eval's EvaluatorConfig.from_cli merges them: a --config YAML file, then every
    option given on the command line; `model_args` and `metadata` as dicts."""
    from lm_eval.config.evaluate_config import EvaluatorConfig
    from lm_eval.utils import simple_parse_args_string

    settings: dict = {}
    if getattr(args, "config", None):
        settings.update(EvaluatorConfig.load_yaml_config(args.config))
    settings.update({k: v for k, v in vars(args).items() if (v or v == 0) and k not in ("command", "func")})
    for key in ("model_args", "metadata"):
        if isinstance(settings.get(key), str):
            settings[key] = simple_parse_args_string(settings[key])
    return settings


def _is_hf_model(name: str | None) -> bool:
    """Whether the lm-eval model `name` is lm-eval's HFLM or a subclass (ours): `pretrained` is then a checkpoint."""
    from lm_eval.api.registry import get_model
    from lm_eval.models.huggingface import HFLM

    try:
        cls = get_model(name or "hf")
    except Exception:  # noqa: BLE001 -- an unknown or uninstallable model: lm-eval reports it
        return False
    return isinstance(cls, type) and issubclass(cls, HFLM)


def check_run(settings: dict) -> bool:
    """Every check of a `run` that can fail before the model loads; returns whether only our tasks run."""
    check_limit(settings.get("limit"))
    check_num_fewshot(settings.get("num_fewshot"))
    check_batch_size(settings.get("batch_size"))
    if settings.get("tasks") is None:
        raise ValueError(f"no --tasks given: name the tasks, e.g. --tasks {','.join(DEFAULT_TASKS)}")
    names = check_task_names(settings["tasks"])
    model_args = settings.get("model_args") or {}
    check_output_path(settings.get("output_path"))
    if _is_hf_model(settings.get("model")):
        check_device(settings.get("device") or model_args.get("device"))
        check_model_source(model_args.get("pretrained"), model_args.get("tokenizer"), model_args)
    metadata = {**model_args, **(settings.get("metadata") or {})}  # what lm-eval hands the tasks
    local_only = _only_local(names, settings.get("include_path"))
    task_manager = _task_manager_class(local_only)(include_path=settings.get("include_path"), metadata=metadata)
    check_tasks(names, task_manager, metadata, num_fewshot=settings.get("num_fewshot"))
    return local_only


def _run_fault(err: Exception, settings: dict) -> str | None:
    """The one line for a fault that only the run itself finds, when it is the user's: a --model_args key that
    neither lm-eval's model nor the model's config takes, a tokenizer that does not load, more few-shot examples
    than a task has. None: not one of those (the error goes up as it is)."""
    import re

    from modeling_dcformer.evals.dcformer_lm import TokenizerLoadError

    if isinstance(err, TokenizerLoadError):
        return str(err)
    model_args = settings.get("model_args") or {}
    if isinstance(err, TypeError):
        match = re.search(r"unexpected keyword argument '([^']+)'", str(err))
        if match and match.group(1) in model_args:
            key = match.group(1)
            return (
                f"--model_args {key}={model_args[key]}: neither an option of --model {settings.get('model') or 'hf'} "
                "nor a setting of the model's config (lm-eval hands unknown keys to from_pretrained): check the name"
            )
    num_fewshot = settings.get("num_fewshot")
    if num_fewshot and isinstance(err, (ValueError, AssertionError)) and (
        "Sample larger than population" in str(err) or "no documents available for sampling" in str(err)
    ):
        return f"--num_fewshot {num_fewshot}: a task has fewer few-shot examples than that: give a smaller number"
    return None


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def main(argv: Sequence[str] | None = None) -> int:
    """lm-eval's command line (`run`, `ls`, `validate`) with the `dcformer` model and evals/tasks.
    `argv` (without the program name) defaults to sys.argv[1:]. Returns 0; 2 for the user's fault (found before
    the model loads, or by the run: an unknown --model_args key, a tokenizer that does not load, too many few-shot
    examples); 1 for data that proved unreachable during the run, or results that could not be written (each fault
    printed as one line on stderr). A run that writes results prints `results: FILE` last."""
    import lm_eval.tasks
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    import lm_eval.loggers

    saved_argv = sys.argv
    if argv is not None:
        sys.argv = [sys.argv[0] if sys.argv else "dcformer-eval", *argv]
    previous = previous_tracker = None
    trackers: list = []
    try:
        setup_logging()
        parser = HarnessCLI()  # reads sys.argv; inserts `run` when no subcommand is given, as lm-eval does
        _describe_wrapper(parser)
        args = parser.parse_args()  # --help exits here, before torch and transformers are imported
        from modeling_dcformer.evals import dcformer_lm

        dcformer_lm.register()
        local_only, names, settings = False, [], {}
        if getattr(args, "command", None) == "run":
            try:
                settings = _run_settings(args)
                local_only = check_run(settings)
            except (ValueError, OSError) as err:
                print(f"error: {_one_line(err)}", file=sys.stderr)
                return 2
            names = _flatten_task_names(args.tasks)
        previous = _install_task_path(local_only)
        previous_tracker = _install_results_tracker(trackers)
        try:
            parser.execute(args)
        except ConnectionError as err:  # data the checks took for cached, or a network that went away mid-run
            message = str(err) if isinstance(err, DataUnreachableError) else data_unreachable_message(str(err), names)
            print(f"error: {_one_line(message)}", file=sys.stderr)
            return 1
        except (TypeError, ValueError, AssertionError, OSError) as err:
            message = _run_fault(err, settings)
            if message is None:
                raise
            print(f"error: {_one_line(message)}", file=sys.stderr)
            return 2
        for tracker in trackers:
            if tracker.error:
                print(f"error: --output_path {tracker.output_path}: {_one_line(tracker.error)}", file=sys.stderr)
                return 1
            if tracker.results_file is not None:
                print(f"results: {tracker.results_file}")
    finally:
        sys.argv = saved_argv
        if previous is not None:
            lm_eval.tasks.TaskManager = previous
        if previous_tracker is not None:
            lm_eval.loggers.EvaluationTracker = previous_tracker
    return 0


if __name__ == "__main__":
    sys.exit(main())
