"""modeling_dcformer.checkpoints.atomic_dir: a directory written beside its destination, then swapped in. Modes follow
the umask or the existing folder; ".", "..", symlinks (also to an empty folder) name the folder written; a failure or
a kill -9 leaves the old folder whole; concurrent writers take turns."""

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from modeling_dcformer.checkpoints import atomic_dir


def write(destination, files: dict, **kwargs):
    with atomic_dir.replacing(destination, **kwargs) as tmp:
        for name, text in files.items():
            (tmp / name).write_text(text)
    return tmp


def contents(folder: Path) -> dict:
    return {p.name: p.read_text() for p in folder.iterdir() if p.is_file()}


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_new_folder_gets_the_umask_mode(tmp_path, umask_022):
    write(tmp_path / "out", {"a": "1"})
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o755  # what mkdir gives; mkdtemp would give 0700
    assert stat.S_IMODE((tmp_path / "out" / "a").stat().st_mode) == 0o644


def test_existing_folder_keeps_its_mode(tmp_path, umask_022):
    out = tmp_path / "shared"
    out.mkdir()
    os.chmod(out, 0o2775)
    (out / "old").write_text("x")
    write(out, {"a": "1"})
    assert stat.S_IMODE(out.stat().st_mode) == 0o2775 and contents(out) == {"a": "1"}


def test_failure_leaves_the_old_folder_whole(tmp_path):
    write(tmp_path / "out", {"a": "old", "b": "old"})
    with pytest.raises(RuntimeError):
        with atomic_dir.replacing(tmp_path / "out") as tmp:
            (tmp / "a").write_text("new")
            raise RuntimeError("disk full")
    assert contents(tmp_path / "out") == {"a": "old", "b": "old"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing left beside it


def test_keep_carries_over_old_entries(tmp_path):
    write(tmp_path / "out", {"tokenizer.json": "tok", "model.bin": "old", "a": "old"})
    write(tmp_path / "out", {"a": "new"}, keep=lambda name: name != "model.bin")
    assert contents(tmp_path / "out") == {"a": "new", "tokenizer.json": "tok"}


def test_overwrite_false_takes_only_an_empty_destination(tmp_path):
    (tmp_path / "empty").mkdir()
    write(tmp_path / "empty", {"a": "1"}, overwrite=False)
    assert contents(tmp_path / "empty") == {"a": "1"}
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        write(tmp_path / "empty", {"a": "2"}, overwrite=False)
    assert contents(tmp_path / "empty") == {"a": "1"}


def test_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        write(tmp_path / "f", {"a": "1"})
    assert (tmp_path / "f").read_text() == "x"


def test_dot_and_dotdot_from_inside(tmp_path, monkeypatch):
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    monkeypatch.chdir(out)
    write(".", {"a": "1"}, keep=lambda name: True)
    assert Path.cwd() == out and os.path.samefile(".", out)  # not left in the deleted old copy
    assert contents(out) == {"a": "1"} and (out / "sub").is_dir()
    monkeypatch.chdir(out / "sub")
    write("..", {"b": "2"}, keep=lambda name: True)
    assert Path.cwd() == out / "sub" and os.path.samefile(".", out / "sub")
    assert contents(out) == {"a": "1", "b": "2"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing copied into itself or left beside


def test_symlinks_are_written_through(tmp_path):
    real = tmp_path / "real"
    real.mkdir()  # empty: taken like an absent folder
    (tmp_path / "link").symlink_to(real)
    write(tmp_path / "link", {"a": "1"})
    assert (tmp_path / "link").is_symlink() and contents(real) == {"a": "1"}
    write(tmp_path / "link", {"a": "2"}, overwrite=True)
    assert (tmp_path / "link").is_symlink() and contents(real) == {"a": "2"}
    (tmp_path / "dangling").symlink_to(tmp_path / "later")
    write(tmp_path / "dangling", {"c": "3"})
    assert contents(tmp_path / "later") == {"c": "3"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "later", "link", "real"]


# The writers load atomic_dir alone (not the package, whose torch import takes long on a busy machine).
LOAD = textwrap.dedent(
    """
    import importlib.util, sys
    spec = importlib.util.spec_from_file_location("atomic_dir", sys.argv[-1])
    atomic_dir = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(atomic_dir)
    """
)
WRITER = LOAD + textwrap.dedent(
    """
    import sys, time
    target, tag, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    for i in range(rounds):
        with atomic_dir.replacing(target) as tmp:
            for n in range(5):
                (tmp / f"part{n}").write_text(f"{tag}-{i}")
                time.sleep(0.002)
    """
)


def test_three_processes_writing_one_folder(tmp_path):
    out = tmp_path / "out"
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(out), tag, "6", atomic_dir.__file__],
                              stderr=subprocess.PIPE, text=True)
             for tag in "abc"]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], errors
    values = set(contents(out).values())
    assert len(values) == 1 and len(contents(out)) == 5  # one whole write, never a mix
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


KILLED = LOAD + textwrap.dedent(
    """
    import os, signal, sys
    with atomic_dir.replacing(sys.argv[1]) as tmp:
        (tmp / "a").write_text("new")
        os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_kill_mid_write_leaves_the_old_folder_and_the_next_write_cleans_up(tmp_path, caplog):
    write(tmp_path / "out", {"a": "old"})
    proc = subprocess.run([sys.executable, "-c", KILLED, str(tmp_path / "out"), atomic_dir.__file__], timeout=300)
    assert proc.returncode == -9
    assert contents(tmp_path / "out") == {"a": "old"}
    assert any(p.name.startswith(".out.tmp-") for p in tmp_path.iterdir())  # the killed writer's copy
    write(tmp_path / "out", {"a": "next"})
    assert contents(tmp_path / "out") == {"a": "next"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_an_old_copy_left_between_the_two_renames_is_put_back(tmp_path):
    """Where the system cannot exchange two folders, a crash between the two renames leaves the old copy whole under
    a hidden name: the next write puts it back before anything else."""
    write(tmp_path / "out", {"a": "old"})
    os.rename(tmp_path / "out", tmp_path / ".out.old-1234abcd")
    with pytest.raises(RuntimeError):
        with atomic_dir.replacing(tmp_path / "out"):
            assert contents(tmp_path / "out") == {"a": "old"}
            raise RuntimeError
    assert contents(tmp_path / "out") == {"a": "old"}
