"""dcformer-train (modeling_dcformer.training.train_clm) under bad input and faults: every failure is one line naming
the flag, file or value (exit code 2 through the console script's `cli`), no checkpoint of non-finite weights is
written, a checkpoint that cannot be resumed from (NaN weights, truncated weights or optimizer) is set aside with a
warning and the previous one used, a full disk leaves no half-written checkpoint, and DDP is told that no parameter
is unused (true for every weight)."""

import errno
import json
import logging
import os
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from modeling_dcformer import DCFormerConfig, DCFormerForCausalLM
from modeling_dcformer.training import train_clm

from helpers import train_argv as shared_train_argv

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

ROOT = Path(__file__).resolve().parent.parent
HARBOUR = ROOT / "examples" / "data" / "harbour_train.txt"
HARBOUR_VALID = ROOT / "examples" / "data" / "harbour_validation.txt"


def train_argv(out, train_file=HARBOUR, *extra):
    return shared_train_argv(out, train_file, *extra)


def one_line_error(argv, capsys) -> str:
    """Runs the console script's entry point; asserts exit code 2 and a single `error: ...` line; returns it."""
    code = train_clm.cli(argv)
    err = capsys.readouterr().err.strip()
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(lines) == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    return lines[0]


# ----------------------------------------------------------------------------------------------------------------
# Item 6 and 10: one line naming the thing
# ----------------------------------------------------------------------------------------------------------------
def test_max_steps_zero_is_one_line(tmp_path, capsys):
    line = one_line_error(train_argv(tmp_path / "run", HARBOUR, "--max_steps", "0"), capsys)
    assert "--max_steps 0" in line
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.mark.parametrize(
    "case",
    ["missing-model", "missing-config-json", "block-size-0", "split-0", "override-key", "override-value",
     "override-shape", "binary-text", "garbage-jsonl", "short-text", "read-only-output"],
)  # fmt: skip
def test_bad_input_is_one_line_naming_it(case, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    argv = train_argv(out, HARBOUR, "--max_steps", "1")
    expected = []
    if case == "missing-model":
        monkeypatch.chdir(tmp_path)
        i = argv.index("--config_name")
        argv[i : i + 2] = ["--model_name_or_path", "./nope"]
        expected = ["--model_name_or_path ./nope", "no such directory"]
    elif case == "missing-config-json":
        i = argv.index("--config_name")
        argv[i + 1] = str(tmp_path / "absent.json")
        expected = ["--config_name", "absent.json", "not found"]
    elif case == "block-size-0":
        argv[argv.index("--block_size") + 1] = "0"
        expected = ["--block_size 0"]
    elif case == "split-0":
        argv += ["--validation_split_percentage", "0"]
        expected = ["--validation_split_percentage"]
    elif case == "override-key":
        argv[argv.index("--config_overrides") + 1] = "hidden_size=32,no_such_option=3"
        expected = ["--config_overrides", "no_such_option"]
    elif case == "override-value":
        argv[argv.index("--config_overrides") + 1] = "hidden_size=abc"
        expected = ["--config_overrides", "hidden_size"]
    elif case == "override-shape":
        argv[argv.index("--config_overrides") + 1] = "hidden_size=32,num_attention_heads=3"
        expected = ["--config_overrides", "num_attention_heads"]
    elif case == "binary-text":
        data = tmp_path / "garbage.txt"
        data.write_bytes(bytes(range(256)) * 64)
        argv[argv.index("--train_file") + 1] = str(data)
        expected = [f"--train_file {data}", "not UTF-8 text"]
    elif case == "garbage-jsonl":
        data = tmp_path / "garbage.jsonl"
        data.write_text("this is { not json\n" * 20)
        argv[argv.index("--train_file") + 1] = str(data)
        expected = [f"--train_file {data}", "not readable as json"]
    elif case == "short-text":
        data = tmp_path / "short.txt"
        data.write_text("a few words\n" * 40)
        argv[argv.index("--train_file") + 1] = str(data)
        argv[argv.index("--block_size") + 1] = "512"
        argv += ["--validation_file", str(HARBOUR_VALID)]
        expected = ["no full block of 512 tokens", "--block_size"]
    elif case == "read-only-output":
        out.mkdir()
        out.chmod(0o555)
        if os.geteuid() == 0:  # root writes into a 0555 folder: make the write fail as on a read-only mount
            def read_only(*args, **kwargs):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS))

            monkeypatch.setattr(train_clm.tempfile, "mkstemp", read_only)
        expected = [f"--output_dir {out} is not writable"]
    line = one_line_error(argv, capsys)
    for needle in expected:
        assert needle in line, line


def test_the_legitimate_neighbours_are_accepted(tmp_path):
    """The guards above refuse only what is wrong: UTF-8 text with non-ASCII characters, a valid override that
    changes the shape, a held-out share of 1%, a Hub-id-like name (checked by the Hub, not refused as a path)."""
    text = tmp_path / "accents.txt"
    text.write_text("Le café du port ouvre à l'aube; the tide turns — ☂\n" * 50, encoding="utf-8")
    train_clm.check_data_files(types.SimpleNamespace(train_file=str(text), validation_file=None))
    config = DCFormerConfig.from_preset("dcformer-tiny")
    changed = train_clm.apply_config_overrides(config, "hidden_size=32,num_attention_heads=4,window_size=None")
    assert changed.hidden_size == 32 and changed.window_size is None
    args = train_clm.parse_args(train_argv(tmp_path / "run", HARBOUR, "--validation_split_percentage", "1"))
    assert args[1].validation_split_percentage == 1
    train_clm.check_model_source("model_name_or_path", "EleutherAI/pythia-160m")
    train_clm.check_model_source("model_name_or_path", str(tmp_path))  # an existing folder
    train_clm.check_output_dir(str(tmp_path / "new" / "folder"))
    assert (tmp_path / "new" / "folder").is_dir() and not list((tmp_path / "new" / "folder").iterdir())


# ----------------------------------------------------------------------------------------------------------------
# Item 2: no checkpoint of non-finite weights; item 9: checkpoints that cannot be resumed from are set aside
# ----------------------------------------------------------------------------------------------------------------
def test_a_step_that_makes_the_weights_non_finite_writes_no_checkpoint(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(train_clm.TrainingError, match="diverged at step 1.*NaN or inf.*checkpoint-1 was not written"):
        train_clm.main(train_argv(out, HARBOUR, "--learning_rate", "inf", "--max_steps", "3", "--save_steps", "1"))
    assert not list(out.glob("*checkpoint-*"))
    # the next run starts afresh (nothing to resume from) and trains
    trainer = train_clm.main(train_argv(out, HARBOUR, "--max_steps", "2", "--save_steps", "1"))
    assert trainer.state.global_step == 2 and (out / "checkpoint-2").is_dir()


def damage(checkpoint: Path, how: str) -> None:
    if how == "nonfinite":  # what an older version wrote after an infinite learning rate
        weights = checkpoint / "model.safetensors"
        tensors = load_file(weights)
        tensors = {k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in tensors.items()}
        save_file(tensors, weights, metadata={"format": "pt"})
    elif how == "weights":
        path = checkpoint / "model.safetensors"
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif how == "optimizer":
        path = checkpoint / "optimizer.pt"
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("how, tag", [("nonfinite", "nonfinite"), ("weights", "corrupt"), ("optimizer", "corrupt")])
def test_a_checkpoint_that_cannot_be_resumed_is_set_aside(how, tag, tmp_path, caplog):
    out = tmp_path / "run"
    train_clm.main(train_argv(out, HARBOUR, "--max_steps", "2", "--save_steps", "1"))
    assert train_clm.checkpoint_problem(out / "checkpoint-2") is None
    damage(out / "checkpoint-2", how)
    assert train_clm.checkpoint_problem(out / "checkpoint-2")[0] == tag

    with pytest.raises(train_clm.TrainingError, match="cannot be resumed from"):
        train_clm.main(train_argv(out, HARBOUR, "--max_steps", "3", "--resume_from_checkpoint",
                                  str(out / "checkpoint-2")))  # fmt: skip
    with caplog.at_level(logging.WARNING):
        trainer = train_clm.main(train_argv(out, HARBOUR, "--max_steps", "3", "--save_steps", "1"))
    assert "checkpoint-2 is not resumable" in caplog.text and f"renamed {tag}-checkpoint-2" in caplog.text
    assert (out / f"{tag}-checkpoint-2").is_dir()
    assert trainer.state.global_step == 3
    losses = [h["step"] for h in trainer.state.log_history if "loss" in h]
    assert losses[:2] == [1, 2]  # steps 2 and 3 trained again after checkpoint-1's step 1
    assert train_clm.checkpoint_problem(out / "checkpoint-3") is None
    # the run after that resumes from the new, good checkpoint without a word about the one set aside
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        train_clm.main(train_argv(out, HARBOUR, "--max_steps", "4", "--save_steps", "1"))
    assert "not resumable" not in caplog.text


def test_disk_full_during_a_checkpoint_is_one_line_and_leaves_no_partial_checkpoint(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    real_save = torch.save

    def disk_full_at_step_2(obj, f, *args, **kwargs):
        if "checkpoint-2" in str(f):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_full_at_step_2)
    line = one_line_error(train_argv(out, HARBOUR, "--max_steps", "3", "--save_steps", "1"), capsys)
    assert "could not write checkpoint" in line and "checkpoint-2" in line and "disk is full" in line
    assert "partial checkpoint was removed" in line
    assert not (out / "checkpoint-2").exists()
    assert train_clm.checkpoint_problem(out / "checkpoint-1") is None
    monkeypatch.undo()
    trainer = train_clm.main(train_argv(out, HARBOUR, "--max_steps", "3", "--save_steps", "1"))
    assert trainer.state.global_step == 3


# ----------------------------------------------------------------------------------------------------------------
# DDP needs no search for unused parameters
# ----------------------------------------------------------------------------------------------------------------
def test_every_parameter_takes_part_so_ddp_is_told_none_is_unused(tmp_path):
    """A config that uses every kind of weight (DCMHA with all four composition slots, q/k norms, local and global
    layers, biases): one loss's backward reaches every parameter, so `find_unused_parameters=False` (the script's
    default now) is right; the query-wise variant (two slots) as well."""
    for query_wise in (False, True):
        config = DCFormerConfig.from_preset(
            "dcformer-tiny", hidden_size=32, intermediate_size=64, num_hidden_layers=2, use_qk_norm=True,
            window_size=4, window_type="LG", attention_bias=True, mlp_bias=True, query_wise=query_wise,
        )  # fmt: skip
        torch.manual_seed(0)
        model = DCFormerForCausalLM(config)
        with torch.no_grad():  # the authors' init starts some terms at zero: make every path carry gradient
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
        model(ids, labels=ids).loss.backward()
        unused = [n for n, p in model.named_parameters() if p.grad is None or not bool(p.grad.abs().sum() > 0)]
        assert not unused, unused
    args = train_clm.parse_args(train_argv(tmp_path / "run", HARBOUR, "--max_steps", "1"))[2]
    assert args.ddp_find_unused_parameters is None
    train_clm.check_training_args(args)
    assert args.ddp_find_unused_parameters is False
    explicit = train_clm.parse_args(train_argv(tmp_path / "run", HARBOUR, "--ddp_find_unused_parameters", "true"))[2]
    train_clm.check_training_args(explicit)
    assert explicit.ddp_find_unused_parameters is True  # the user's word stands


def test_print_accelerate_config(capsys):
    assert train_clm.cli(["--print-accelerate-config", "multi_cpu_gloo"]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path.is_file() and path.name == "multi_cpu_gloo.yaml" and path.parent == train_clm.ACCELERATE_DIR
    assert train_clm.cli(["--print-accelerate-config=ds_zero3.json"]) == 0
    assert json.loads(Path(capsys.readouterr().out.strip()).read_text())["zero_optimization"]["stage"] == 3
    assert train_clm.cli(["--print-accelerate-config", "list"]) == 0
    assert capsys.readouterr().out.split() == ["deepspeed_zero2", "deepspeed_zero3", "fsdp", "multi_cpu_gloo"]
    line = one_line_error(["--print-accelerate-config", "nope"], capsys)
    assert "nope" in line and "fsdp" in line
