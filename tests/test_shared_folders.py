"""Saving into folders other users can write, with two real users: a save into a sticky shared folder (mode 1777)
works and can be repeated; hidden folders and lock files another user planted beside the destination are left alone
(not put back, not carried into the save, said so); another user's destination in a sticky folder is refused in one
line, and so is another user's symbolic link there (the rule of Linux's protected_symlinks: a save through it would
replace the folder it points to); a save over another user's folder in a plain shared one holds none of their files.

The users are two uids without a login (setpriv, as root). They run `atomic_dir.py` itself, the module every save and
conversion writes through; their interpreter may not see this environment's packages (here they live under a private
home), so it gets a copy of filelock and a stand-in for `transformers.utils.logging` (Python's logging). Without root or
setpriv the tests are skipped: tests/test_atomic_dir.py simulates the other owner everywhere."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import filelock
import pytest

from modeling_dcformer.checkpoints import atomic_dir

PLANTER, VICTIM = 4242, 4243  # two users of the machine (their uids; no account needed)
PLANTED = {"tokenizer.json": "planted", "extra_code.py": "import os  # planted"}

SETUP = """
import json, logging, os, sys
sys.path.insert(0, sys.argv[1])
logging.basicConfig(format="%(levelname)s %(message)s")
import atomic_dir
"""
# The victim writes `files` into the destination (carrying over what it may, as save_pretrained does) and reports
# what the destination then holds (owner, links, text) or the error, as JSON.
SAVE = SETUP + textwrap.dedent(
    """
    target, files = sys.argv[2], json.loads(sys.argv[3])
    try:
        with atomic_dir.replacing(target, keep=lambda name: True) as tmp:
            for name, text in files.items():
                (tmp / name).write_text(text)
    except Exception as err:
        print(json.dumps({"error": type(err).__name__, "message": str(err)}))
        sys.exit(0)
    held = {}
    for entry in os.scandir(target):
        info = entry.stat(follow_symlinks=False)
        held[entry.name] = {"uid": info.st_uid, "links": info.st_nlink, "text": open(entry.path).read()}
    print(json.dumps({"files": held}))
    """
)
# A user makes folders (with files), files and symbolic links ([target]) at the given paths.
PLANT = textwrap.dedent(
    """
    import json, os, sys
    for path, content in json.loads(sys.argv[1]).items():
        if isinstance(content, list):
            os.symlink(content[0], path)
        elif isinstance(content, dict):
            os.mkdir(path)
            for name, text in content.items():
                with open(os.path.join(path, name), "w") as handle:
                    handle.write(text)
        else:
            with open(path, "w") as handle:
                handle.write(content)
    """
)


class Users:
    def __init__(self, base: Path, lib: Path, python: str):
        self.base, self.lib, self.python = base, lib, python

    def run(self, uid: int, script: str, *args: str) -> subprocess.CompletedProcess:
        command = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", self.python, "-c", script, *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=self.base)

    def save(self, target: Path, files: dict) -> tuple[dict, str]:
        """The victim's save: (what it reports, its log)."""
        done = self.run(VICTIM, SAVE, str(self.lib), str(target), json.dumps(files))
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout), done.stderr

    def plant(self, content: dict, uid: int = PLANTER) -> None:
        done = self.run(uid, PLANT, json.dumps({str(path): value for path, value in content.items()}))
        assert done.returncode == 0, done.stderr[-3000:]

    def folder(self, name: str, mode: int) -> Path:
        shared = self.base / name
        shared.mkdir()
        os.chmod(shared, mode)
        return shared


@pytest.fixture(scope="module")
def users():
    if sys.platform != "linux" or os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("two real users need root and setpriv (tests/test_atomic_dir.py simulates them)")
    base = Path(tempfile.mkdtemp(prefix="dcformer-shared-"))
    try:
        os.chmod(base, 0o755)
        lib = base / "lib"
        (lib / "transformers" / "utils").mkdir(parents=True)
        shutil.copy(atomic_dir.__file__, lib / "atomic_dir.py")
        shutil.copytree(Path(filelock.__file__).parent, lib / "filelock",
                        ignore=shutil.ignore_patterns("__pycache__"))
        (lib / "transformers" / "__init__.py").write_text("")
        (lib / "transformers" / "utils" / "__init__.py").write_text(
            "import logging as _logging\n\n\nclass logging:\n    get_logger = staticmethod(_logging.getLogger)\n")
        for path in [lib, *lib.rglob("*")]:
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        for python in dict.fromkeys([sys.executable, shutil.which("python3"), "/usr/bin/python3"]):
            if python and Users(base, lib, python).run(VICTIM, SETUP, str(lib)).returncode == 0:
                yield Users(base, lib, python)
                return
        pytest.skip("no Python interpreter that another user can run imports atomic_dir")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def sibling(target: Path, kind: str) -> Path:
    """A name with a valid check, as the planter can compute it too (the check is public; the owner is not)."""
    return atomic_dir._sibling(target, kind)


def test_a_user_saves_and_resaves_in_a_sticky_shared_folder(users):
    shared = users.folder("sticky-own", 0o1777)
    first, _ = users.save(shared / "m", {"a": "1", "tokenizer.json": "t"})
    assert set(first["files"]) == {"a", "tokenizer.json"}
    again, log = users.save(shared / "m", {"a": "2"})
    assert {name: f["text"] for name, f in again["files"].items()} == {"a": "2", "tokenizer.json": "t"}, log
    assert {f["uid"] for f in again["files"].values()} == {VICTIM}
    assert sorted(p.name for p in shared.iterdir()) == ["m"]


@pytest.mark.parametrize("mode", [0o1777, 0o777], ids=["sticky", "plain"])
def test_planted_siblings_are_left_alone_and_never_in_the_save(users, mode):
    """Before: in a sticky folder the save failed (PermissionError renaming the planted folder); in a plain one the
    planted folder became the destination and its files were carried into the save."""
    shared = users.folder(f"planted-{mode:o}", mode)
    target = shared / "m"
    planted = [shared / ".m.old-0badf00d", sibling(target, "old"), sibling(target, "tmp")]
    users.plant({path: PLANTED for path in planted})
    saved, log = users.save(target, {"a": "mine"})
    assert "error" not in saved, saved
    assert {name: (f["text"], f["uid"], f["links"]) for name, f in saved["files"].items()} == {"a": ("mine", VICTIM, 1)}
    for path in planted:
        assert path.stat().st_uid == PLANTER and {p.name for p in path.iterdir()} == set(PLANTED)
        assert f"left {path} alone: " in log and f"another user (uid {PLANTER})" in log
    resaved, _ = users.save(target, {"a": "again"})  # the victim's own save is re-saved: still only theirs
    assert {name: f["text"] for name, f in resaved["files"].items()} == {"a": "again"}


@pytest.mark.parametrize("mode", [0o1777, 0o777], ids=["sticky", "plain"])
def test_a_planted_lock_file_is_left_alone(users, mode):
    """Before: filelock refused the other user's lock file (sticky) or could not open it (plain): no save."""
    shared = users.folder(f"lock-{mode:o}", mode)
    users.plant({shared / ".m.lock": "planted"})
    saved, log = users.save(shared / "m", {"a": "mine"})
    assert {name: f["text"] for name, f in saved.get("files", {}).items()} == {"a": "mine"}, saved
    assert f"left {shared / '.m.lock'} alone" in log and (shared / ".m.lock").read_text() == "planted"
    assert sorted(p.name for p in shared.iterdir()) == [".m.lock", "m"]


def test_another_users_destination_in_a_sticky_folder_is_one_line(users):
    shared = users.folder("theirs-sticky", 0o1777)
    users.plant({shared / "m": {"theirs.txt": "theirs"}})
    saved, _ = users.save(shared / "m", {"a": "mine"})
    assert saved["error"] == "PermissionError" and "\n" not in saved["message"], saved
    assert str(shared / "m") in saved["message"] and f"another user (uid {PLANTER})" in saved["message"]
    assert "sticky bit" in saved["message"]  # before: "[Errno 1] Operation not permitted: '.../m' -> '.../.m.old-...'"
    assert sorted(p.name for p in shared.iterdir()) == ["m"]  # nothing written
    assert [p.name for p in (shared / "m").iterdir()] == ["theirs.txt"]


def test_a_save_over_another_users_folder_in_a_plain_shared_folder_holds_none_of_their_files(users):
    """Where the parent lets anyone rename anything, the victim's save may replace a folder someone else put there
    (as before), but carries over none of its files (before: their files, as copies or links, were in the save)."""
    shared = users.folder("theirs-plain", 0o777)
    users.plant({shared / "m": PLANTED})
    saved, log = users.save(shared / "m", {"a": "mine"})
    assert {name: (f["text"], f["uid"]) for name, f in saved["files"].items()} == {"a": ("mine", VICTIM)}, log
    assert "not carried over" in log and "extra_code.py" in log


def test_another_users_link_in_a_sticky_folder_is_not_followed(users):
    """The planter's `shared/m` points at a folder of the victim's: before, the victim's save replaced that folder
    (its files deleted). The victim's own link there is followed, as before."""
    shared = users.folder("links", 0o1777)
    home = users.folder("victim-home", 0o755)
    os.chown(home, VICTIM, VICTIM)
    users.plant({home / "thesis": {"chapter1.tex": "years of work"}}, uid=VICTIM)
    users.plant({shared / "m": [str(home / "thesis")]})
    saved, _ = users.save(shared / "m", {"a": "mine"})
    assert saved.get("error") == "PermissionError" and "\n" not in saved["message"], saved
    assert f"{shared / 'm'} is a symbolic link of another user (uid {PLANTER})" in saved["message"]
    assert [p.name for p in (home / "thesis").iterdir()] == ["chapter1.tex"]
    users.plant({shared / "mine": [str(home / "thesis")]}, uid=VICTIM)
    saved, _ = users.save(shared / "mine", {"a": "mine"})
    assert set(saved["files"]) == {"a", "chapter1.tex"} and (shared / "mine").is_symlink()
