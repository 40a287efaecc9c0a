"""dcformer-train (modeling_dcformer.training.train_clm) under bad input and faults: every failure is one line naming
the flag, file or value (exit code 2 through the console script's `cli`; bad flags before the settings are printed),
no checkpoint of non-finite weights is written, a checkpoint that cannot be resumed from (NaN weights, truncated
weights or optimizer, an RNG state `torch.load(weights_only=True)` refuses) is set aside with a warning and the
previous one used, a full disk (checkpoint, final save, datasets cache; simulated as torch, safetensors and datasets
report it, and on a real small tmpfs where the machine allows mounting one) is one line and leaves no half-written
checkpoint, `--push_to_hub` without a reachable Hub is one line (exit 3 with the `hf upload` command when only the
final upload failed), and DDP is told that no parameter is unused (true for every weight)."""

import contextlib
import errno
import json
import logging
import os
import shutil
import subprocess
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from modeling_dcformer import DCFormerConfig, DCFormerForCausalLM
from modeling_dcformer.training import train_clm

from helpers import install_fake_hub
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
        # a finite learning rate whose update overflows float32 (an infinite one is refused before training)
        train_clm.main(train_argv(out, HARBOUR, "--learning_rate", "1e39", "--max_steps", "3", "--save_steps", "1"))
    assert not list(out.glob("*checkpoint-*"))
    # the next run starts afresh (nothing to resume from) and trains
    trainer = train_clm.main(train_argv(out, HARBOUR, "--max_steps", "2", "--save_steps", "1"))
    assert trainer.state.global_step == 2 and (out / "checkpoint-2").is_dir()


class Planted:
    """An object of a kind `torch.load(weights_only=True)` refuses (as in a state file written by other versions)."""


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
    elif how == "rng":  # a whole archive, which Trainer's weights_only load refuses
        path = checkpoint / "rng_state.pth"
        state = torch.load(path, weights_only=False)
        torch.save({**state, "planted": Planted()}, path)


@pytest.mark.parametrize("how, tag", [("nonfinite", "nonfinite"), ("weights", "corrupt"), ("optimizer", "corrupt"),
                                      ("rng", "unloadable")])
def test_a_checkpoint_that_cannot_be_resumed_is_set_aside(how, tag, tmp_path, caplog):
    out = tmp_path / "run"
    train_clm.main(train_argv(out, HARBOUR, "--max_steps", "2", "--save_steps", "1"))
    assert train_clm.checkpoint_problem(out / "checkpoint-2") is None
    damage(out / "checkpoint-2", how)
    assert train_clm.checkpoint_problem(out / "checkpoint-2")[0] == tag
    if how == "rng":
        assert "refuses rng_state.pth" in train_clm.checkpoint_problem(out / "checkpoint-2")[1]

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


# ----------------------------------------------------------------------------------------------------------------
# Bad flags: one line naming the flag, before the settings are printed
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, named", [
    (["--per_device_train_batch_size", "0"], "--per_device_train_batch_size 0"),
    (["--per_device_train_batch_size", "-1"], "--per_device_train_batch_size -1"),
    (["--do_eval", "--per_device_eval_batch_size", "0"], "--per_device_eval_batch_size 0"),
    (["--gradient_accumulation_steps", "0"], "--gradient_accumulation_steps 0"),
    (["--learning_rate", "nan"], "--learning_rate nan"),
    (["--learning_rate", "inf"], "--learning_rate inf"),
    (["--learning_rate=-1e-3"], "--learning_rate -0.001"),
    (["--max_train_samples", "0"], "--max_train_samples 0"),
    (["--do_eval", "--max_eval_samples", "-2"], "--max_eval_samples -2"),
    (["--resume_from_checkpoint", "/nonexistent/checkpoint-9"], "--resume_from_checkpoint /nonexistent/checkpoint-9"),
])  # fmt: skip
def test_bad_flags_are_one_line_before_the_settings(flags, named, tmp_path, capsys, caplog):
    out = tmp_path / "run"
    argv = train_argv(out, HARBOUR, "--max_steps", "1", "--validation_file", str(HARBOUR_VALID), *flags)
    with caplog.at_level(logging.INFO):
        line = one_line_error(argv, capsys)
    assert named in line, line
    assert "training parameters" not in caplog.text and "process rank" not in caplog.text
    assert not out.exists()


def test_the_flags_neighbours_pass_and_a_single_process_rank_is_information(tmp_path, caplog):
    """A learning rate of 0 and batches of 1 are accepted; one process says its rank at information level, after
    the checks and before the settings."""
    args = train_clm.parse_args(train_argv(tmp_path / "run", HARBOUR, "--learning_rate", "0",
                                           "--per_device_train_batch_size", "1", "--max_train_samples", "1"))
    train_clm.check_training_args(args[2])
    assert args[1].max_train_samples == 1
    with caplog.at_level(logging.INFO):
        train_clm.main(train_argv(tmp_path / "run", HARBOUR, "--max_steps", "1"))
    (rank,) = [r for r in caplog.records if "process rank 0 of 1" in r.getMessage()]
    assert rank.levelno == logging.INFO
    messages = [r.getMessage() for r in caplog.records]
    settings = next(i for i, m in enumerate(messages) if m.startswith("training parameters"))
    assert messages.index(rank.getMessage()) < settings


# ----------------------------------------------------------------------------------------------------------------
# A full disk, as torch, safetensors and datasets report it
# ----------------------------------------------------------------------------------------------------------------
TORCH_FULL_DISK = "[enforce fail at inline_container.cc:672] . unexpected pos 182464 vs 182352"  # torch.save's words


def nearly_full_disk(monkeypatch):
    """train_clm sees 4 KiB free wherever it asks (its own `shutil` only: nothing else is misled)."""
    fake = types.SimpleNamespace(**{name: getattr(shutil, name) for name in dir(shutil) if not name.startswith("__")})
    fake.disk_usage = lambda path: types.SimpleNamespace(total=1 << 30, used=(1 << 30) - 4096, free=4096)
    monkeypatch.setattr(train_clm, "shutil", fake)


def test_disk_full_in_torch_save_during_a_checkpoint_is_one_line(tmp_path, monkeypatch, capsys):
    """torch.save on a full disk raises a RuntimeError without an errno, after writing part of the file."""
    out = tmp_path / "run"
    real_save = torch.save

    def disk_full_at_step_2(obj, f, *args, **kwargs):
        if "checkpoint-2" in str(f):
            Path(f).write_bytes(b"PK\x03\x04 partial")
            raise RuntimeError(TORCH_FULL_DISK)
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_full_at_step_2)
    nearly_full_disk(monkeypatch)
    line = one_line_error(train_argv(out, HARBOUR, "--max_steps", "3", "--save_steps", "1"), capsys)
    assert "could not write checkpoint" in line and "checkpoint-2" in line and "the disk is full" in line
    assert "partial checkpoint was removed" in line
    assert not (out / "checkpoint-2").exists() and train_clm.checkpoint_problem(out / "checkpoint-1") is None


def test_disk_full_in_the_final_save_is_one_line_and_no_model_is_presented(tmp_path, monkeypatch, capsys):
    import transformers.modeling_utils
    from safetensors import SafetensorError

    def disk_full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", disk_full)
    out = tmp_path / "run"
    line = one_line_error(train_argv(out, HARBOUR, "--max_steps", "1", "--save_strategy", "no"), capsys)
    assert f"could not save the final model to {out}" in line and "the disk is full" in line
    assert "incomplete" in line
    assert not (out / "model.safetensors").exists() and not (out / "config.json").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no hidden half-save beside it


def test_a_full_datasets_cache_is_one_line_naming_the_cache(tmp_path, monkeypatch, capsys):
    """The datasets library wraps the OSError of a full cache (DatasetGenerationError): the line names the cache,
    not the data file being read."""
    import datasets.arrow_writer

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(datasets.arrow_writer.ArrowWriter, "finalize", full)
    line = one_line_error(train_argv(tmp_path / "run", HARBOUR, "--max_steps", "1"), capsys)
    assert f"could not write the datasets cache {tmp_path / 'datasets-cache'}" in line and "disk is full" in line
    assert "--train_file" not in line and "not readable" not in line


@contextlib.contextmanager
def small_disk(folder: Path, size: str):
    """A tmpfs of `size` mounted at `folder` (root on Linux only: else the test is skipped)."""
    folder.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a small filesystem needs root")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode(errors='replace').strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


@pytest.mark.parametrize("where, size, expected", [
    ("checkpoint", "1500k", "could not write checkpoint"),
    ("final", "300k", "could not save the final model"),
    ("cache", "12k", "could not write the datasets cache"),
])  # fmt: skip
def test_a_real_full_disk_is_one_line(where, size, expected, tmp_path, capsys):
    with small_disk(tmp_path / "disk", size) as disk:
        out = disk / "run" if where != "cache" else tmp_path / "run"
        cache = disk / "cache" if where == "cache" else tmp_path / "cache"
        extra = ["--max_steps", "3", "--save_steps", "1"] if where == "checkpoint" else ["--save_strategy", "no"]
        line = one_line_error(train_argv(out, HARBOUR, "--max_steps", "1", *extra, "--cache_dir", str(cache)), capsys)
        assert expected in line and ("No space left on device" in line or "disk is full" in line), line
        if where == "checkpoint":
            assert sorted(p.name for p in out.iterdir()) == ["checkpoint-1"]
            assert train_clm.checkpoint_problem(out / "checkpoint-1") is None
        if where == "final":
            assert not (out / "model.safetensors").exists()


# ----------------------------------------------------------------------------------------------------------------
# --push_to_hub without a reachable Hub
# ----------------------------------------------------------------------------------------------------------------
def test_push_to_hub_offline_is_one_line_before_anything(tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # as HF_HUB_OFFLINE=1 does
    out = tmp_path / "run"
    line = one_line_error(train_argv(out, HARBOUR, "--max_steps", "1", "--push_to_hub"), capsys)
    assert "--push_to_hub" in line and "HF_HUB_OFFLINE" in line and "hf upload" in line
    assert not out.exists()


def test_push_to_hub_with_an_unreachable_hub_is_one_line(tmp_path, monkeypatch, capsys):
    calls = install_fake_hub(monkeypatch, tmp_path)
    calls.fail = "create_repo"  # a network error
    out = tmp_path / "run"
    argv = train_argv(out, HARBOUR, "--max_steps", "1", "--save_strategy", "no", "--push_to_hub",
                      "--hub_private_repo", "true")
    line = one_line_error(argv, capsys)
    assert "--push_to_hub: creating the Hugging Face Hub repository 'run' failed" in line
    assert "network is unreachable" in line and "nothing was trained" in line
    assert f"hf upload run {out} --private" in line
    assert not (out / "model.safetensors").exists() and not list(out.glob("checkpoint-*"))


def test_a_failed_final_upload_leaves_the_output_complete_and_says_how_to_upload_it(tmp_path, monkeypatch, capsys):
    calls = install_fake_hub(monkeypatch, tmp_path)
    calls.fail = "upload"
    out = tmp_path / "run"
    argv = train_argv(out, HARBOUR, "--max_steps", "1", "--save_strategy", "no", "--push_to_hub",
                      "--hub_private_repo", "true", "--hub_revision", "exp", "--hub_token", "hf_secret_x")
    assert train_clm.cli(argv) == 3
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    line = lines[0]
    assert f"saved the model to {out} (complete" in line and "network is unreachable" in line
    assert f"hf upload me/run {out} --private --revision exp --exclude '_*' --exclude 'checkpoint-*'" in line
    assert "push_to_hub(" not in line and "hf_secret_x" not in line and "--token" in line
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "trainer_state.json", "all_results.json"} <= names
    assert 'AutoTokenizer.from_pretrained("me/run")' in (out / "README.md").read_text()
