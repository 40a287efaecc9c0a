"""examples/demo.py, the main job, end to end on its tiny default with the smallest settings (offline, CPU):
tiny Pythia -> verified conversion -> Trainer fine-tuning -> lm-eval on the offline tasks -> save -> native and
isolated trust_remote_code reload -> generation -> summary; the `--pythia DIR` path; the real-size flags' mapping
onto dcformer-train; and the output directory's safety rules. The steps are modeling_dcformer.demo.pipeline's."""

import json
import math
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
for _key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):  # before datasets / lm_eval load
    os.environ.setdefault(_key, "1")

pytest.importorskip("lm_eval")
from helpers import load_example  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase  # noqa: E402

from modeling_dcformer import DCFormerForCausalLM  # noqa: E402
from modeling_dcformer.demo import pipeline  # noqa: E402
from modeling_dcformer.training.tokenizer import read_lines  # noqa: E402

demo = load_example("demo")  # the script, in-process

TASKS = ["lambada_openai_local", "piqa_local", "hellaswag_local"]
REPO = "someone/dcpythia-demo-test"


@pytest.fixture(autouse=True)
def keep_threads():
    """The demo sets one torch thread for its tiny model: put the count back for the other test files."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_demo_end_to_end(tmp_path, capsys, monkeypatch):
    pushed = []  # --push-to-hub goes through model.push_to_hub / tokenizer.push_to_hub: recorded, not sent
    monkeypatch.setattr(DCFormerForCausalLM, "push_to_hub", lambda self, repo, **kw: pushed.append(("model", repo)))
    monkeypatch.setattr(
        PreTrainedTokenizerBase, "push_to_hub", lambda self, repo, **kw: pushed.append(("tokenizer", repo))
    )
    out = tmp_path / "demo"
    argv = ["--output-dir", str(out), "--train-steps", "6", "--limit", "3", "--no-bench", "--max-new-tokens", "8",
            "--push-to-hub", REPO]
    summary = demo.run(argv)
    printed = capsys.readouterr().out

    assert summary["ok"] is True
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(summary, default=str))
    assert not list(out.glob(".*partial*")), "no half-written directory is left behind"

    conversion = summary["conversion"]
    assert conversion["verified"] and 0 <= conversion["max_logit_difference"] <= 1e-4

    training = summary["training"]
    assert training["steps"] == 6 and training["seconds_per_step"] > 0
    for key in ("train_loss_first", "train_loss_last", "eval_loss_before", "eval_loss_after"):
        assert math.isfinite(training[key]), key
    assert training["eval_loss_after"] < training["eval_loss_before"]

    tasks = summary["evaluation"]["tasks"]
    assert list(tasks) == TASKS
    for task in TASKS:
        assert 0.0 <= tasks[task]["acc"] <= 1.0 and tasks[task]["samples"] == 3
    assert tasks["lambada_openai_local"]["perplexity"] > 1
    assert "acc_norm" in tasks["piqa_local"] and "acc_norm" in tasks["hellaswag_local"]
    assert (out / "eval_results.json").is_file()

    model_dir = Path(summary["save"]["dir"])
    assert model_dir == out / "dcpythia-tiny-finetuned" and (out / "dcpythia-tiny" / "config.json").is_file()
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(summary["save"]["files"])
    assert summary["save"]["model_card"]  # named after the Hub repo, with the lm-eval results
    card = (model_dir / "README.md").read_text()
    assert "partial" not in card and REPO in card and "piqa_local" in card
    native = summary["reload"]["native"]
    assert native["ok"] and native["max_abs_diff"] <= 1e-5
    remote = summary["reload"]["remote_code"]
    assert summary["save"]["auto_map"]  # save_pretrained writes remote code: the isolated reload must pass
    assert remote["status"] == "ok" and remote["ok"] and remote["class"].startswith("transformers_modules.")
    assert not remote["installed_package_loaded"]
    assert pushed == [("model", REPO), ("tokenizer", REPO)] and summary["pushed_to"].endswith(REPO)

    generation = summary["generation"]
    assert generation["cache_matches_no_cache"] is True
    assert generation["new_tokens"] > 0 and generation["greedy"].startswith(generation["prompt"])
    assert len(generation["sampled"]) == 2

    for needle in ("== summary ==", "| conversion", "verified", "| fine-tuning", "6 steps", "| validation loss",
                   "| eval lambada_openai_local", "| eval piqa_local", "| eval hellaswag_local", "| reload, native",
                   "| generated (greedy)", "| wall time"):
        assert needle in printed, needle

    # What was saved loads natively with the tokenizer beside it and gives the same greedy text.
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(generation["prompt"], return_tensors="pt")
    with torch.inference_mode():
        greedy = model.generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert tokenizer.decode(greedy[0], skip_special_tokens=True) == generation["greedy"]


def test_demo_with_a_given_pythia_directory(tmp_path, capsys):
    """`--pythia DIR` (the real-size path, here on a local GPT-NeoX): no model is built, the converter reads
    DIR, the fine-tuning uses the non-tiny learning rate (5e-5). With `--train-args=--bf16` (mixed precision:
    accelerate wraps the model's forward in autocast) the model checked against its reloaded copy is the unwrapped
    fp32 one, so the reload checks still pass exactly. Blocks of 64 tokens: at train_clm's default (up to 1024,
    test_real_size_flags_reach_train_clm) "auto" trains through "compiled", and tracing it took a minute here."""
    src = tmp_path / "neox"
    pipeline.build_tiny_pythia(src, read_lines([demo.TRAIN_TXT]), seed=1)
    out = tmp_path / "demo"
    summary = demo.run(["--pythia", str(src), "--output-dir", str(out), "--train-steps", "2", "--limit", "2",
                        "--tasks", "piqa_local", "--no-bench", "--threads", "1", "--max-new-tokens", "4",
                        "--block-size", "64", "--train-args=--bf16"])
    capsys.readouterr()
    assert summary["ok"] and summary["source"]["source"] == str(src)
    assert not (out / "pythia-tiny").exists()
    converted = Path(summary["conversion"]["dir"])
    assert converted == out / "dc-neox" and Path(summary["save"]["dir"]) == out / "dc-neox-finetuned"
    provenance = json.loads((converted / "config.json").read_text())
    assert provenance["converted_from_folder"] == src.name and provenance.get("converted_from") is None
    assert list(summary["evaluation"]["tasks"]) == ["piqa_local"]
    assert summary["reload"]["native"]["ok"] and summary["reload"]["native"]["max_abs_diff"] == 0.0
    assert summary["training"]["steps"] == 2


def test_real_size_flags_reach_train_clm():
    args = demo.parse_args([
        "--pythia", "EleutherAI/pythia-160m", "--dataset", "wikitext", "--dataset-config", "wikitext-2-raw-v1",
        "--device", "cuda", "--train-steps", "1000", "--block-size", "1024", "--batch-size", "4",
        "--train-args", "--bf16 --activation_checkpointing",
    ])
    argv = demo.finetune_argv(args, Path("/m"), Path("/o"), tiny=False)
    pairs = dict(zip(argv, argv[1:]))
    assert pairs["--model_name_or_path"] == "/m" and pairs["--output_dir"] == "/o"
    assert pairs["--dataset_name"] == "wikitext" and pairs["--dataset_config_name"] == "wikitext-2-raw-v1"
    assert "--train_file" not in argv and "--use_cpu" not in argv
    assert pairs["--max_steps"] == "1000" and pairs["--block_size"] == "1024"
    assert pairs["--per_device_train_batch_size"] == "4" and float(pairs["--learning_rate"]) == 5e-5
    assert argv[-2:] == ["--bf16", "--activation_checkpointing"]
    real = demo.finetune_argv(demo.parse_args(["--pythia", "EleutherAI/pythia-160m"]), Path("/m"), Path("/o"), False)
    assert "--block_size" not in real  # train_clm's default block size (up to 1024)

    tiny = demo.parse_args(["--device", "cpu"])
    argv = demo.finetune_argv(tiny, Path("/m"), Path("/o"), tiny=True)
    pairs = dict(zip(argv, argv[1:]))
    assert pairs["--train_file"] == str(demo.TRAIN_TXT) and pairs["--validation_file"] == str(demo.VALID_TXT)
    assert "--use_cpu" in argv and pairs["--block_size"] == "64" and float(pairs["--learning_rate"]) == 3e-3


def test_output_dir_rules(tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit, match="not made by this demo"):
        demo.prepare_output_dir(foreign)
    assert (foreign / "keep.txt").read_text() == "mine"

    ours = tmp_path / "ours"
    demo.prepare_output_dir(ours)
    (ours / "summary.json").write_text("{}")  # a previous run's output is replaced, marker and all
    demo.prepare_output_dir(ours)
    assert sorted(p.name for p in ours.iterdir()) == [demo.MARKER]


def test_unreachable_task_data_is_one_line(monkeypatch, capsys):
    """A real task's data set out of reach (offline) ends the demo with the harness's one line and exit 2, not a
    traceback; any other error still propagates."""
    from modeling_dcformer.evals.harness import DataUnreachableError

    def offline(argv, t_start):
        raise DataUnreachableError("the data of piqa is on the Hub, which cannot be reached: use piqa_local")

    monkeypatch.setattr(demo, "run", offline)
    assert demo.main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: the data of piqa is on the Hub, which cannot be reached: use piqa_local"]

    def broken(argv, t_start):
        raise RuntimeError("something else")

    monkeypatch.setattr(demo, "run", broken)
    with pytest.raises(RuntimeError, match="something else"):
        demo.main([])


@pytest.mark.parametrize("case", ["file", "under-a-file"])
def test_an_output_dir_that_cannot_be_a_directory_is_one_line(case, tmp_path, monkeypatch):
    """--output-dir naming a file, or a path through one: one line naming it, before any work; the file is kept."""
    blocker = tmp_path / "notes.txt"
    blocker.write_text("mine\n")
    out = blocker if case == "file" else blocker / "demo"
    monkeypatch.setattr(demo, "build_tiny_pythia", lambda *a, **k: pytest.fail("the demo went on"))
    with pytest.raises(SystemExit) as exit_:
        demo.run(["--output-dir", str(out), "--no-bench"])
    message = str(exit_.value.code)
    assert message.startswith("error: --output-dir") and str(out) in message and "\n" not in message
    assert ("is a file" if case == "file" else "cannot be made") in message
    assert blocker.read_text() == "mine\n"
