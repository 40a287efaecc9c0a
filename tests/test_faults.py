"""Nothing lost, nothing silently wrong under faults and bad input.

Crashes are simulated deterministically: an exception (or a snapshot of the disk, standing for a SIGKILL that runs no
clean-up) injected at a named step. Every model and tokenizer is built here; nothing is downloaded.

- converters (conversion/common.py over modeling_dcformer/checkpoints/atomic_dir.py): a destination is claimed for the whole run
  (a second conversion into it fails, another process's files are never deleted), is never the source, is replaced by
  an atomic swap (a crash at any moment leaves one complete copy), and left-overs of interrupted runs are cleaned up
  on the next run, saying so;
  --tolerance nan and a mistyped local path are one-line errors;
- save_pretrained (modeling_dcformer/publishing/saving.py, atomic_dir.py): a file is an error; a failed re-save changes nothing;
- train_clm.py: divergence stops training without saving a non-finite model; resuming reuses the checkpoint's
  tokenizer and skips a checkpoint whose write was interrupted; bad training data is a one-line error;
- evals: a missing model path and a limit of 0 or -1 are one-line errors.
"""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import modeling_dcformer  # noqa: F401  (registers the Auto classes)
from modeling_dcformer.conversion import common
from modeling_dcformer.conversion import released as released_converter
from modeling_dcformer.conversion import pythia as p2d
from modeling_dcformer import DCFormerConfig, DCFormerForCausalLM
from modeling_dcformer.checkpoints import atomic_dir
from helpers import train_argv
from released_checkpoint import released_dir

pytestmark = pytest.mark.usefixtures("one_thread_per_module")


class Killed(BaseException):
    """Stands for a SIGKILL at the injected step (the test snapshots the disk first: no clean-up would run)."""


def tree(path: Path) -> dict[str, bytes]:
    """Every file under `path` (hidden ones included), by relative name."""
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


def crash_snapshot(parent: Path, into: Path) -> Path:
    """What a SIGKILL at this moment leaves on disk: a copy of `parent` (locks die with the process)."""
    shutil.copytree(parent, into, symlinks=True)
    for lock in into.glob(".*.lock"):
        lock.unlink()
    return into


def convert_released(src, dst, **kwargs):
    return released_converter.convert(str(src), str(dst), **kwargs)


@pytest.fixture
def released(tmp_path):
    src, _, _ = released_dir(tmp_path, "src")
    return src


@pytest.fixture
def neox(tmp_path):
    """A tiny saved GPT-NeoX checkpoint (no tokenizer: verification uses random token ids)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    config = GPTNeoXConfig(
        vocab_size=64, hidden_size=24, num_hidden_layers=1, num_attention_heads=3, intermediate_size=48,
        max_position_embeddings=160, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    path = tmp_path / "neox"
    GPTNeoXForCausalLM(config).save_pretrained(path)
    return path


# ----------------------------------------------------------------------------------------------------------------
# 1. Two conversions into one folder: the second fails, nothing the run did not create is deleted
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tool", ["released", "pythia"])
def test_second_conversion_into_the_same_destination_fails(tool, released, neox, tmp_path, monkeypatch):
    from modeling_dcformer.conversion import converter as skeleton  # the pipeline both converters run

    src = released if tool == "released" else neox
    module = released_converter if tool == "released" else p2d
    run = (lambda s, d: module.convert(str(s), str(d))) if tool == "released" else (
        lambda s, d: module.convert(str(s), str(d), verify=False))
    dst = tmp_path / "out"
    other = []
    real_shareable = skeleton.write_shareable

    def while_a_runs(directory, *args, **kwargs):  # conversion A is near its end: B starts into the same folder
        real_shareable(directory, *args, **kwargs)
        if not other:
            try:
                run(src, dst)
                other.append("B succeeded")
            except FileExistsError as err:
                other.append(str(err))

    monkeypatch.setattr(skeleton, "write_shareable", while_a_runs)
    run(src, dst)  # A
    assert other and "another conversion" in other[0] and str(dst) in other[0], other
    assert (dst / "config.json").is_file() and (dst / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no lock or partial left


def test_files_another_process_puts_into_the_destination_are_never_deleted(released, tmp_path, monkeypatch):
    """A destination that was empty when the run started but is filled meanwhile (by anything): kept, error."""
    dst = tmp_path / "out"
    real_finish = common.ShardWriter.finish

    def finish(self):
        names = real_finish(self)
        dst.mkdir()
        (dst / "theirs.txt").write_text("someone else's")
        return names

    monkeypatch.setattr(common.ShardWriter, "finish", finish)
    with pytest.raises(FileExistsError, match="not empty: left as it is"):
        convert_released(released, dst)
    assert tree(dst) == {"theirs.txt": b"someone else's"}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


# ----------------------------------------------------------------------------------------------------------------
# 2. --overwrite: never the source; an atomic swap
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["same", "inside", "holding"])
def test_destination_that_is_in_or_around_the_source_is_refused(where, released, tmp_path, capsys):
    before = tree(released)
    dst = {"same": released, "inside": released / "out", "holding": tmp_path}[where]
    code = released_converter.main([str(released), str(dst), "--overwrite"])
    err = capsys.readouterr().err
    assert code == 2 and "source" in err and "error:" in err, err
    assert len(err.strip().splitlines()) == 1
    assert tree(released) == before


def test_overwrite_swaps_atomically(released, tmp_path, monkeypatch):
    """--overwrite over an earlier output: a kill just before or just after the exchange of the old and the new
    output leaves one complete copy at the destination."""
    dst = tmp_path / "out"
    convert_released(released, dst)
    (dst / "old-marker.txt").write_text("old")
    old = tree(dst)
    real_exchange = atomic_dir._exchange
    snapshots = {}

    def exchange(a, b):
        snapshots["before"] = crash_snapshot(tmp_path, tmp_path.parent / f"before-{tmp_path.name}")
        done = real_exchange(a, b)
        snapshots["after"] = crash_snapshot(tmp_path, tmp_path.parent / f"after-{tmp_path.name}")
        return done

    monkeypatch.setattr(atomic_dir, "_exchange", exchange)
    convert_released(released, dst, overwrite=True)
    new = tree(dst)
    assert "old-marker.txt" not in new and new.keys() >= {"config.json", "model.safetensors"}
    assert tree(snapshots["before"] / "out") == old
    assert tree(snapshots["after"] / "out") == new
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_overwrite_after_a_kill_mid_swap_restores_then_replaces(released, tmp_path, monkeypatch, caplog):
    dst = tmp_path / "out"
    convert_released(released, dst)
    (dst / "old-marker.txt").write_text("old")
    old = tree(dst)
    crashed = tmp_path.parent / f"crashed-{tmp_path.name}"
    monkeypatch.setattr(atomic_dir, "_exchange", lambda a, b: False)  # the fallback: two renames
    real_replace = os.replace

    def killed_between_the_renames(a, b):
        if Path(b) == dst.resolve() and ".out.tmp-" in Path(a).name:  # the old copy is aside, the new one not in
            crash_snapshot(tmp_path, crashed)
            raise Killed
        return real_replace(a, b)

    monkeypatch.setattr(atomic_dir.os, "replace", killed_between_the_renames)
    with pytest.raises(Killed):
        convert_released(released, dst, overwrite=True)
    monkeypatch.undo()
    assert not (crashed / "out").exists() and tree(next(crashed.glob(".out.old-*"))) == old
    assert list(crashed.glob(".out.tmp-*"))  # the unfinished new output, hidden
    with pytest.raises(FileExistsError, match="not empty"):  # next run without --overwrite: restored, refused
        convert_released(crashed / "src", crashed / "out")
    assert tree(crashed / "out") == old
    assert "previous copy was put back" in caplog.text and "interrupted write" in caplog.text
    assert not [p for p in crashed.iterdir() if p.name.startswith(".out.")]
    convert_released(crashed / "src", crashed / "out", overwrite=True)
    assert "old-marker.txt" not in tree(crashed / "out")


# ----------------------------------------------------------------------------------------------------------------
# 3. Left-overs of interrupted runs are removed by the next run, which says so
# ----------------------------------------------------------------------------------------------------------------
def test_interrupted_conversion_leftovers_are_cleaned_up_next_run(released, tmp_path, monkeypatch, caplog):
    dst = tmp_path / "out"
    crashed = tmp_path.parent / f"crashed-{tmp_path.name}"

    def killed_finish(self):
        self.flush()
        crash_snapshot(tmp_path, crashed)
        raise Killed

    monkeypatch.setattr(common.ShardWriter, "finish", killed_finish)
    with pytest.raises(Killed):
        convert_released(released, dst)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # an error: cleaned up at once
    monkeypatch.undo()
    (partial,) = crashed.glob(".out.tmp-*")  # a kill: the hidden partial output stays...
    assert any(partial.iterdir())
    other = crashed / ".other.tmp-abc"  # (another destination's: not this run's business)
    other.mkdir()
    convert_released(crashed / "src", crashed / "out")  # ...until the next run into the same destination
    assert not partial.exists() and other.exists()
    assert f"removed {partial}" in caplog.text and "interrupted write" in caplog.text
    assert (crashed / "out" / "model.safetensors").is_file()


# ----------------------------------------------------------------------------------------------------------------
# 4. A config that does not match its weights is an error naming the field; integer weights are refused
# ----------------------------------------------------------------------------------------------------------------
MISMATCH_BASE = dict(
    vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
    max_position_embeddings=64, use_qk_norm=True, window_size=8,
)  # fmt: skip


@pytest.fixture
def saved_dcformer(tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "saved"
    DCFormerForCausalLM(DCFormerConfig(**MISMATCH_BASE)).save_pretrained(path)
    return path


@pytest.mark.parametrize(
    "override, message",
    [
        (dict(query_wise=True), "query_wise is True but the checkpoint stores all four composition slots"),
        (dict(num_hidden_layers=1), "num_hidden_layers is 1 but the checkpoint has at least 2 layers"),
        (dict(use_qk_norm=False), "use_qk_norm is False but the checkpoint has tensors that only a model with"),
        (dict(use_dcmha=False), "use_dcmha is False but the checkpoint has tensors"),
        (dict(attention_bias=False), "attention_bias is False"),
        (dict(norm_type="rmsnorm"), "norm_type is 'rmsnorm'"),
        (dict(use_gated_mlp=True), "use_gated_mlp is True but the checkpoint lacks"),
        (dict(intermediate_size=32), r"mlp\.up_proj\.weight has shape \(64, 32\) in the checkpoint but \(32, 32\)"),
    ],
)
def test_config_that_does_not_match_the_weights_names_the_field(saved_dcformer, override, message):
    config = DCFormerConfig(**{**MISMATCH_BASE, **override})
    with pytest.raises(ValueError, match=message):
        DCFormerForCausalLM.from_pretrained(saved_dcformer, config=config)


def test_ignore_mismatched_sizes_is_the_users_choice(saved_dcformer, monkeypatch):
    """transformers gets the caller's ignore_mismatched_sizes (not a forced True); a wrong shape is still refused
    by name, and re-initialised only when the caller asks, as transformers does."""
    from transformers import PreTrainedModel

    seen = []
    parent = PreTrainedModel.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        seen.append(kwargs.get("ignore_mismatched_sizes", False))
        return parent(cls, *args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(spy))
    config = DCFormerConfig(**{**MISMATCH_BASE, "intermediate_size": 32})
    with pytest.raises(ValueError, match=r"up_proj\.weight has shape \(64, 32\) in the checkpoint but \(32, 32\)"):
        DCFormerForCausalLM.from_pretrained(saved_dcformer, config=config, output_loading_info=True)
    model, info = DCFormerForCausalLM.from_pretrained(
        saved_dcformer, config=config, ignore_mismatched_sizes=True, output_loading_info=True
    )
    assert seen == [False, True]
    assert model.model.layers[0].mlp.up_proj.weight.shape == (32, 32)
    assert {key for key, _, _ in info["mismatched_keys"]} >= {"model.layers.0.mlp.up_proj.weight"}


def test_two_slot_checkpoint_under_a_four_slot_config(tmp_path):
    path = tmp_path / "query-wise"
    DCFormerForCausalLM(DCFormerConfig(**MISMATCH_BASE, query_wise=True)).save_pretrained(path)
    assert DCFormerForCausalLM.from_pretrained(path).config.query_wise  # its own config: fine
    with pytest.raises(ValueError, match="query_wise is False but the checkpoint stores only the two query-wise"):
        DCFormerForCausalLM.from_pretrained(path, config=DCFormerConfig(**MISMATCH_BASE))


def test_base_model_from_a_causal_lm_checkpoint_is_not_a_mismatch(saved_dcformer):
    from modeling_dcformer import DCFormerModel

    model = DCFormerModel.from_pretrained(saved_dcformer)  # lm_head unused by the base model: that is expected
    assert model.config.num_hidden_layers == 2


def test_query_wise_config_over_a_released_full_checkpoint_is_refused(tmp_path):
    src, _, _ = released_dir(tmp_path)  # trained with query_wise=False, four slots stored
    config = DCFormerConfig.from_pretrained(src)
    assert not config.query_wise and config.released_model_type == "dcpythia"
    config.query_wise = True
    with pytest.raises(ValueError, match="query_wise is True but checkpoint .* was trained with query_wise=False"):
        DCFormerForCausalLM.from_pretrained(src, config=config)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool])
def test_integer_weights_are_refused(saved_dcformer, dtype):
    from safetensors.torch import load_file, save_file

    state = load_file(saved_dcformer / "model.safetensors")
    state["model.layers.0.self_attn.o_proj.weight"] = state["model.layers.0.self_attn.o_proj.weight"].to(dtype)
    save_file(state, saved_dcformer / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"non-floating dtype.*layers\.0\.self_attn\.o_proj\.weight"):
        DCFormerForCausalLM.from_pretrained(saved_dcformer)


def test_integer_weights_in_a_torch_checkpoint_are_refused(saved_dcformer):
    from safetensors.torch import load_file

    state = load_file(saved_dcformer / "model.safetensors")
    state["lm_head.weight"] = state["lm_head.weight"].long()
    (saved_dcformer / "model.safetensors").unlink()
    torch.save(state, saved_dcformer / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"non-floating dtype.*lm_head\.weight \(torch\.int64\)"):
        DCFormerForCausalLM.from_pretrained(saved_dcformer)


# ----------------------------------------------------------------------------------------------------------------
# 8. A failed verification never writes and never exits 0
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tolerance", ["nan", "-1"])
def test_tolerance_nan_is_refused(tolerance, neox, tmp_path, capsys):
    code = p2d.main([str(neox), str(tmp_path / "dst"), "--verify", "--tolerance", tolerance])
    err = capsys.readouterr().err
    assert code == 2 and "--tolerance" in err, err
    assert not (tmp_path / "dst").exists()


def test_nan_logit_difference_fails_verification(neox, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(p2d, "max_logit_difference", lambda *a: (float("nan"), 1, "test"))
    code = p2d.main([str(neox), str(tmp_path / "dst"), "--verify", "--tolerance", "1e-4"])
    out, err = capsys.readouterr()
    assert code == 2 and "FAILED" in out and "differ" in err
    assert not (tmp_path / "dst").exists()


# ----------------------------------------------------------------------------------------------------------------
# 12. A mistyped local path is one line, not a network traceback
# ----------------------------------------------------------------------------------------------------------------
def test_mistyped_source_path_is_one_line(tmp_path, capsys, monkeypatch):
    import huggingface_hub

    class ConnectError(Exception):  # what the HTTP client raises offline (not an OSError)
        pass

    def unreachable(self, repo_id, **kwargs):
        raise ConnectError("[Errno -3] Temporary failure in name resolution\n(and 90 more lines)")

    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", unreachable)
    monkeypatch.chdir(tmp_path)
    for tool in (p2d, released_converter):
        code = tool.main(["my-pythia", str(tmp_path / "dst")])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "'my-pythia'" in err and "no such directory" in err and "Hub id" in err
    assert not (tmp_path / "dst").exists()


# ----------------------------------------------------------------------------------------------------------------
# 13. save_pretrained: a file is an error; a re-save that fails (or is killed) changes nothing
# ----------------------------------------------------------------------------------------------------------------
def tiny_dcformer(seed=0):
    torch.manual_seed(seed)
    config = DCFormerConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64,
    )  # fmt: skip
    return DCFormerForCausalLM(config)


def test_save_pretrained_into_a_file_raises(tmp_path):
    path = tmp_path / "model"
    path.write_text("not a directory")
    with pytest.raises(NotADirectoryError, match="is a file"):
        tiny_dcformer().save_pretrained(path)
    assert path.read_text() == "not a directory"


def test_failed_resave_leaves_the_old_save_whole(tmp_path, monkeypatch):
    """The weights cannot be written (disk full, permissions...): the directory keeps the old config and weights,
    and a re-save that succeeds keeps the other files there (tokenizer, subdirectories, the user's README.md)."""
    path = tmp_path / "model"
    tiny_dcformer(0).save_pretrained(path)
    (path / "tokenizer.json").write_text("{}")
    (path / "README.md").write_text("my own notes")
    (path / "checkpoint-1").mkdir()
    (path / "checkpoint-1" / "optimizer.pt").write_bytes(b"state")
    old = tree(path)

    new_model = tiny_dcformer(1)
    new_model.config.initializer_range = 0.5  # a visibly different config
    import transformers.modeling_utils

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(transformers.modeling_utils, "safe_save_file", disk_full)
        with pytest.raises(OSError, match="No space left"):
            new_model.save_pretrained(path)
    assert tree(path) == old
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no temporary sibling left

    new_model.save_pretrained(path)
    saved = tree(path)
    assert json.loads(saved["config.json"])["initializer_range"] == 0.5
    assert saved["model.safetensors"] != old["model.safetensors"]
    for kept in ("tokenizer.json", "README.md", "checkpoint-1/optimizer.pt"):
        assert saved[kept] == old[kept]
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_killed_resave_leaves_one_complete_save(tmp_path, monkeypatch, caplog):
    path = tmp_path / "model"
    tiny_dcformer(0).save_pretrained(path)
    (path / "tokenizer.json").write_text("{}")
    old = tree(path)
    crashed = tmp_path.parent / f"crashed-{tmp_path.name}"

    def killed_exchange(a, b):  # the moment before the new save takes the directory's place
        crash_snapshot(tmp_path, crashed)
        raise Killed

    monkeypatch.setattr(atomic_dir, "_exchange", killed_exchange)
    with pytest.raises(Killed):
        tiny_dcformer(1).save_pretrained(path)
    assert tree(path) == old and tree(crashed / "model") == old
    loaded = DCFormerForCausalLM.from_pretrained(crashed / "model")
    assert torch.equal(loaded.model.embed_tokens.weight, tiny_dcformer(0).model.embed_tokens.weight)
    monkeypatch.undo()
    (unfinished,) = crashed.glob(".model.tmp-*")  # the killed save's files: removed by the next save, saying so
    caplog.clear()
    tiny_dcformer(1).save_pretrained(crashed / "model")
    assert not unfinished.exists() and [p.name for p in crashed.iterdir()] == ["model"]
    assert f"removed {unfinished}" in caplog.text
    assert tree(crashed / "model")["tokenizer.json"] == b"{}"


# ----------------------------------------------------------------------------------------------------------------
# train_clm.py: 5 divergence, 6 the resumed tokenizer, 9 an interrupted checkpoint, 12 bad training data
# ----------------------------------------------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parent.parent
HARBOUR = ROOT / "examples" / "data" / "harbour_train.txt"


@pytest.fixture(scope="module")
def train_clm():
    from modeling_dcformer.training import train_clm as module

    return module




@pytest.fixture
def harbour_lines():
    return [line for line in HARBOUR.read_text(encoding="utf-8").splitlines() if line.strip()]


def test_diverging_training_stops_and_saves_nothing_non_finite(train_clm, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(train_clm.TrainingError, match="diverged") as err:
        train_clm.main(train_argv(out, HARBOUR, "--learning_rate", "1e6", "--max_steps", "20", "--save_steps", "1"))
    assert "--learning_rate" in str(err.value)
    assert not (out / "model.safetensors").exists()
    from safetensors.torch import load_file

    for checkpoint in out.glob("checkpoint-*"):  # every checkpoint saved before the stop is finite
        assert all(torch.isfinite(t).all() for t in load_file(checkpoint / "model.safetensors").values())


def test_non_finite_final_model_is_not_saved(train_clm, tmp_path, monkeypatch):
    """What the gradient check cannot see (fp16 loss scaling skips such steps): the final save refuses NaN weights."""
    monkeypatch.setattr(train_clm.StopOnNonFinite, "on_pre_optimizer_step", lambda self, *a, **k: None)
    real_check = train_clm.check_finite

    def poisoned(model, what):
        with torch.no_grad():
            model.model.norm.weight[0] = float("nan")
        real_check(model, what)

    monkeypatch.setattr(train_clm, "check_finite", poisoned)
    out = tmp_path / "run"
    with pytest.raises(train_clm.TrainingError, match="NaN or inf.*model.norm.weight"):
        train_clm.main(train_argv(out, HARBOUR, "--max_steps", "1", "--save_strategy", "no"))
    assert not (out / "model.safetensors").exists()


def test_resume_reuses_the_checkpoints_tokenizer(train_clm, tmp_path, harbour_lines):
    from transformers import AutoTokenizer

    out = tmp_path / "run"
    first = tmp_path / "first.txt"
    first.write_text("\n".join(harbour_lines) + "\n")
    train_clm.main(train_argv(out, first, "--max_steps", "2", "--save_steps", "2"))
    vocab = AutoTokenizer.from_pretrained(out / "checkpoint-2").get_vocab()
    changed = tmp_path / "changed.txt"  # other text: a tokenizer trained on it would differ
    changed.write_text("\n".join(" ".join(reversed(line.split())) + " zyx qvw 0123" for line in harbour_lines) + "\n")
    assert AutoTokenizer.from_pretrained(out / "checkpoint-2").get_vocab() == vocab
    trainer = train_clm.main(train_argv(out, changed, "--max_steps", "3", "--save_steps", "2"))
    assert trainer.state.global_step == 3
    assert trainer.processing_class.get_vocab() == vocab
    assert AutoTokenizer.from_pretrained(out).get_vocab() == vocab


def test_resume_skips_a_checkpoint_whose_write_was_killed(train_clm, tmp_path, monkeypatch, caplog):
    from transformers import TrainerState

    out = tmp_path / "run"
    real_save = TrainerState.save_to_json

    def killed_at_step_4(self, path):  # trainer_state.json is the last file of a checkpoint
        if self.global_step == 4:
            raise Killed
        real_save(self, path)

    monkeypatch.setattr(TrainerState, "save_to_json", killed_at_step_4)
    with pytest.raises(Killed):
        train_clm.main(train_argv(out, HARBOUR, "--max_steps", "6", "--save_steps", "2"))
    monkeypatch.undo()
    assert (out / "checkpoint-4").is_dir() and not (out / "checkpoint-4" / "trainer_state.json").exists()
    trainer = train_clm.main(train_argv(out, HARBOUR, "--max_steps", "6", "--save_steps", "2"))
    assert trainer.state.global_step == 6
    assert "checkpoint-4 is incomplete" in caplog.text and "incomplete-checkpoint-4" in caplog.text
    assert (out / "incomplete-checkpoint-4").is_dir()
    assert [h["step"] for h in trainer.state.log_history if "loss" in h][:2] == [1, 2]  # continued from step 2
    with pytest.raises(train_clm.TrainingError, match="incomplete"):
        train_clm.main(train_argv(out, HARBOUR, "--resume_from_checkpoint", str(out / "incomplete-checkpoint-4")))


@pytest.mark.parametrize("case", ["empty", "missing", "tiny", "null-rows"])
def test_bad_training_data_is_one_line_naming_it(case, train_clm, tmp_path, harbour_lines):
    data = tmp_path / ("data.jsonl" if case == "null-rows" else "data.txt")
    if case == "empty":
        data.write_text("")
    elif case == "tiny":
        data.write_text("hello there\n")
    elif case == "null-rows":
        rows = [{"text": None if i == 7 else line} for i, line in enumerate(harbour_lines)]
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    expected = {"empty": "is empty", "missing": "no such file", "tiny": "too few rows", "null-rows": "record 8 "}[case]
    with pytest.raises(train_clm.TrainingError, match=expected) as err:
        train_clm.main(train_argv(tmp_path / "run", data, "--max_steps", "1"))
    assert str(data) in str(err.value) and "\n" not in str(err.value)


# ----------------------------------------------------------------------------------------------------------------
# 12. Evaluation: a missing model path, a limit of 0 or -1 (CLI, Python entry point, the demo)
# ----------------------------------------------------------------------------------------------------------------
def test_eval_cli_missing_model_path_is_one_line(tmp_path, capsys, monkeypatch):
    from modeling_dcformer.evals import harness

    monkeypatch.chdir(tmp_path)
    code = harness.main(["run", "--model", "dcformer", "--model_args", "pretrained=./no/such/model",
                         "--tasks", "piqa_local", "--device", "cpu"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.strip().splitlines() == [err.strip()], err
    assert "./no/such/model" in err and "no such directory" in err
    with pytest.raises(FileNotFoundError, match="no such directory"):
        harness.evaluate(str(tmp_path / "absent"), tasks=["piqa_local"])


@pytest.mark.parametrize("limit", ["0", "-1"])
def test_eval_limit_zero_or_negative_is_one_line(limit, tmp_path, capsys):
    from modeling_dcformer.evals import harness

    code = harness.main(["run", "--model", "dcformer", "--model_args", f"pretrained={tmp_path}",
                         "--tasks", "piqa_local", "--device", "cpu", "--limit", limit])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--limit {limit}" in err and "every row" in err
    with pytest.raises(ValueError, match="every row"):
        harness.evaluate(tiny_dcformer(), object(), tasks=["piqa_local"], limit=int(limit))


def test_demo_negative_limit_is_refused(capsys):
    from helpers import load_example

    demo = load_example("demo")

    assert demo.parse_args(["--limit", "0"]).limit == 0  # the demo's word for every row
    with pytest.raises(SystemExit) as exit_info:
        demo.parse_args(["--limit", "-1"])
    assert exit_info.value.code == 2 and "--limit -1" in capsys.readouterr().err


def test_a_real_sigkill_mid_conversion_is_cleaned_up_by_the_next_run(released, tmp_path, caplog):
    """The same as the injected kills above, with a real SIGKILL (no clean-up of any kind runs): the lock dies with
    the process, and the next run removes the unfinished output and converts."""
    import signal
    import subprocess
    import sys
    import textwrap

    dst = tmp_path / "out"
    driver = textwrap.dedent(f"""
        import os, signal, sys
        from modeling_dcformer.conversion import common
        from modeling_dcformer.conversion import released as released_converter
        real_flush = common.ShardWriter.flush
        def flush(self):
            real_flush(self)
            os.kill(os.getpid(), signal.SIGKILL)  # output shards on disk, lock held
        common.ShardWriter.flush = flush
        released_converter.convert({str(released)!r}, {str(dst)!r})
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    result = subprocess.run([sys.executable, "-c", driver], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    (partial,) = tmp_path.glob(".out.tmp-*")
    assert any(partial.iterdir()) and not dst.exists()
    convert_released(released, dst)
    assert not partial.exists() and f"removed {partial}" in caplog.text
    assert (dst / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_eval_results_file_is_replaced_whole(tmp_path, monkeypatch):
    from modeling_dcformer.evals import harness

    path = tmp_path / "results.json"
    harness.save_results({"results": {"old": {}}}, path)
    before = path.read_bytes()

    def killed_rename(src, dst):
        raise Killed

    monkeypatch.setattr(harness.os, "replace", killed_rename)
    with pytest.raises(Killed):
        harness.save_results({"results": {"new": {}}}, path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["results.json"]
