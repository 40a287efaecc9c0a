"""dcformer-eval under faults, its help, and the evals/ scripts run as files (issues 27 item 7, 28 items 7 and 10,
30 items 6 and 13).

Every fault is refused in one line naming the task, path or option, before the model loads; each refusal has its
legitimate neighbour accepted. The Hub is never contacted: HF_HUB_OFFLINE is set for the whole module, and the
case "offline flag not set, but no network" replaces the Hub client's HTTP session with one whose every request
fails to connect. The `datasets` and Hub caches point at empty temporary folders, so that a developer's own cache
cannot change the outcome.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
