"""dcformer-eval under faults, its help, the evals/ scripts run as files, and where a run's results land.

Every fault is refused in one line naming the task, path or option, before the model loads; each refusal has its
legitimate neighbour accepted. The Hub is never contacted: HF_HUB_OFFLINE is set for the whole module, and the
case "offline flag not set, but no network" replaces the Hub client's HTTP session with one whose every request
fails to connect. The `datasets` and Hub caches point at empty temporary folders, so that a developer's own cache
cannot change the outcome.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

for _key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):  # before datasets / lm_eval load
    os.environ.setdefault(_key, "1")

pytest.importorskip("lm_eval")
import datasets.config  # noqa: E402
import huggingface_hub.constants  # noqa: E402
import huggingface_hub.utils  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from helpers import build_model, help_options, in_process_help_options, make_config, save_tiny_neox  # noqa: E402
from modeling_dcformer.evals import harness  # noqa: E402
from modeling_dcformer.evals.dcformer_lm import DCFormerLM  # noqa: E402
from modeling_dcformer.evals.tasks import local_data  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "evals" / "fixtures"
REAL_TASKS = "lambada_openai,piqa,hellaswag"


@pytest.fixture(autouse=True)
def offline_and_empty_caches(monkeypatch, tmp_path):
    """Offline (as huggingface_hub and datasets read it at import), empty Hub and datasets caches, no data
    directory from the environment, lm-eval's own logging at ERROR, one torch thread."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")
    monkeypatch.delenv(local_data.ENV_VAR, raising=False)
    # lm-eval's progress logs (INFO) go to the stderr of the first test that configured them; errors only here
    monkeypatch.setenv("LMEVAL_LOG_LEVEL", "ERROR")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def no_network(monkeypatch):
    """The offline flags unset, and every request of the Hub client fails to connect (a machine without
    network, as the client sees it)."""
    from huggingface_hub.utils import httpx

    class Unreachable:
        def request(self, method, url, *args, **kwargs):
            raise httpx.ConnectError("[Errno -2] Name or service not known")

        def head(self, url, *args, **kwargs):
            return self.request("HEAD", url)

        def get(self, url, *args, **kwargs):
            return self.request("GET", url)

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.utils, "get_session", lambda: Unreachable())


def model_must_not_load(monkeypatch):
    """A check that must come before the model loads: loading it fails the test."""
    def refuse(self, *args, **kwargs):
        raise AssertionError("the model was loaded before the fault was reported")

    monkeypatch.setattr(DCFormerLM, "__init__", refuse)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A saved tiny DCFormer with a tokenizer trained on the fixtures' text."""
    texts = [value for path in sorted(FIXTURES.glob("*.jsonl")) for row in local_data.read_jsonl(path)
             for value in row.values() if isinstance(value, str)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    ))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    path = tmp_path_factory.mktemp("dcformer")
    config = make_config(vocab_size=len(tokenizer), num_hidden_layers=2, max_position_embeddings=512)
    build_model(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def run_cli(capsys, *argv) -> tuple[int, str]:
    code = harness.main(["run", *argv, "--device", "cpu"])
    return code, capsys.readouterr().err


def assert_one_line(err: str, *needles: str) -> None:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


# ----------------------------------------------------------------------------------------------------------------
# The help says first what the wrapper adds, then lm-eval's options
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"]])
def test_help_says_what_the_wrapper_adds_then_lm_evals_options(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        harness.main(argv)
    assert exit_info.value.code in (0, None)
    out = capsys.readouterr().out
    assert out.startswith("usage: dcformer-eval")
    ours = out.index("What the wrapper adds")
    for added in ("--model dcformer", "lambada_openai_local, piqa_local, hellaswag_local", "dcformer_local",
                  "--metadata data_dir=DIR", "DCFORMER_EVAL_DATA", "--output_path", "evals.report",
                  "HF_HUB_OFFLINE", "--num_fewshot"):
        assert added in out[ours:out.index("lm-eval's own help follows")], added
    lm_eval_part = out[out.index("lm-eval's own help follows"):]
    if argv == ["--help"]:
        assert "Language Model Evaluation Harness" in lm_eval_part and "validate" in lm_eval_part
    else:  # lm-eval's options, all of them, after ours
        for option in ("--tasks", "--model_args", "--num_fewshot", "--limit", "--include_path", "--metadata",
                       "--output_path", "--log_samples", "--seed"):
            assert option in lm_eval_part, option


# ----------------------------------------------------------------------------------------------------------------
# Scripts in evals/ run as files, from any directory, as well as through their console script
# ----------------------------------------------------------------------------------------------------------------
def test_evals_scripts_run_as_files_and_as_console_scripts(tmp_path, capsys):
    """`python evals/X.py` from another directory with the installed package only; its help has the options of the
    console script's program (`dcformer-eval`'s `--help` itself is checked on the installed wheel: `make
    check-wheel`, test_wheel.py::test_console_script_help)."""
    env = {**os.environ, "PYTHONPATH": "", "HF_HUB_OFFLINE": "1"}
    outputs = {}
    for name in ("harness", "report"):
        command = [sys.executable, str(ROOT / "evals" / f"{name}.py"), "--help"]
        proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        outputs[name] = proc.stdout
    options = help_options(outputs["harness"])
    assert options == in_process_help_options(harness.main, capsys) and "--tasks" in options
    assert "What the wrapper adds" in outputs["harness"]
    assert "--published" in outputs["report"]
    for source in (ROOT / "evals").rglob("*.py"):  # absolute imports of the installed package, no sys.path edits
        text = source.read_text()
        assert "from . " not in text and "from .. " not in text and "sys.path" not in text, source


# ----------------------------------------------------------------------------------------------------------------
# Tasks, few-shot count, data directory, model, tokenizer
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "tasks, needles",
    [
        ("piqa_local,,,", ["'piqa_local,,,'", "empty task name"]),
        ("", ["--tasks ''", "names no task"]),
        (",", ["--tasks ','", "empty task name"]),
    ],
)
def test_empty_task_names_are_one_line(tasks, needles, model_dir, capsys, monkeypatch):
    model_must_not_load(monkeypatch)
    code, err = run_cli(capsys, "--model", "dcformer", "--model_args", f"pretrained={model_dir}", "--tasks", tasks)
    assert code == 2
    assert_one_line(err, *needles)
    with pytest.raises(ValueError, match="task"):
        harness.evaluate(str(model_dir), tasks=tasks)


def test_unknown_task_is_one_line_naming_it(model_dir, capsys, monkeypatch):
    """Needs lm-eval's task index (it alone knows whether a name exists): built once a process."""
    model_must_not_load(monkeypatch)
    code, err = run_cli(capsys, "--model", "dcformer", "--model_args", f"pretrained={model_dir}",
                        "--tasks", "piqa_local,no_such_task")
    assert code == 2
    assert_one_line(err, "'no_such_task'", "no task, group or tag", "ls tasks", "piqa_local")
    code, err = run_cli(capsys, "--model", "dcformer", "--model_args", f"pretrained={model_dir}",
                        "--tasks", "piqa_locl")
    assert code == 2
    assert_one_line(err, "'piqa_locl'", "close: piqa_local")


@pytest.mark.parametrize("count", ["-1", "-5"])
def test_negative_num_fewshot_is_one_line(count, model_dir, capsys, monkeypatch):
    model_must_not_load(monkeypatch)
    code, err = run_cli(capsys, "--model", "dcformer", "--model_args", f"pretrained={model_dir}",
                        "--tasks", "piqa_local", "--num_fewshot", count)
    assert code == 2
    assert_one_line(err, f"--num_fewshot {count}", ">= 0")
    with pytest.raises(ValueError, match=f"--num_fewshot {count}"):
        harness.evaluate(str(model_dir), tasks=["piqa_local"], num_fewshot=int(count))


def test_missing_data_directory_or_file_is_one_line(model_dir, tmp_path, capsys, monkeypatch):
    model_must_not_load(monkeypatch)
    common = ["--model", "dcformer", "--model_args", f"pretrained={model_dir}", "--tasks", "piqa_local"]
    absent = tmp_path / "no-such-data"
    code, err = run_cli(capsys, *common, "--metadata", f"data_dir={absent}")
    assert code == 2
    assert_one_line(err, f"data_dir={absent}", "no such directory")
    with pytest.raises(FileNotFoundError, match="no such directory"):
        harness.evaluate(str(model_dir), tasks=["piqa_local"], data_dir=absent)

    monkeypatch.setenv(local_data.ENV_VAR, str(absent))
    code, err = run_cli(capsys, *common)
    assert code == 2
    assert_one_line(err, f"${local_data.ENV_VAR}={absent}", "no such directory")
    monkeypatch.delenv(local_data.ENV_VAR)

    empty = tmp_path / "empty-data"
    empty.mkdir()
    code, err = run_cli(capsys, *common, "--metadata", f"data_dir={empty}")
    assert code == 2
    assert_one_line(err, str(empty), "piqa.jsonl")


def test_the_legitimate_neighbours_run(model_dir, tmp_path, capsys):
    """piqa_local alone, a model directory with its tokenizer, an existing data directory, --num_fewshot 0."""
    data = tmp_path / "data"
    data.mkdir()
    rows = local_data.read_jsonl(FIXTURES / "piqa.jsonl")[:3]
    (data / "piqa.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "results"
    code, err = run_cli(capsys, "--model", "dcformer", "--model_args", f"pretrained={model_dir}", "--tasks",
                        "piqa_local", "--num_fewshot", "0", "--metadata", f"data_dir={data}", "--output_path", str(out))
    assert code == 0, err[-3000:]
    (results_file,) = out.rglob("results*.json")
    results = json.loads(results_file.read_text())
    assert results["n-samples"]["piqa_local"]["effective"] == 3
    assert results["n-shot"]["piqa_local"] == 0


@pytest.mark.parametrize("offline", [True, False], ids=["HF_HUB_OFFLINE", "no-network"])
def test_model_not_found_is_one_line(offline, model_dir, tmp_path, capsys, monkeypatch):
    if not offline:
        no_network(monkeypatch)
    model_must_not_load(monkeypatch)
    code, err = run_cli(capsys, "--model", "dcformer", "--model_args", "pretrained=nope", "--tasks", "piqa_local")
    assert code == 2
    assert_one_line(err, "model 'nope'", "no such directory", "HF_HUB_OFFLINE" if offline else "unreachable")
    with pytest.raises(ConnectionError, match="'nope'"):
        harness.evaluate("nope", tasks=["piqa_local"])
    # the neighbours: a Hub id in the Hub cache, or one the Hub can be asked for
    snapshot = Path(huggingface_hub.constants.HF_HUB_CACHE) / "models--org--cached" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    harness.check_model_source("org/cached", tokenizer=str(model_dir))
    if not offline:
        class Up:  # the Hub answers
            def head(self, url, *args, **kwargs):
                return 200

        monkeypatch.setattr(huggingface_hub.utils, "get_session", lambda: Up())
        harness.check_model_source("org/on-the-hub")


def test_model_directory_without_tokenizer_is_one_line(model_dir, tmp_path, capsys, monkeypatch):
    """A DCFormer directory and a GPT-NeoX directory without tokenizer files (transformers builds an empty
    GPT-NeoX tokenizer from the latter: every text encodes to nothing); with tokenizer=... they are accepted."""
    neox = tmp_path / "neox"
    save_tiny_neox(neox)
    bare = tmp_path / "bare-dcformer"
    bare.mkdir()
    for file in ("config.json", "model.safetensors"):
        (bare / file).write_bytes((model_dir / file).read_bytes())
    capsys.readouterr()  # the saves' progress bars
    with monkeypatch.context() as patch:
        model_must_not_load(patch)
        for model, path in (("dcformer", bare), ("hf", neox)):
            code, err = run_cli(capsys, "--model", model, "--model_args", f"pretrained={path}", "--tasks", "piqa_local")
            assert code == 2
            assert_one_line(err, repr(str(path)), "holds no tokenizer", "tokenizer=")
    with pytest.raises(FileNotFoundError, match="holds no tokenizer"):
        harness.evaluate(str(neox), tasks=["piqa_local"], lm_class="hf")
    harness.check_model_source(str(bare), tokenizer=str(model_dir))  # the neighbour: a tokenizer named
    with pytest.raises(FileNotFoundError, match="tokenizer 'no/such/dir'"):
        harness.check_model_source(str(bare), tokenizer="no/such/dir")
    # lm-eval's model class used directly (no harness checks): the empty tokenizer is refused too
    with pytest.raises(OSError, match="encodes no text"):
        DCFormerLM(pretrained=str(neox), device="cpu")


# ----------------------------------------------------------------------------------------------------------------
# The real task names without network: one line, at once, naming the offline route
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("offline", [True, False], ids=["HF_HUB_OFFLINE", "no-network"])
def test_real_tasks_without_network_are_one_line_before_the_model_loads(offline, model_dir, capsys, monkeypatch):
    if not offline:
        no_network(monkeypatch)
    model_must_not_load(monkeypatch)
    code, err = run_cli(capsys, "--model", "dcformer", "--model_args", f"pretrained={model_dir}", "--tasks", REAL_TASKS)
    assert code == 2
    assert_one_line(err, "lambada_openai", "EleutherAI/lambada_openai", "baber/piqa", "not in the datasets cache",
                    "HF_HUB_OFFLINE" if offline else "unreachable",
                    "--tasks lambada_openai_local,piqa_local,hellaswag_local", "--metadata data_dir=DIR")
    with pytest.raises(harness.DataUnreachableError, match="piqa_local"):
        harness.evaluate(str(model_dir), tasks=["piqa"])


def test_real_tasks_with_cached_data_pass_the_check(tmp_path):
    """The neighbour: data sets in the datasets cache (where `datasets` looks offline) are not refused."""
    cache = Path(datasets.config.HF_DATASETS_CACHE)
    for folder in ("EleutherAI___lambada_openai", "baber___piqa", "Rowan___hellaswag"):
        (cache / folder / "default" / "0.0.0" / "0123abcd").mkdir(parents=True)
    names = REAL_TASKS.split(",")
    manager = harness.make_task_manager(names)
    harness.check_tasks(names, manager)
    with pytest.raises(harness.DataUnreachableError, match="arc_easy"):
        harness.check_tasks(["arc_easy"], manager)


def test_connection_lost_during_the_run_is_one_line(model_dir, capsys, monkeypatch):
    """What the checks cannot foresee (a cache that fails to load, the network gone mid-run): datasets'
    ConnectionError becomes one line (exit 1), and DataUnreachableError from the Python entry point."""
    import lm_eval

    def connection_lost(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'baber/piqa' on the Hub (ConnectError)")

    monkeypatch.setattr(lm_eval, "simple_evaluate", connection_lost)
    code, err = run_cli(capsys, "--model", "dcformer", "--model_args", f"pretrained={model_dir}",
                        "--tasks", "piqa_local")
    assert code == 1
    assert_one_line(err, "Couldn't reach 'baber/piqa'", "piqa_local", "data_dir")
    with pytest.raises(harness.DataUnreachableError, match="baber/piqa"):
        harness.evaluate(str(model_dir), tasks=["piqa_local"], device="cpu")


# ----------------------------------------------------------------------------------------------------------------
# Batch size, device, few-shot count beyond the examples, model arguments, corrupt files, the output path
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("size", ["abc", "0", "-1", "auto:", "auto:0", "2.5"])
def test_bad_batch_size_is_one_line(size, model_dir, capsys, monkeypatch):
    model_must_not_load(monkeypatch)
    code, err = run_cli(capsys, "--model", "dcformer", "--model_args", f"pretrained={model_dir}", "--tasks",
                        "piqa_local", "--batch_size", size)
    assert code == 2
    assert_one_line(err, f"--batch_size {size}:", "'auto'")
    with pytest.raises(ValueError, match="--batch_size"):
        harness.evaluate(str(model_dir), tasks=["piqa_local"], batch_size=size)
    for good in (1, "8", "auto", "auto:4", None):  # the neighbours lm-eval takes
        harness.check_batch_size(good)


def fake_gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_a_gpu_is_one_line(device, model_dir, capsys, monkeypatch):
    fake_gpus(monkeypatch, 0)
    model_must_not_load(monkeypatch)
    code = harness.main(["run", "--model", "dcformer", "--model_args", f"pretrained={model_dir}", "--tasks",
                         "piqa_local", "--device", device])
    assert code == 2
    assert_one_line(capsys.readouterr().err, f"--device {device}:", "--device cpu")
    with pytest.raises(ValueError, match=f"--device {device}"):
        harness.evaluate(str(model_dir), tasks=["piqa_local"], device=device)


def test_device_names_a_device_of_this_machine(monkeypatch):
    """One GPU (simulated): cuda, cuda:0 and cpu are taken; cuda:1 (which lm-eval would silently replace by
    another device) and a misspelt name are refused, each naming the devices there are."""
    fake_gpus(monkeypatch, 1)
    for good in ("cpu", "cuda", "cuda:0", None):
        harness.check_device(good)
    for bad in ("cuda:1", "cdua", "gpu"):
        with pytest.raises(ValueError, match=f"--device {bad}: not a device of this machine; give one of cpu, cuda:0"):
            harness.check_device(bad)


def test_num_fewshot_beyond_the_examples_is_one_line(model_dir, tmp_path, capsys, monkeypatch):
    model_must_not_load(monkeypatch)
    common = ["--model", "dcformer", "--model_args", f"pretrained={model_dir}"]
    train_rows = len(local_data.read_jsonl(FIXTURES / "piqa.train.jsonl"))
    code, err = run_cli(capsys, *common, "--tasks", "piqa_local", "--num_fewshot", "5000")
    assert code == 2
    assert_one_line(err, "--num_fewshot 5000:", f"piqa_local has {train_rows} few-shot examples", "piqa.train.jsonl",
                    f"at most {train_rows}")
    rows = len(local_data.read_jsonl(FIXTURES / "lambada_openai.jsonl"))  # no training split: its own rows
    code, err = run_cli(capsys, *common, "--tasks", "dcformer_local", "--num_fewshot", str(rows + 1))
    assert code == 2
    assert_one_line(err, f"--num_fewshot {rows + 1}:", "_local has")
    with pytest.raises(ValueError, match="--num_fewshot 5000"):
        harness.evaluate(str(model_dir), tasks=["hellaswag_local"], num_fewshot=5000)
    # a data directory without the few-shot file: zero-shot only
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(FIXTURES / "piqa.jsonl", data)
    code, err = run_cli(capsys, *common, "--tasks", "piqa_local", "--num_fewshot", "1", "--metadata",
                        f"data_dir={data}")
    assert code == 2
    assert_one_line(err, "--num_fewshot 1:", str(data / "piqa.train.jsonl"), "does not exist", "--num_fewshot 0")
    # the neighbours: as many examples as there are, and zero-shot without the file
    names = ["piqa_local", "lambada_openai_local"]
    manager = harness.make_task_manager(names)
    harness.check_tasks(names, manager, num_fewshot=train_rows)
    harness.check_tasks(["piqa_local"], manager, {"data_dir": str(data)}, num_fewshot=0)


def test_few_shot_shortfall_found_by_the_run_is_one_line(model_dir, capsys, monkeypatch):
    """A task whose few-shot pool the checks cannot count (lm-eval's own, on the Hub) fails inside lm-eval's
    sampler: one line naming --num_fewshot, exit 2."""
    import lm_eval

    def short_pool(*args, **kwargs):
        raise ValueError("Sample larger than population or is negative")

    monkeypatch.setattr(lm_eval, "simple_evaluate", short_pool)
    code, err = run_cli(capsys, "--model", "dcformer", "--model_args", f"pretrained={model_dir}", "--tasks",
                        "piqa_local", "--num_fewshot", "3")
    assert code == 2
    assert_one_line(err, "--num_fewshot 3:", "fewer few-shot examples")
    with pytest.raises(ValueError, match="Sample larger"):  # --num_fewshot not given: not taken for its fault
        harness.main(["run", "--model", "dcformer", "--model_args", f"pretrained={model_dir}", "--tasks",
                      "piqa_local", "--device", "cpu"])


def test_unknown_model_args_key_is_one_line(model_dir, capsys):
    code, err = run_cli(capsys, "--model", "dcformer", "--model_args", f"pretrained={model_dir},bogus_key=3",
                        "--tasks", "piqa_local", "--limit", "2")
    assert code == 2
    assert_one_line(err, "--model_args bogus_key=3:", "--model dcformer", "check the name")
    # the neighbours: a setting of the model's config and an option of lm-eval's model class
    code, err = run_cli(capsys, "--model", "dcformer", "--model_args",
                        f"pretrained={model_dir},attention_chunk_size=64,dtype=float32", "--tasks", "piqa_local",
                        "--limit", "2")
    assert code == 0, err[-3000:]


@pytest.mark.parametrize("file, content", [
    ("tokenizer.json", '{"not": '), ("tokenizer_config.json", "{"), ("config.json", "not json"),
])
def test_corrupt_model_or_tokenizer_file_is_one_line(file, content, model_dir, tmp_path, capsys, monkeypatch):
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    (broken / file).write_text(content)
    with monkeypatch.context() as patch:
        model_must_not_load(patch)
        code, err = run_cli(capsys, "--model", "dcformer", "--model_args", f"pretrained={broken}", "--tasks",
                            "piqa_local")
    assert code == 2
    assert_one_line(err, str(broken / file), "cannot be read")
    with pytest.raises(ValueError, match="cannot be read"):
        harness.evaluate(str(broken), tasks=["piqa_local"])
    if file != "config.json":  # the neighbour: a tokenizer named elsewhere, the model directory's is not used
        harness.check_model_source(str(broken), tokenizer=str(model_dir))


def test_tokenizer_that_fails_to_load_during_the_run_is_one_line(model_dir, tmp_path, capsys, monkeypatch):
    """What the file checks cannot see (a tokenizer from the Hub cache, a file that parses but does not load)
    ends in the same kind of line, exit 2, no traceback."""
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    (broken / "tokenizer.json").write_text('{"not": ')
    monkeypatch.setattr(harness, "_check_readable", lambda *args, **kwargs: None)
    code, err = run_cli(capsys, "--model", "dcformer", "--model_args", f"pretrained={broken}", "--tasks",
                        "piqa_local")
    assert code == 2
    assert_one_line(err, "could not load a tokenizer from", str(broken), "tokenizer=")


def test_output_path_that_cannot_be_written_is_one_line_before_the_model_loads(model_dir, tmp_path, capsys,
                                                                                monkeypatch):
    model_must_not_load(monkeypatch)
    common = ["--model", "dcformer", "--model_args", f"pretrained={model_dir}", "--tasks", "piqa_local"]
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for output in (a_file / "results", a_file, a_file / "sub" / "run.json"):
        code, err = run_cli(capsys, *common, "--output_path", str(output))
        assert code == 2
        assert_one_line(err, f"--output_path {output}:", f"{a_file} is a file")
    with pytest.raises(NotADirectoryError, match="is a file"):
        harness.evaluate(str(model_dir), tasks=["piqa_local"], output_path=a_file / "results")

    def denied(*args, **kwargs):  # a folder another user owns (the real case: test_output_path_of_another_user)
        raise PermissionError(errno.EACCES, "Permission denied")

    with monkeypatch.context() as patch:
        patch.setattr(tempfile, "mkdtemp", denied)
        code, err = run_cli(capsys, *common, "--output_path", str(tmp_path / "new" / "run"))
    assert code == 2
    assert_one_line(err, f"cannot write in {tmp_path}", "Permission denied")
    # the neighbours: a new folder under a writable one, an existing folder, a .json file name; nothing is left
    before = sorted(tmp_path.iterdir())
    for good in (tmp_path / "new" / "run", tmp_path, tmp_path / "out.json", "."):
        harness.check_output_path(good)
    assert sorted(tmp_path.iterdir()) == before


def test_output_path_of_another_user_is_refused(tmp_path):
    """A real second user (nobody), where this runs as root: a folder root owns (0755) is not theirs to write.
    The check is plain Python: it runs on the system interpreter from the source file, as that user."""
    python = shutil.which("python3.11", path="/usr/bin") or shutil.which("python3", path="/usr/bin")
    if os.geteuid() != 0 or not shutil.which("setpriv") or not python:
        pytest.skip("needs root, setpriv and a system python to run as a second user")
    theirs = Path(tempfile.mkdtemp(prefix="eval-out-", dir="/tmp"))
    try:
        theirs.chmod(0o755)
        script = (
            "import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('h', {str(ROOT / 'evals' / 'harness.py')!r})\n"
            "h = importlib.util.module_from_spec(spec); spec.loader.exec_module(h)\n"
            "try:\n    h.check_output_path(sys.argv[1])\nexcept OSError as err:\n    print(err); sys.exit(2)\n"
        )
        command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-c", script]
        proc = subprocess.run([*command, str(theirs / "run")], capture_output=True, text=True, timeout=60)
        if "Permission denied" in proc.stderr and "harness.py" in proc.stderr:
            pytest.skip("the second user cannot read the source tree")
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert f"cannot write in {theirs}" in proc.stdout and "Permission denied" in proc.stdout
        theirs.chmod(0o1777)  # the neighbour: a shared sticky folder anyone may create entries in
        proc = subprocess.run([*command, str(theirs / "run")], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
        assert list(theirs.iterdir()) == []
    finally:
        shutil.rmtree(theirs)


# ----------------------------------------------------------------------------------------------------------------
# Where the results land: --output_path DIR -> DIR/<model folder>/results_<date>.json, never a hidden folder
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["relative", "absolute", "dot"])
def test_results_land_in_a_folder_named_after_the_model(form, model_dir, tmp_path, capsys, monkeypatch):
    work = tmp_path / "work"
    (work / "ckpts").mkdir(parents=True)
    model = work / "ckpts" / "my-dcformer"
    shutil.copytree(model_dir, model)
    monkeypatch.chdir(model if form == "dot" else work)
    pretrained = {"relative": "./ckpts/my-dcformer", "absolute": str(model), "dot": "."}[form]
    out = tmp_path / "results" / "run-1"
    code = harness.main(["run", "--model", "dcformer", "--model_args", f"pretrained={pretrained}", "--tasks",
                         "piqa_local", "--limit", "2", "--device", "cpu", "--output_path", str(out),
                         "--log_samples"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    assert [p.name for p in out.iterdir()] == ["my-dcformer"]
    (results_file,) = (out / "my-dcformer").glob("results_*.json")
    assert captured.out.strip().splitlines()[-1] == f"results: {results_file}"
    results = json.loads(results_file.read_text())
    assert results["results"]["piqa_local"]["acc,none"] is not None
    assert results["model_name"] == pretrained and results["model_name_sanitized"] == "my-dcformer"
    assert list((out / "my-dcformer").glob("samples_piqa_local_*.jsonl"))
    assert not [p for p in (tmp_path / "results").rglob(".*")]  # nothing hidden, no leftovers


def test_results_folder_names():
    assert harness.results_folder_name("Caiyun-AI/DCPythia-6.9B") == "Caiyun-AI__DCPythia-6.9B"  # as lm-eval
    assert harness.results_folder_name("/data/ckpts/my-dcformer/") == "my-dcformer"
    assert harness.results_folder_name("./.hidden-run") == "hidden-run"
    assert harness.results_folder_name("~") == Path.home().name


def test_results_that_cannot_be_written_after_the_run_are_one_line(model_dir, tmp_path, capsys, monkeypatch):
    """A full disk when the results are written: exit 1, one line naming the file, and no file left behind
    (lm-eval logs the failure and exits 0)."""
    from modeling_dcformer.checkpoints import atomic_dir

    def disk_full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic_dir, "write_file", disk_full)
    out = tmp_path / "results"
    code, err = run_cli(capsys, "--model", "dcformer", "--model_args", f"pretrained={model_dir}", "--tasks",
                        "piqa_local", "--limit", "2", "--output_path", str(out))
    assert code == 1
    lines = [line for line in err.strip().splitlines() if line.strip()]  # after the run's progress bars
    assert "Traceback" not in err and [line for line in lines if "error" in line.lower()] == lines[-1:], err[-3000:]
    assert_one_line(lines[-1], f"--output_path {out}:", "could not write", "No space left on device")
    assert not [p for p in out.rglob("*") if p.is_file()]
