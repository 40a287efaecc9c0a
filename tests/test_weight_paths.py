"""Shard names that leave the checkpoint's folder: a `weight_map` entry `../outside/x.safetensors`, `sub/../../x` or an
absolute path is refused, in one line naming the index and the entry, by the converters (before anything is read,
converted or uploaded) and by `from_pretrained` (the package's reader refuses the index before transformers follows
it; the remote code alone refuses the weight files it was given outside the folder before reading them).

The neighbours that must keep working: a Hugging Face cache snapshot, whose every file is a symbolic link to
`../../blobs/<hash>` (the name is judged, not the file it leads to), a shard in a subfolder of the checkpoint, and a
checkpoint loaded with `subfolder`.
"""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import build_model, make_config, save_tiny_neox
from modeling_dcformer import DCFormerForCausalLM
from modeling_dcformer.checkpoints import weight_files
from modeling_dcformer.configuration_dcformer import PACKAGE
from modeling_dcformer.conversion import pythia as p2d
from modeling_dcformer.conversion import released as released_converter
from released_checkpoint import released_dir

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

INDEX = "model.safetensors.index.json"
SECOND = "model-00002-of-00002.safetensors"
ESCAPES = ["relative", "through-a-subfolder", "absolute"]


def split_in_two(folder: Path) -> None:
    """`folder`'s single `model.safetensors` as two shards and their index, as transformers writes them."""
    state = load_file(folder / "model.safetensors")
    keys = sorted(state)
    halves = [keys[: len(keys) // 2], keys[len(keys) // 2 :]]
    weight_map = {}
    for i, part in enumerate(halves, start=1):
        name = f"model-{i:05d}-of-00002.safetensors"
        save_file({key: state[key].contiguous() for key in part}, folder / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    total = sum(t.numel() * t.element_size() for t in state.values())
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (folder / "model.safetensors").unlink()


def rename_shard(folder: Path, old: str, new: str) -> None:
    index = json.loads((folder / INDEX).read_text())
    index["weight_map"] = {key: new if name == old else name for key, name in index["weight_map"].items()}
    (folder / INDEX).write_text(json.dumps(index))


def move_second_shard_out(folder: Path, escape: str) -> str:
    """The second shard moved beside `folder` (into `../outside/`) and the index naming it there as `escape` says:
    what a planted or hand-edited index looks like. Returns the name the index now holds."""
    outside = folder.parent / "outside"
    outside.mkdir(exist_ok=True)
    shutil.move(folder / SECOND, outside / SECOND)
    if escape == "absolute":
        name = str((outside / SECOND).resolve())
    elif escape == "through-a-subfolder":
        (folder / "sub").mkdir()
        name = f"sub/../../outside/{SECOND}"
    else:
        name = f"../outside/{SECOND}"
    rename_shard(folder, SECOND, name)
    return name


def as_hub_snapshot(folder: Path, root: Path) -> Path:
    """`folder` laid out as huggingface_hub's cache does: every file a symbolic link `../../blobs/<sha256>` in
    `models--org--tiny/snapshots/<commit>/`. Returns the snapshot folder."""
    repo = root / "models--org--tiny"
    snapshot = repo / "snapshots" / ("0123456789abcdef" * 3)[:40]
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in sorted(folder.iterdir()):
        if file.is_file():
            sha = hashlib.sha256(file.read_bytes()).hexdigest()
            shutil.copyfile(file, repo / "blobs" / sha)
            (snapshot / file.name).symlink_to(Path("..", "..", "blobs", sha))
    return snapshot


# ----------------------------------------------------------------------------------------------------------------
# The rule
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["model-00001-of-00002.safetensors", "shards/model-00001-of-00002.safetensors",
                                  "./model.safetensors", "pytorch_model-00001-of-00003.bin", "a..b.safetensors"])
def test_names_inside_the_folder_pass(name):
    assert weight_files.shard_name_problem(name) is None


@pytest.mark.parametrize("name", ["../x.safetensors", "a/../../x.safetensors", "a/../x.safetensors", "/etc/x",
                                  "..\\x.safetensors", "sub\\x.safetensors", "C:x.safetensors", "C:\\x.safetensors",
                                  "\\\\server\\share\\x", "", ".", "..", None, 3])
def test_names_leaving_the_folder_are_refused(name):
    assert weight_files.shard_name_problem(name)


# ----------------------------------------------------------------------------------------------------------------
# The converters
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture(params=["pythia", "released"])
def source(request, tmp_path):
    """(converter module, a two-shard source checkpoint, extra arguments) for each converter."""
    if request.param == "pythia":
        save_tiny_neox(tmp_path / "src")
        split_in_two(tmp_path / "src")
        return p2d, tmp_path / "src", ["--no-verify"]
    folder = released_dir(tmp_path, "src", num_shards=2)[0]
    return released_converter, folder, []


@pytest.mark.parametrize("escape", ESCAPES)
def test_converters_refuse_a_shard_outside_the_source(source, escape, tmp_path, capsys):
    tool, src, extra = source
    name = move_second_shard_out(src, escape)
    code = tool.main([str(src), str(tmp_path / "out"), *extra])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert str(src / INDEX) in lines[0] and repr(name) in lines[0] and "refused" in lines[0], lines[0]
    assert not (tmp_path / "out").exists()  # nothing converted


def test_converters_read_a_hub_snapshot_of_symbolic_links_and_a_shard_in_a_subfolder(source, tmp_path):
    tool, src, extra = source
    assert tool.main([str(src), str(tmp_path / "plain"), *extra]) == 0
    snapshot = as_hub_snapshot(src, tmp_path / "hub")
    assert all(p.is_symlink() for p in snapshot.iterdir())
    assert tool.main([str(snapshot), str(tmp_path / "linked"), *extra]) == 0
    (src / "shards").mkdir()
    shutil.move(src / SECOND, src / "shards" / SECOND)
    rename_shard(src, SECOND, f"shards/{SECOND}")
    assert tool.main([str(src), str(tmp_path / "nested"), *extra]) == 0
    plain = load_file(tmp_path / "plain" / "model.safetensors")
    for name in ("linked", "nested"):
        again = load_file(tmp_path / name / "model.safetensors")
        assert plain.keys() == again.keys() and all(torch.equal(plain[k], again[k]) for k in plain), name


# ----------------------------------------------------------------------------------------------------------------
# from_pretrained
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A tiny DCFormer saved in two shards, and the model."""
    model = build_model(make_config(), seed=0).eval()
    folder = tmp_path_factory.mktemp("weight-paths") / "m"
    model.save_pretrained(folder, model_card=False, max_shard_size="150KB")
    names = sorted(p.name for p in folder.glob("model-*.safetensors"))
    assert names == ["model-00001-of-00002.safetensors", SECOND], names
    return folder, model


def copy_of(sharded, tmp_path, name="m") -> Path:
    shutil.copytree(sharded[0], tmp_path / name, symlinks=True)
    return tmp_path / name


def same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(params=["package", "remote-code"])
def reader(request, monkeypatch):
    """Loads as the installed package does, or as a save's remote code alone (without `PACKAGE.loading`: plain
    transformers' `from_pretrained` with the flat modules' checks)."""
    if request.param == "remote-code":
        monkeypatch.setattr(PACKAGE, "loading", None)
    return request.param


@pytest.mark.parametrize("escape", ESCAPES)
def test_from_pretrained_refuses_a_shard_outside_the_folder(sharded, tmp_path, escape, reader):
    folder = copy_of(sharded, tmp_path)
    name = move_second_shard_out(folder, escape)
    with pytest.raises(ValueError) as caught:
        DCFormerForCausalLM.from_pretrained(folder)
    message = str(caught.value)
    assert "\n" not in message and "refused" in message, message
    if reader == "package":  # the index and the entry, before transformers reads anything
        assert str(folder / INDEX) in message and repr(name) in message, message
    else:  # the remote code alone: the file transformers was sent to
        assert SECOND in message and str(folder) in message, message


def test_from_pretrained_with_subfolder_refuses_an_index_leaving_it(sharded, tmp_path):
    """`subfolder` names the checkpoint's folder: "../x" leaves it, even into the repository around it."""
    root = tmp_path / "repo"
    folder = copy_of(sharded, root, "sub")
    shutil.move(folder / SECOND, root / SECOND)
    rename_shard(folder, SECOND, f"../{SECOND}")
    with pytest.raises(ValueError, match=f"{INDEX}: the weight_map entry .*'../{SECOND}'"):
        DCFormerForCausalLM.from_pretrained(root, subfolder="sub")


def test_symbolic_links_subfolders_and_subfolder_loads_still_load(sharded, tmp_path, reader):
    """The neighbours: a Hub cache snapshot (every file a link to ../../blobs), a shard in a subfolder of the
    checkpoint, a load with `subfolder`."""
    _, model = sharded
    snapshot = as_hub_snapshot(sharded[0], tmp_path / "hub")
    assert (snapshot / SECOND).is_symlink()
    assert same_weights(DCFormerForCausalLM.from_pretrained(snapshot), model)
    folder = copy_of(sharded, tmp_path / "repo", "sub")
    (folder / "shards").mkdir()
    shutil.move(folder / SECOND, folder / "shards" / SECOND)
    rename_shard(folder, SECOND, f"shards/{SECOND}")
    assert same_weights(DCFormerForCausalLM.from_pretrained(folder), model)
    assert same_weights(DCFormerForCausalLM.from_pretrained(tmp_path / "repo", subfolder="sub"), model)


def test_the_unreadable_index_diagnosis_names_an_escaping_entry_and_reads_nothing_outside(sharded, tmp_path):
    """After a failed load the package names what is wrong with the index: an entry leaving the folder is named as
    such, and the file it leads to is not opened (here: not a safetensors file, which would be the diagnosis)."""
    folder = copy_of(sharded, tmp_path)
    move_second_shard_out(folder, "relative")
    (tmp_path / "outside" / SECOND).write_bytes(b"not a safetensors file")
    problem = weight_files.describe_unreadable(folder)
    assert problem is not None and problem.startswith(str(folder / INDEX)) and "refused" in problem, problem
