"""save_pretrained and from_pretrained under faults: saved folders keep the umask's mode or the existing folder's; ".",
".." and symlinks (also to an empty folder) save into the folder they name; three processes saving one folder each
finish with one whole save; a process loading while another re-saves never mixes two saves; `from_pretrained(root,
subfolder=...)` works for a released DCFormer++ checkpoint and for our layout. Each of these fails on the code before
the sharing-layer redesign. A destination under a file, a folder name of 250 bytes and a full disk: one line naming the
folder, the old save whole."""

import json
import os
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import modeling_dcformer  # noqa: F401
from conftest import TINY
from modeling_dcformer import DCFormerConfig, DCFormerForCausalLM
from released_checkpoint import released_dir

pytestmark = pytest.mark.usefixtures("one_thread_per_module")


def tiny(seed: int = 0, **overrides) -> DCFormerForCausalLM:
    torch.manual_seed(seed)
    return DCFormerForCausalLM(DCFormerConfig(**{**TINY, **overrides})).eval()


def weights_of(model) -> torch.Tensor:
    return model.model.embed_tokens.weight.detach().clone()


def beside(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.parent.iterdir())


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


# ----------------------------------------------------------------------------------------------------------------
# Modes
# ----------------------------------------------------------------------------------------------------------------
def test_saved_folder_mode_follows_the_umask(tmp_path, umask_022):
    tiny().save_pretrained(tmp_path / "model")
    assert stat.S_IMODE((tmp_path / "model").stat().st_mode) == 0o755  # as plain transformers; was 0700
    assert stat.S_IMODE((tmp_path / "model" / "config.json").stat().st_mode) == 0o644


def test_resave_keeps_a_shared_folders_mode(tmp_path, umask_022):
    folder = tmp_path / "shared"
    tiny(0).save_pretrained(folder)
    os.chmod(folder, 0o2775)
    tiny(1).save_pretrained(folder)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o2775  # was 0700: other users locked out


# ----------------------------------------------------------------------------------------------------------------
# ".", "..", symlinks
# ----------------------------------------------------------------------------------------------------------------
def test_save_into_dot_from_inside_the_folder(tmp_path, monkeypatch):
    folder = tmp_path / "model"
    tiny(0).save_pretrained(folder)
    (folder / "notes.txt").write_text("mine")
    monkeypatch.chdir(folder)
    model = tiny(1)
    model.save_pretrained(".")  # raised FileNotFoundError after saving, the process left in a deleted folder
    assert Path.cwd() == folder and os.path.samefile(".", folder)
    assert (Path.cwd() / "notes.txt").read_text() == "mine"
    assert torch.equal(weights_of(DCFormerForCausalLM.from_pretrained(".")), weights_of(model))
    assert "# model" in (folder / "README.md").read_text()  # named after the folder, not "."
    assert beside(folder) == ["model"]


def test_save_into_dotdot_from_a_subfolder(tmp_path, monkeypatch):
    folder = tmp_path / "model"
    tiny(0).save_pretrained(folder)
    (folder / "sub").mkdir()
    monkeypatch.chdir(folder / "sub")
    model = tiny(1)
    model.save_pretrained("..")  # copied the folder into itself ("File name too long")
    assert Path.cwd() == folder / "sub" and os.path.samefile(".", folder / "sub")
    assert torch.equal(weights_of(DCFormerForCausalLM.from_pretrained(folder)), weights_of(model))
    assert "# model" in (folder / "README.md").read_text()  # named after the folder, not ".."
    assert beside(folder) == ["model"]


def test_save_through_a_symlink_to_an_empty_folder(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    model = tiny()
    model.save_pretrained(tmp_path / "link")
    assert (tmp_path / "link").is_symlink() and (real / "model.safetensors").is_file()
    model.save_pretrained(tmp_path / "link")  # again, over a full folder: still through the link
    assert (tmp_path / "link").is_symlink() and os.readlink(tmp_path / "link") == str(real)
    assert torch.equal(weights_of(DCFormerForCausalLM.from_pretrained(tmp_path / "link")), weights_of(model))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]


# ----------------------------------------------------------------------------------------------------------------
# Concurrent saves and loads
# ----------------------------------------------------------------------------------------------------------------
SAVER = textwrap.dedent(
    """
    import json, sys, time, torch
    from modeling_dcformer import DCFormerConfig, DCFormerForCausalLM
    folder, tag, rounds, tiny = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
    torch.set_num_threads(1)
    for i in range(rounds):
        torch.manual_seed(100 * tag + i)
        # the saves differ in shape too, so that a mixed load would also be a size mismatch
        config = DCFormerConfig(**{**tiny, "intermediate_size": 32 * (1 + (tag + i) % 2)})
        model = DCFormerForCausalLM(config)
        with torch.no_grad():
            model.model.embed_tokens.weight.fill_(float(100 * tag + i))  # which save the weights come from
        model.config.marker = 100 * tag + i  # which save the config comes from
        model.save_pretrained(folder)
    """
)


def test_three_processes_saving_one_folder(tmp_path):
    folder = tmp_path / "model"
    procs = [
        subprocess.Popen([sys.executable, "-c", SAVER, str(folder), str(tag), "3", json.dumps(TINY)],
                         stderr=subprocess.PIPE, text=True)
        for tag in (1, 2, 3)
    ]
    errors = [proc.communicate(timeout=600)[1] for proc in procs]  # (the race was narrow: it does not always show)
    assert [proc.returncode for proc in procs] == [0, 0, 0], [e[-2000:] for e in errors]
    model = DCFormerForCausalLM.from_pretrained(folder)
    assert torch.all(weights_of(model) == model.config.marker)  # one whole save, the last one
    assert beside(folder) == ["model"]


def test_a_load_never_mixes_two_saves(tmp_path):
    """One process re-saves a folder in a loop (saves that differ in weights and shapes), this one loads it: every
    load takes the config and the weights of one save (before the redesign, about 1 in 6 loads mixed two saves and
    more failed with a spurious mismatch)."""
    folder = tmp_path / "model"
    tiny().save_pretrained(folder)
    saver = subprocess.Popen([sys.executable, "-c", SAVER, str(folder), "1", "100000", json.dumps(TINY)],
                             stderr=subprocess.PIPE, text=True)
    loads = 0
    try:
        deadline = time.monotonic() + 300
        while "marker" not in (folder / "config.json").read_text() and saver.poll() is None:  # the saver's first save
            assert time.monotonic() < deadline, "the saving process did not start"
            time.sleep(0.2)
        deadline = time.monotonic() + 40
        while loads < 60 and time.monotonic() < deadline:
            model = AutoModelForCausalLM.from_pretrained(folder)
            marker = model.config.marker
            assert torch.all(weights_of(model) == marker), "config and weights from two saves"
            assert model.config.intermediate_size == 32 * (1 + (1 + marker - 100) % 2)
            loads += 1
        assert saver.poll() is None, saver.communicate()[1][-2000:]  # still saving: every load overlapped saves
    finally:
        saver.kill()
        saver.communicate()
    assert loads >= 10


# ----------------------------------------------------------------------------------------------------------------
# from_pretrained's arguments behave as for any model
# ----------------------------------------------------------------------------------------------------------------
def test_subfolder_of_a_released_dcformer_plus_plus_checkpoint(tmp_path):
    src, _, _ = released_dir(tmp_path / "root", "sub", model_type="dcformer")
    direct = DCFormerForCausalLM.from_pretrained(src)
    # failed with "checkpoint lacks gate_proj": the config was read without the subfolder
    loaded = DCFormerForCausalLM.from_pretrained(tmp_path / "root", subfolder="sub")
    via_auto = AutoModelForCausalLM.from_pretrained(tmp_path / "root", subfolder="sub")
    assert loaded.config.use_gated_mlp and type(via_auto) is DCFormerForCausalLM
    for model in (loaded, via_auto):
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), direct.state_dict().values()))


def test_subfolder_of_our_layout(tmp_path):
    model = tiny(norm_type="rmsnorm", use_gated_mlp=True, hidden_act="silu", use_parallel_residual=False)
    model.save_pretrained(tmp_path / "root" / "sub")
    loaded = DCFormerForCausalLM.from_pretrained(tmp_path / "root", subfolder="sub")
    assert torch.equal(weights_of(loaded), weights_of(model))
    with pytest.raises(OSError):  # the root itself holds no model
        DCFormerForCausalLM.from_pretrained(tmp_path / "root")


# ----------------------------------------------------------------------------------------------------------------
# A file in the way, a name near the limit, a full disk: one line naming the folder, the old save whole
# ----------------------------------------------------------------------------------------------------------------
def tree(folder: Path) -> dict[str, bytes]:
    return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*")) if f.is_file()}


def test_saving_under_a_file_is_one_line_naming_it(tmp_path):
    (tmp_path / "f").write_text("a file")
    with pytest.raises(NotADirectoryError) as info:  # was FileExistsError "[Errno 17] File exists: '.../f'"
        tiny().save_pretrained(tmp_path / "f" / "m")
    assert "\n" not in str(info.value) and f"{tmp_path / 'f'} is a file, not a directory" in str(info.value)
    assert beside(tmp_path / "f") == ["f"] and (tmp_path / "f").read_text() == "a file"


def test_a_folder_name_of_250_bytes_saves_and_resaves(tmp_path):
    folder = tmp_path / ("m" * 250)  # its hidden siblings' names (".NAME.lock", ".NAME.tmp-...") were too long
    tiny(0).save_pretrained(folder)
    (folder / "tokenizer.json").write_text("{}")
    model = tiny(1)
    model.save_pretrained(folder)
    assert torch.equal(weights_of(DCFormerForCausalLM.from_pretrained(folder)), weights_of(model))
    assert (folder / "tokenizer.json").read_text() == "{}" and beside(folder) == [folder.name]


def safetensors_disk_full(*args, **kwargs):
    """What safetensors raises for a full disk: its own error type, the errno only in the message."""
    from safetensors import SafetensorError

    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def config_disk_full(*args, **kwargs):
    raise OSError(28, "No space left on device")


@pytest.mark.parametrize("where", ["weights", "config"])
def test_a_full_disk_keeps_the_old_save_and_is_one_line_naming_the_folder(tmp_path, monkeypatch, where):
    import transformers.modeling_utils
    from transformers import PretrainedConfig

    folder = tmp_path / "model"
    tiny(0).save_pretrained(folder)
    (folder / "tokenizer.json").write_text("{}")
    old = tree(folder)
    if where == "weights":
        monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", safetensors_disk_full)
    else:
        monkeypatch.setattr(PretrainedConfig, "save_pretrained", config_disk_full)
    with pytest.raises(OSError) as info:
        tiny(1).save_pretrained(folder)
    message = str(info.value)
    assert info.value.errno == 28 and "\n" not in message, message
    assert message.startswith(f"writing {folder} failed: ") and "No space left on device" in message
    assert "it was left as it was" in message and info.value.__suppress_context__
    assert tree(folder) == old and beside(folder) == ["model"]
    monkeypatch.undo()
    tiny(1).save_pretrained(folder)  # the next save, with space again
    assert tree(folder)["model.safetensors"] != old["model.safetensors"]
