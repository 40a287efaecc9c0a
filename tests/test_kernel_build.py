"""Building the CPU kernel under races and faults: two first-time builds at once into a fresh
`$DCFORMER_CACHE` both succeed (one builds while the other waits on the entry's lock, then loads the stamped
build); a build folder replaced by a file is rebuilt; a cache root that is a file is one clear reason; under
"auto" a failed build is a warning and eager's numbers. On a shared machine nothing is loaded from where another
user could have put it (`check_private`), and what a build makes only its user can write."""

import hashlib
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

from helpers import VOCAB, assert_close, build_model, make_config, registered
from modeling_dcformer.kernels import build, dcmha_cpu

pytestmark = pytest.mark.usefixtures("one_thread_each_test")

# The build machinery (cache entry, lock, stamp, private folder, swap) does not depend on what it compiles: these
# tests build a one-line stand-in source (about a second) instead of the kernel (about 30 s each, three times); the
# kernel itself is built and checked by test_dcmha_cpu.py.
STAND_IN = 'extern "C" int dcformer_build_probe() { return 42; }  // a stand-in for csrc/dcmha_cpu.cpp\n'

BUILD_AND_LOAD = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from modeling_dcformer.kernels.build import OperatorLibrary
    library = OperatorLibrary(Path(sys.argv[1]))
    library.load()
    print("ok", library.loaded)
    """
)


def stand_in(tmp_path) -> tuple[build.OperatorLibrary, list[str], dict]:
    """The stand-in source as a library, the command that builds and loads it in a fresh process, and an
    environment whose `$DCFORMER_CACHE` is `tmp_path / "cache"`."""
    source = tmp_path / "stand_in.cpp"
    source.write_text(STAND_IN + f"// {tmp_path.name}\n")  # one cache entry (and extension name) per test
    env = dict(os.environ, DCFORMER_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    return build.OperatorLibrary(source), [sys.executable, "-c", BUILD_AND_LOAD, str(source)], env


def entry(tmp_path, library) -> Path:
    """The stand-in's cache entry (computed under the tests' `$DCFORMER_CACHE`)."""
    return tmp_path / "cache" / library.folder(build.find_compiler()).name


def test_two_first_time_builds_at_once_both_succeed(tmp_path):
    library, command, env = stand_in(tmp_path)
    runs = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]  # fmt: skip
    for run in runs:
        out, err = run.communicate(timeout=600)
        assert run.returncode == 0, err[-3000:]
        assert "ok True" in out
    entries = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len([e for e in entries if not e.endswith(".lock")]) == 1, entries  # no private build folder left
    folder = entry(tmp_path, library)
    assert folder.is_dir(), entries
    assert (folder / build.STAMP).read_text().strip() == build.file_sha256(folder / f"{folder.name}.so")


@pytest.fixture
def in_process(tmp_path, monkeypatch, caplog):
    """Builds of the stand-in in this process (a subprocess costs seconds of imports): `$DCFORMER_CACHE` is
    `tmp_path / "cache"`, and the warnings of the build are captured."""
    monkeypatch.setenv("DCFORMER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(logging.getLogger("modeling_dcformer.kernels.build"), "propagate", True)
    caplog.set_level(logging.WARNING, logger="modeling_dcformer.kernels.build")
    return stand_in(tmp_path)[0]


def never_build(folder, cxx):
    raise AssertionError(f"built {folder} again")


def test_a_build_folder_replaced_by_a_file_is_rebuilt(tmp_path, in_process, caplog):
    folder = entry(tmp_path, in_process)
    folder.parent.mkdir()
    folder.write_text("not a folder\n")
    in_process.load()
    assert in_process.loaded and "incomplete or corrupt: rebuilding" in caplog.text
    assert folder.is_dir() and (folder / build.STAMP).is_file()


def test_a_corrupt_cached_build_is_rebuilt_not_loaded(tmp_path, in_process, caplog, monkeypatch):
    """A cached library that does not match its stamp (a crash mid-write, a corrupt disk) is rebuilt with a warning,
    never loaded (loading a truncated kernel crashed the process with a bus error); the rebuilt one then loads
    without a build."""
    folder = entry(tmp_path, in_process)
    folder.mkdir(parents=True)
    library = folder / f"{folder.name}.so"
    library.write_bytes(b"\x7fELF" + bytes(60))  # the start of a library whose write was cut short
    (folder / build.STAMP).write_text("0" * 64 + "\n")
    loaded = []
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    in_process.load()
    assert "incomplete or corrupt: rebuilding" in caplog.text
    assert str(library) not in loaded, "the truncated library was loaded"
    assert (folder / build.STAMP).read_text().strip() == build.file_sha256(library)
    assert library.stat().st_size > 64
    caplog.clear()
    later = stand_in(tmp_path)[0]
    monkeypatch.setattr(later, "build", never_build)
    later.load()
    assert later.loaded and loaded[-1] == str(library) and "rebuilding" not in caplog.text


def test_a_cache_root_that_is_a_file_is_one_clear_reason(monkeypatch, tmp_path):
    root = tmp_path / "cache"
    root.write_text("")
    monkeypatch.setenv("DCFORMER_CACHE", str(root))
    library = build.OperatorLibrary(tmp_path / "never_built.cpp")
    (tmp_path / "never_built.cpp").write_text("// not built\n")
    with pytest.raises(RuntimeError, match=rf"the kernel cache {root} \(\$DCFORMER_CACHE\) is a file, not a folder"):
        library.load()


def test_auto_warns_when_the_build_fails_and_computes_eagerly(monkeypatch, tmp_path, caplog):
    """The docs promise a warning when a backend cannot be built; "auto" then gives eager's numbers."""
    source = tmp_path / "broken.cpp"
    source.write_text("this is not C++;\n")
    monkeypatch.setenv("DCFORMER_CACHE", str(tmp_path / "cache"))
    model = build_model(make_config(num_hidden_layers=1, dcmha_implementation="eager"))
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(0))
    logger = logging.getLogger("modeling_dcformer.kernels.dcmha_cpu")
    monkeypatch.setattr(logger, "propagate", True)
    broken = dcmha_cpu.CPUBackend(build.OperatorLibrary(source))
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="modeling_dcformer.kernels.dcmha_cpu"), \
            registered("cpu", broken):
        expected = model(ids).logits
        model.config.dcmha_implementation = "auto"
        assert_close(model(ids).logits, expected)
        model(ids)  # the failure is remembered: one warning, not one per call
    warnings = [r.getMessage() for r in caplog.records if "cannot be built here" in r.getMessage()]
    assert len(warnings) == 1 and 'dcmha_implementation="auto" does without it' in warnings[0]


def test_the_build_key_covers_the_compiler_flags():
    """A backend built with other flags (benchmarks/ab_kernel_source.py's variants) gets its own cache entry; the
    default flags keep the kernel's entry, so existing builds stay valid."""
    source = dcmha_cpu.SOURCE
    default = build.OperatorLibrary(source).folder("c++")
    assert build.OperatorLibrary(source, cflags=build.CFLAGS).folder("c++") == default
    assert build.OperatorLibrary(source, cflags=[*build.CFLAGS, "-DX=1"]).folder("c++") != default
    assert default.name.startswith("dcmha_cpu_")  # the entry of the kernel's earlier builds: they stay valid


# ----------------------------------------------------------------------------------------------------------------
# A shared machine: nothing is loaded from a cache folder or file that another user owns or could write
# ----------------------------------------------------------------------------------------------------------------
OTHER = 65534  # nobody


@pytest.fixture
def give_away(monkeypatch):
    """`give_away(path)` makes `path` (itself: a symlink, not what it points to) another user's: really (chown to
    uid 65534) where the tests run as root, else in what `check_private` sees of it (`os.lstat`)."""
    faked = set()
    if os.geteuid() != 0:
        real_lstat = os.lstat

        def lstat(path, *args, **kwargs):
            st = real_lstat(path, *args, **kwargs)
            if os.fspath(path) not in faked:
                return st
            return os.stat_result((*st[:4], OTHER, OTHER, *st[6:10]))

        monkeypatch.setattr(build.os, "lstat", lstat)

    def give(path: Path) -> Path:
        if os.geteuid() == 0:
            os.lchown(path, OTHER, OTHER)
        else:
            faked.add(str(path))
        return path

    return give


def folder(path: Path, mode: int = 0o700) -> Path:
    path.mkdir(parents=True)
    path.chmod(mode)
    return path


def link(path: Path, target) -> Path:
    path.symlink_to(target)
    return path


def touch(path: Path) -> Path:
    path.write_bytes(b"")
    return path


# name: (lays out a case under tmp_path with `give_away` and returns the path to check, a pattern of the refusal;
# None: accepted)
PRIVACY_CASES = {
    "world-writable cache (DCFORMER_CACHE=/shared)": (
        lambda t, give: folder(t / "shared", 0o1777), r"other users can write it \(mode 1777\).*`chmod go-w "),
    "group-writable cache": (lambda t, give: folder(t / "cache", 0o770), r"other users can write it \(mode 0770\)"),
    "a world-writable folder above it, not sticky": (
        lambda t, give: folder(folder(t / "open", 0o777) / "me"), r"other users can write .*/open \(mode 0777\)"),
    "another user's cache": (
        lambda t, give: give(folder(t / "cache")), r"it belongs to .*uid 65534\), not to you: remove it, or set"),
    "another user's folder above it": (
        lambda t, give: folder(give(folder(t / "theirs")) / "me"), r"the folder .*/theirs above it belongs to"),
    "another user's library in the user's cache": (
        lambda t, give: give(touch(folder(t / "cache") / "x.so")), "it belongs to"),
    "another user's symlink to the user's folder": (
        lambda t, give: give(link(t / "ln", folder(t / "mine"))), r"the symlink .*/ln belongs to"),
    "the user's symlink to a world-writable folder": (
        lambda t, give: link(t / "ln", folder(t / "shared", 0o1777)), r"other users can write .*/shared "),
    "the user's symlink into a folder others can write": (
        lambda t, give: link(t / "ln", folder(folder(t / "open", 0o777) / "me")) / "cache", r"write .*/open \("),
    "a symlink loop": (lambda t, give: link(t / "loop", "loop"), "form a loop"),
    "'..' after a symlink, as the system resolves it (into a folder others can write)": (
        lambda t, give: (folder(folder(t / "open", 0o777) / "c"), link(folder(t / "a") / "ln", "../open/c") / "..")[1],
        r"other users can write .*/open \(mode 0777\)"),
    # the legitimate neighbours
    "the user's folder in a sticky shared folder": (lambda t, give: folder(folder(t / "shared", 0o1777) / "x"), None),
    "a cache yet to be made in the user's folder in a sticky shared folder": (
        lambda t, give: folder(folder(t / "shared", 0o1777) / "x") / "dcformer", None),
    "the user's symlink to the user's folder (~/.cache -> /scratch/me/cache)": (
        lambda t, give: link(folder(t / "home") / ".cache", folder(t / "scratch" / "me" / "cache")) / "dcformer",
        None),
    "the user's symlink in a sticky shared folder to the user's folder": (
        lambda t, give: link(folder(t / "shared", 0o1777) / "ln", folder(t / "mine")), None),
    "a relative symlink, then '..'": (
        lambda t, give: (folder(t / "b" / "c"), link(folder(t / "a") / "ln", "../b/c") / ".." / "c" / "d")[1], None),
    "a folder others can read": (lambda t, give: folder(t / "cache", 0o755), None),
}


@pytest.mark.parametrize("case", PRIVACY_CASES)
def test_check_private_refuses_what_others_own_or_can_write(tmp_path, give_away, monkeypatch, case):
    """ssh's rule for `~/.ssh`, on everything a load passes through: the path, each folder above it and each symlink
    on the way belong to the user (or root), the path is writable by no one else, a folder above it only with the
    sticky bit; one line names the path and the fix. The legitimate neighbours pass."""
    monkeypatch.setattr(build, "private_group", lambda gid: False)  # group write counts as others' here
    layout, refusal = PRIVACY_CASES[case]
    path = layout(tmp_path, give_away)
    if refusal is None:
        build.check_private(path)
        return
    with pytest.raises(build.UnsafeCacheError, match=refusal) as caught:
        build.check_private(path)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"it refuses to load its operators from {path}, since ")
    assert "DCFORMER_CACHE" in message


def test_group_write_is_allowed_for_the_users_private_group(tmp_path, monkeypatch):
    """Where new folders are group-writable (umask 002) for a group that is the user's alone, they pass."""
    cache = folder(tmp_path / "cache", 0o770)
    monkeypatch.setattr(build, "private_group", lambda gid: gid == cache.stat().st_gid)
    build.check_private(cache)
    monkeypatch.setattr(build, "private_group", lambda gid: False)
    with pytest.raises(build.UnsafeCacheError, match="mode 0770"):
        build.check_private(cache)


def test_a_relative_cache_is_checked_from_the_working_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(folder(folder(tmp_path / "open", 0o777) / "work"))
    with pytest.raises(build.UnsafeCacheError, match=r"from cache, since other users can write .*/open \("):
        build.check_private("cache")
    monkeypatch.chdir(tmp_path)
    build.check_private("cache")


def plant(folder_: Path) -> None:
    """A library and its matching stamp in the cache entry `folder_` (made 0700 if missing): a complete build as far
    as the stamp can tell."""
    folder_.mkdir(mode=0o700, parents=True, exist_ok=True)
    library = folder_ / f"{folder_.name}.so"
    library.write_bytes(b"\x7fELF planted: its constructor would run in the victim's process")
    (folder_ / build.STAMP).write_text(hashlib.sha256(library.read_bytes()).hexdigest() + "\n")


# name: (how the planted entry (tmp_path / "cache" / ENTRY) is another user's or writable by others, the refusal)
PLANTED = {
    "the entry folder is another user's": (lambda entry, give: give(entry), r"it belongs to .*uid 65534"),
    "the library is another user's": (lambda entry, give: give(entry / f"{entry.name}.so"), r"\.so, since it belongs"),
    "the stamp is another user's": (lambda entry, give: give(entry / build.STAMP), r"build\.sha256, since it belongs"),
    "the library is world-writable": (lambda entry, give: (entry / f"{entry.name}.so").chmod(0o666), r"mode 0666"),
    "the cache is world-writable (DCFORMER_CACHE=/shared)": (
        lambda entry, give: entry.parent.chmod(0o1777), r"cache, since other users can write it \(mode 1777\)"),
}


@pytest.mark.parametrize("how", PLANTED)
def test_a_library_planted_by_another_user_is_not_loaded(tmp_path, in_process, give_away, monkeypatch, how):
    """A library with a matching stamp where another user could have put it is refused, not loaded and not rebuilt
    over (the stamp proves nothing: its planter writes it too); the refusal is one line, and is remembered."""
    entry_ = entry(tmp_path, in_process)
    folder(entry_.parent)
    plant(entry_)
    arrange, refusal = PLANTED[how]
    arrange(entry_, give_away)
    loaded = []
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    monkeypatch.setattr(in_process, "build", never_build)
    with pytest.raises(RuntimeError, match=refusal) as caught:
        in_process.load()
    assert loaded == [] and "\n" not in str(caught.value) and "DCFORMER_CACHE" in str(caught.value)
    assert in_process.unavailable() == str(caught.value)  # remembered: no second look
    with pytest.raises(RuntimeError, match=refusal):
        in_process.load()


def test_another_users_lock_file_is_not_used(tmp_path, in_process, give_away, monkeypatch):
    """A lock file that is not the user's is not opened (a planted one may be a trap), and nothing is built."""
    entry_ = entry(tmp_path, in_process)
    lock = folder(entry_.parent) / f"{entry_.name}.lock"
    lock.write_text("")
    give_away(lock)
    monkeypatch.setattr(in_process, "build", never_build)
    with pytest.raises(RuntimeError, match=r"\.lock, since it belongs to .*uid 65534"):
        in_process.load()
    assert not entry_.exists()


@pytest.fixture
def sticky_shared():
    """A world-writable sticky folder (`mkdir -m1777 /shared`) that another user can reach: under /tmp, not under
    the tests' private tmp_path."""
    shared = Path(tempfile.mkdtemp(prefix="dcformer-shared-", dir="/tmp"))
    shared.chmod(0o1777)
    yield shared
    shutil.rmtree(shared, ignore_errors=True)


def as_nobody(command: str) -> None:
    """Run the shell `command` as the user nobody (uid 65534), or skip where this process cannot switch users."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to act as a second user")
    run = subprocess.run(["setpriv", f"--reuid={OTHER}", f"--regid={OTHER}", "--clear-groups", "sh", "-c", command],
                         capture_output=True, text=True)  # fmt: skip
    if run.returncode != 0:
        pytest.skip(f"cannot act as uid {OTHER} here: {run.stderr.strip()[:200]}")


def test_a_library_planted_by_a_second_user_in_a_shared_folder_is_refused(tmp_path, in_process, sticky_shared,
                                                                         monkeypatch):
    """Two real users: nobody makes `/shared/x` and plants a stamped library at the path the victim's load computes
    there; with DCFORMER_CACHE=/shared/x or =/shared the victim loads nothing and is told why in one line."""
    name = in_process.folder(build.find_compiler()).name
    as_nobody(f"umask 022 && mkdir -p {sticky_shared}/x/{name} && cd {sticky_shared}/x/{name} && "
              f"printf 'planted' > {name}.so && sha256sum {name}.so | cut -d' ' -f1 > {build.STAMP}")
    assert (sticky_shared / "x" / name / build.STAMP).stat().st_uid == OTHER
    loaded = []
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    monkeypatch.setattr(in_process, "build", never_build)
    for cache, refusal in ((sticky_shared / "x", r"x, since it belongs to nobody"),
                           (sticky_shared, r"since other users can write it \(mode 1777\)")):
        monkeypatch.setenv("DCFORMER_CACHE", str(cache))
        in_process.failure = None
        with pytest.raises(RuntimeError, match=refusal):
            in_process.load()
    assert loaded == []


def test_auto_does_without_a_refused_cache_and_cpu_names_it(monkeypatch, tmp_path, caplog):
    """Under "auto" a refused cache is one warning (with the path and the fix) and eager's numbers; naming "cpu" is
    an error with that line. Nothing is built."""
    source = tmp_path / "never_built.cpp"
    source.write_text("this is not C++ (a refused cache is never built into);\n")
    shared = folder(tmp_path / "shared", 0o1777)
    monkeypatch.setenv("DCFORMER_CACHE", str(shared))
    model = build_model(make_config(num_hidden_layers=1, dcmha_implementation="eager"))
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(0))
    logger = logging.getLogger("modeling_dcformer.kernels.dcmha_cpu")
    monkeypatch.setattr(logger, "propagate", True)
    refused = dcmha_cpu.CPUBackend(build.OperatorLibrary(source))
    fix = f"run `chmod go-w {shared}`, or set DCFORMER_CACHE to a folder of your own"
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="modeling_dcformer.kernels.dcmha_cpu"), \
            registered("cpu", refused):
        expected = model(ids).logits
        model.config.dcmha_implementation = "auto"
        assert_close(model(ids).logits, expected)
        model(ids)
        model.config.dcmha_implementation = "cpu"
        with pytest.raises(ValueError, match="cannot compute this attention: it refuses to load its operators from") \
                as caught:
            model(ids)
    assert fix in str(caught.value) and "\n" not in str(caught.value)
    warnings = [r.getMessage() for r in caplog.records if "refuses to load" in r.getMessage()]
    assert len(warnings) == 1 and fix in warnings[0], warnings
    assert list(shared.iterdir()) == []


def test_a_cache_of_ones_own_in_a_shared_folder_builds_privately_whatever_the_umask(
        tmp_path, in_process, sticky_shared, monkeypatch):
    """DCFORMER_CACHE=/shared/me/cache (made by the build): with umask 000 the folders are 0700 and no file a build
    leaves is writable by group or others; a later load takes that build as it is."""
    cache = sticky_shared / "me" / "cache"
    monkeypatch.setenv("DCFORMER_CACHE", str(cache))
    previous = os.umask(0)
    try:
        in_process.load()
    finally:
        os.umask(previous)
    assert in_process.loaded
    name = in_process.folder(build.find_compiler()).name
    for made in (sticky_shared / "me", cache, cache / name):
        assert stat.S_IMODE(made.stat().st_mode) == 0o700, made
    for path in cache.rglob("*"):
        assert not path.lstat().st_mode & 0o022, f"{path} is writable by others"
    later = stand_in(tmp_path)[0]
    monkeypatch.setattr(later, "build", never_build)
    loaded = []
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    later.load()
    assert later.loaded and loaded == [str(cache / name / f"{name}.so")]


def test_the_default_cache_behind_a_symlink_builds_once_and_says_so(tmp_path, in_process, monkeypatch, caplog):
    """The default cache (~/.cache/dcformer) with ~/.cache a symlink of the user's (-> /scratch/me/cache): the first
    load builds with one line saying so, where and how long; a load of the cached build says nothing."""
    monkeypatch.delenv("DCFORMER_CACHE")
    monkeypatch.setenv("HOME", str(folder(tmp_path / "home")))
    link(tmp_path / "home" / ".cache", folder(tmp_path / "scratch" / "me" / "cache"))
    in_process.load()
    name = in_process.folder(build.find_compiler()).name
    where = tmp_path / "home" / ".cache" / "dcformer" / name
    said = [r for r in caplog.records if r.name == "modeling_dcformer.kernels.build"]
    assert [r.getMessage() for r in said] == [f"building the C++ operators of stand_in.cpp once into {where} "
                                              "(about 30 s)"]
    assert said[0].levelno == logging.WARNING  # shown at transformers' default verbosity
    assert (tmp_path / "scratch" / "me" / "cache" / "dcformer" / name / build.STAMP).is_file()
    caplog.clear()
    later = stand_in(tmp_path)[0]
    later.load()
    assert later.loaded and caplog.records == []
