"""modeling_dcformer.checkpoints.atomic_dir: a directory written beside its destination, then swapped in. Modes follow
the umask or the existing folder; ".", "..", symlinks (also to an empty folder) name the folder written; a failure or
a kill -9 leaves the old folder whole; concurrent writers take turns. Hidden folders, lock files, links and files of
another user (simulated) are neither put back, carried over nor followed; names near the 255-byte limit; a file above
the destination and a full disk are one line."""

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


KILLED_BETWEEN_THE_RENAMES = LOAD + textwrap.dedent(
    """
    import os, signal, sys
    atomic_dir._exchange = lambda a, b: False  # a system that cannot exchange two folders: two renames
    atomic_dir._put_in_place = lambda new, target: os.kill(os.getpid(), signal.SIGKILL)
    with atomic_dir.replacing(sys.argv[1]) as tmp:
        (tmp / "a").write_text("new")
    """
)


def test_an_old_copy_left_between_the_two_renames_is_put_back(tmp_path, caplog):
    """Where the system cannot exchange two folders, a kill between the two renames leaves the old copy whole under
    a hidden name: the next write puts it back before anything else."""
    write(tmp_path / "out", {"a": "old"})
    args = [sys.executable, "-c", KILLED_BETWEEN_THE_RENAMES, str(tmp_path / "out"), atomic_dir.__file__]
    assert subprocess.run(args, timeout=300).returncode == -9
    assert not (tmp_path / "out").exists()
    (aside,) = tmp_path.glob(".out.old-*")
    assert contents(aside) == {"a": "old"}  # the user's folder exactly as it was: no mark inside
    with pytest.raises(RuntimeError):
        with atomic_dir.replacing(tmp_path / "out"):
            assert contents(tmp_path / "out") == {"a": "old"}
            raise RuntimeError
    assert contents(tmp_path / "out") == {"a": "old"} and "previous copy was put back" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# ----------------------------------------------------------------------------------------------------------------
# Other users' files beside or inside the destination (simulated here; tests/test_shared_folders.py runs two users)
# ----------------------------------------------------------------------------------------------------------------
ME, THEM = 4242, 4343


@pytest.fixture
def owners(monkeypatch):
    """This process runs as uid ME; `owners(path, uid)` makes `path` and everything under it look owned by `uid`
    (the nearest such path above a file decides; anything else looks ours), `owners(path, uid, tree=False)` only
    `path` itself."""
    given, alone = {}, {}

    def owner(path):
        path = Path(os.path.abspath(path))
        if str(path) in alone:
            return alone[str(path)]
        for above in (path, *path.parents):
            if str(above) in given:
                return given[str(above)]
        return ME

    def own(path, uid, tree=True):
        (given if tree else alone)[str(path)] = uid

    monkeypatch.setattr(atomic_dir, "_uid", lambda: ME, raising=False)
    monkeypatch.setattr(atomic_dir, "_owner", owner, raising=False)
    return own


def plant(folder: Path, files: dict) -> Path:
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


PLANTED = {"tokenizer.json": "planted", "extra_code.py": "import os  # planted"}


def test_a_planted_sibling_is_never_put_back_or_carried_over(tmp_path, owners, caplog):
    """Another user who can write the parent folder plants hidden folders named like our leftovers (one with the
    old 8-hex name, one with a valid check in its name): the save neither puts them back nor takes their files."""
    out = tmp_path / "out"
    legacy = plant(tmp_path / ".out.old-0badf00d", PLANTED)
    forged = plant(atomic_dir._sibling(out, "old"), PLANTED)  # the name check is public: the owner is what counts
    forged_tmp = plant(atomic_dir._sibling(out, "tmp"), PLANTED)
    for path in (legacy, forged, forged_tmp):
        owners(path, THEM)
    write(out, {"a": "mine"}, keep=lambda name: True)
    assert contents(out) == {"a": "mine"}
    for path in (legacy, forged, forged_tmp):
        assert contents(path) == PLANTED  # left alone, and said so
        assert f"left {path} alone: " in caplog.text and f"another user (uid {THEM})" in caplog.text
    write(out, {"a": "again"}, keep=lambda name: True)  # again: still theirs alone, still not in the save
    assert contents(out) == {"a": "again"} and legacy.exists() and forged.exists()


def test_a_users_own_folder_named_like_a_leftover_is_left_alone(tmp_path, owners, caplog):
    """A folder of the user's own that this module did not make (no valid check in its name) is neither put back nor
    deleted; one this module made (its check) is."""
    out = tmp_path / "out"
    mine = plant(tmp_path / ".out.old-1234abcd", {"notes.txt": "mine"})
    unchecked = plant(tmp_path / ".out.tmp-0123456789abcdef", {"notes.txt": "mine"})
    write(out, {"a": "1"})
    assert contents(out) == {"a": "1"} and contents(mine) == contents(unchecked) == {"notes.txt": "mine"}
    assert "its name lacks this package's mark" in caplog.text
    ours = plant(atomic_dir._sibling(out, "tmp"), {"part": "x"})  # what a killed write of ours leaves
    write(out, {"a": "2"})
    assert not ours.exists() and f"removed {ours}" in caplog.text and mine.exists() and unchecked.exists()


def test_only_the_users_own_entries_are_carried_over(tmp_path, owners, caplog):
    out = tmp_path / "out"
    write(out, {"tokenizer.json": "mine", "notes.txt": "theirs", "keep.txt": "mine"})
    (out / "sub").mkdir()
    (out / "sub" / "x").write_text("theirs")
    (out / "own").mkdir()
    (out / "own" / "y").write_text("mine")
    (out / "link").symlink_to("tokenizer.json")
    owners(out / "notes.txt", THEM)
    owners(out / "sub" / "x", THEM)  # a folder with one file of another user's in it: left out whole
    before = (out / "tokenizer.json").stat().st_ino
    write(out, {"a": "new"}, keep=lambda name: True)
    assert contents(out) == {"a": "new", "tokenizer.json": "mine", "keep.txt": "mine", "link": "mine"}
    assert (out / "tokenizer.json").stat().st_ino == before  # the user's own file: linked, not copied
    assert (out / "own" / "y").read_text() == "mine" and os.readlink(out / "link") == "tokenizer.json"
    assert not (out / "sub").exists()
    assert f"not carried over into the new copy of {out}: notes.txt, sub (another user's)" in caplog.text


def test_a_file_linked_in_place_of_the_checked_one_is_dropped(tmp_path, owners, monkeypatch, caplog):
    """What was carried over is checked again: a file swapped in between the check and the link is removed."""
    out = tmp_path / "out"
    write(out, {"tokenizer.json": "mine"})
    real_link = os.link

    def swapped(src, dst, *args, **kwargs):
        real_link(src, dst, *args, **kwargs)
        owners(dst, THEM)  # (the inode another user put there)

    monkeypatch.setattr(atomic_dir.os, "link", swapped)
    write(out, {"a": "new"}, keep=lambda name: True)
    assert contents(out) == {"a": "new"} and "tokenizer.json (another user's)" in caplog.text


def test_a_lock_file_of_another_user_is_left_alone(tmp_path, owners, caplog):
    out = tmp_path / "out"
    planted = tmp_path / ".out.lock"
    planted.write_text("planted")
    owners(planted, THEM)
    assert atomic_dir.lock_file(out) == tmp_path / f".out.lock-{ME}"
    write(out, {"a": "1"})
    assert contents(out) == {"a": "1"} and planted.read_text() == "planted"
    assert f"left {planted} alone" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.lock", "out"]


def test_another_users_destination_in_a_sticky_folder_is_refused_at_once(tmp_path, owners):
    shared = tmp_path / "shared"
    (shared / "out").mkdir(parents=True)
    os.chmod(shared, 0o1777)
    owners(shared, 0, tree=False)
    owners(shared / "out", THEM)
    with pytest.raises(PermissionError) as info:
        write(shared / "out", {"a": "1"})
    message = str(info.value)
    assert "\n" not in message and str(shared / "out") in message and "sticky" in message
    assert sorted(p.name for p in shared.iterdir()) == ["out"]  # nothing written
    owners(shared, ME, tree=False)  # the folder's owner may replace entries in it: allowed
    write(shared / "out", {"a": "1"})
    assert contents(shared / "out") == {"a": "1"}


def test_the_users_own_destination_in_a_sticky_folder_is_saved_and_resaved(tmp_path, owners):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    owners(shared, 0, tree=False)
    write(shared / "out", {"a": "1", "tokenizer.json": "t"})
    write(shared / "out", {"a": "2"}, keep=lambda name: True)
    assert contents(shared / "out") == {"a": "2", "tokenizer.json": "t"}


def test_another_users_link_in_a_sticky_folder_is_refused(tmp_path, owners):
    """As Linux's protected_symlinks: in a world-writable sticky folder only links of this user or of the folder's
    owner are followed (before, another user's `shared/out` -> a folder of ours had that folder replaced)."""
    shared, thesis = tmp_path / "shared", tmp_path / "home" / "thesis"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    owners(shared, 0, tree=False)
    write(thesis, {"chapter1.tex": "years of work"})
    (shared / "out").symlink_to(thesis)
    owners(shared / "out", THEM, tree=False)
    with pytest.raises(PermissionError, match=f"{shared / 'out'} is a symbolic link of another user"):
        write(shared / "out", {"a": "1"}, keep=lambda name: True)
    with pytest.raises(PermissionError, match="symbolic link of another user"):  # also further up the path
        write(shared / "out" / "sub", {"a": "1"})
    assert contents(thesis) == {"chapter1.tex": "years of work"} and sorted(os.listdir(thesis)) == ["chapter1.tex"]
    for owner in (ME, 0):  # the user's own link, or the folder owner's: followed
        owners(shared / "out", owner, tree=False)
        write(shared / "out", {"a": str(owner)}, keep=lambda name: True)
        assert contents(thesis) == {"a": str(owner), "chapter1.tex": "years of work"}
    os.chmod(shared, 0o1775)  # not writable by everyone: links are followed as before
    owners(shared / "out", THEM, tree=False)
    write(shared / "out", {"a": "2"}, keep=lambda name: True)
    assert (shared / "out").is_symlink() and contents(thesis)["a"] == "2"


# ----------------------------------------------------------------------------------------------------------------
# Names near the limit, a file above the destination, a full disk
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["m" * 250, "é" * 127, "n" * 255], ids=["250-bytes", "254-bytes-utf8", "255-bytes"])
def test_names_near_the_limit(tmp_path, name, caplog):
    out = tmp_path / name
    write(out, {"a": "1", "tokenizer.json": "t"})
    write(out, {"a": "2"}, keep=lambda n: True)
    assert contents(out) == {"a": "2", "tokenizer.json": "t"}
    atomic_dir.write_file(out / "README.md", "card")
    proc = subprocess.run([sys.executable, "-c", KILLED, str(out), atomic_dir.__file__], timeout=300)
    assert proc.returncode == -9
    assert len([p for p in tmp_path.iterdir() if p.name != name and p.is_dir()]) == 1  # the killed write's copy
    write(out, {"a": "3"})
    assert contents(out) == {"a": "3"} and "interrupted write" in caplog.text
    assert [p.name for p in tmp_path.iterdir()] == [name]
    assert all(len(os.fsencode(p.name)) <= 255 for p in tmp_path.iterdir())


def test_a_file_above_the_destination_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    for destination in (tmp_path / "f" / "m", tmp_path / "f" / "a" / "m"):
        with pytest.raises(NotADirectoryError, match=f"{tmp_path / 'f'} is a file, not a directory"):
            write(destination, {"a": "1"})
    assert (tmp_path / "f").read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["f"]


class SafetensorError(Exception):
    """Stands for safetensors' own error type, which is not an OSError."""


@pytest.mark.parametrize("error", [
    OSError(28, "No space left on device", "/some/where/.out.tmp-1/model.safetensors"),
    SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
    OSError(122, "Disk quota exceeded"),
], ids=["oserror", "safetensors", "quota"])
def test_a_full_disk_is_one_line_naming_the_destination(tmp_path, error):
    out = tmp_path / "out"
    write(out, {"a": "old"})
    with pytest.raises(OSError) as info:
        with atomic_dir.replacing(out) as tmp:
            (tmp / "a").write_text("new")
            raise error
    err = info.value
    assert isinstance(err, atomic_dir.DestinationUnchanged) and err.errno in atomic_dir.DISK_FULL
    assert err.filename == str(out) and "\n" not in str(err)
    assert str(err).startswith(f"writing {out} failed: ") and "it was left as it was" in str(err)
    assert "No space left on device" in str(err) or "quota" in str(err)
    assert contents(out) == {"a": "old"} and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
