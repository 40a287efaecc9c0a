"""Building and loading a C++ source of PyTorch operators, once per machine (the CPU kernel's `csrc/dcmha_cpu.cpp`).

A source is built on first use with `torch.utils.cpp_extension` and the system's C++ compiler into `cache_dir()`
(`$DCFORMER_CACHE`, default `~/.cache/dcformer`), in a folder named by a hash of the source, the compiler, the
flags, the torch version and the CPU (the flags hold `-march=native`). A build ends by writing a stamp with the
library's checksum; a library that does not match its stamp (a crash mid-write, a corrupt file) is rebuilt, never
loaded. Processes that build at once take turns on a lock file beside the folder: one builds into a private folder
and renames it into place once stamped, the others then load what it built.

Loading a library runs its code, so nothing is loaded from where another user could have put it (the way ssh treats
`~/.ssh`): `check_private` refuses the cache, a build folder, a library, a stamp or a lock file that someone else
owns or could write, with one line naming the path and the fix. The folders a build creates are 0700, its files are
not writable by group or others, and the lock file is 0600.
"""

import hashlib
import os
import platform
import shutil
import stat
import tempfile
import threading
from pathlib import Path

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)

CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fopenmp"]
STAMP = "build.sha256"


def find_compiler() -> str | None:
    """The C++ compiler builds use: $CXX, else c++, g++ or clang++ on the PATH."""
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def cache_dir() -> Path:
    """Where built libraries are kept: $DCFORMER_CACHE, default ~/.cache/dcformer."""
    return Path(os.environ.get("DCFORMER_CACHE", Path.home() / ".cache" / "dcformer"))


def cpu_signature() -> str:
    """What the built code depends on besides its source and flags (-march=native): the CPU model and flags."""
    info = platform.machine() + platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            info += "".join(line for line in f if line.startswith(("model name", "flags")))[:20000]
    except OSError:
        pass
    return info


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class UnsafeCacheError(RuntimeError):
    """A cache folder or file that another user owns or could write: what it holds could be theirs."""


def user_name(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def private_group(gid: int) -> bool:
    """Whether the group `gid` is the current user's own: a user private group (the user's primary group, named like
    the user, with no other member), as on systems whose umask 002 makes new folders group-writable."""
    try:
        import grp
        import pwd

        user, group = pwd.getpwuid(os.geteuid()), grp.getgrgid(gid)
    except (ImportError, KeyError):
        return False
    return gid == user.pw_gid and group.gr_name == user.pw_name and set(group.gr_mem) <= {user.pw_name}


def writable_by_others(st: os.stat_result) -> bool:
    """Whether users other than the owner may write it: world-writable, or group-writable for a group that is not
    the current user's private group."""
    return bool(st.st_mode & stat.S_IWOTH) or bool(st.st_mode & stat.S_IWGRP) and not private_group(st.st_gid)


def check_private(path: str | os.PathLike) -> None:
    """Raise UnsafeCacheError (one line: what, where, the fix) unless no other user could have written `path`.

    The path is walked from / as the system resolves it: every folder on the way, every symlink followed (wherever it
    leads: each is checked in turn) and the path itself must belong to the current user or root; the path itself
    must not be writable by group or others, nor may a folder above it unless it has the sticky bit (/tmp, or
    `mkdir -m1777 /shared`: there only an entry's owner may rename or remove it). Group write is allowed where the
    group is the user's private one (`private_group`). A path that does not exist holds nothing to load: it passes.
    Without POSIX owners (Windows) there is nothing to check."""
    if not hasattr(os, "geteuid"):
        return
    uid = os.geteuid()
    given = os.fspath(path)
    todo = [part for part in os.path.join(os.getcwd(), given).split(os.sep) if part not in ("", ".")]
    current, followed = os.sep, 0
    st = os.lstat(current)

    def refuse(reason: str) -> UnsafeCacheError:
        return UnsafeCacheError(f"it refuses to load its operators from {given}, since {reason}")

    while True:
        last, link = not todo, stat.S_ISLNK(st.st_mode)
        what = "it" if last and current == os.path.abspath(given) else current
        if st.st_uid not in (uid, 0):
            what = f"the symlink {current}" if link else what if last else f"the folder {current} above it"
            fix = "set DCFORMER_CACHE to a folder of your own"
            raise refuse(f"{what} belongs to {user_name(st.st_uid)}, not to you: "
                         + (fix if what.endswith("above it") else f"remove it, or {fix}"))
        if not link and writable_by_others(st) and (last or not st.st_mode & stat.S_ISVTX):
            raise refuse(f"other users can write {what} (mode {stat.S_IMODE(st.st_mode):04o}) and plant a library "
                         f"there: run `chmod go-w {current}`, or set DCFORMER_CACHE to a folder of your own")
        if link:
            followed += 1
            if followed > 40:
                raise refuse(f"the symlinks at {current} form a loop: set DCFORMER_CACHE to a plain folder")
            target = os.readlink(current)
            todo[:0] = [part for part in target.split(os.sep) if part not in ("", ".")]
            current = os.sep if os.path.isabs(target) else os.path.dirname(current)
            st = os.lstat(current)  # passed already: the walk reached the link through it
            continue
        if last:
            return
        name = todo.pop(0)
        if name == "..":  # the folder above, passed already on the way down
            current = os.path.dirname(current)
            st = os.lstat(current)
            continue
        if not stat.S_ISDIR(st.st_mode):
            return  # nothing below a file: loading from there fails on its own, and says so
        current = os.path.join(current, name)
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            return


def make_private_folders(path: Path) -> None:
    """Create `path` and those of its parents that are missing, each 0700 (less what the umask removes)."""
    for folder in [*reversed(path.parents), path]:
        if not folder.exists():
            try:
                folder.mkdir(mode=0o700)
            except FileExistsError:  # made meanwhile by another process
                pass


class OperatorLibrary:
    """A C++ source of operators (`TORCH_LIBRARY`), built on first `load()` and loaded into this process.

    `unavailable()` says cheaply (no build) why it cannot be built here; `load()` builds if need be (about 30 s, once
    per machine and source) and loads, raising RuntimeError with the reason; a failure is remembered (`failure`) and
    later calls fail at once. Its user says so (the "cpu" backend warns once)."""

    def __init__(self, source: Path, cflags: list[str] = CFLAGS):
        self.source = Path(source)
        self.cflags = list(cflags)  # benchmarks/ab_kernel_source.py builds variants with more flags
        self.loaded = False
        self.failure: str | None = None
        self._lock = threading.Lock()

    def unavailable(self) -> str | None:
        """Why it cannot be built or loaded here, as far as that is known without building (None: it may be)."""
        if self.failure is not None:
            return self.failure
        if not self.loaded and find_compiler() is None:
            return "no C++ compiler found (set $CXX, or install g++ or clang++)"
        return None

    def folder(self, cxx: str) -> Path:
        """The cache entry of a build with the compiler `cxx`."""
        key = "\0".join([self.source.read_text(), cxx, *self.cflags, torch.__version__, cpu_signature()])
        return cache_dir() / f"{self.source.stem}_{hashlib.sha256(key.encode()).hexdigest()[:16]}"

    def load(self) -> None:
        """Build (unless a verified build is cached) and load the library. Raises RuntimeError with the reason; the
        failure is remembered, and later calls fail at once."""
        if self.loaded:  # set once the operators are registered, never unset: no lock needed to read it
            return
        with self._lock:
            if self.loaded:
                return
            if self.failure is not None:
                raise RuntimeError(self.failure)
            try:
                self._load()
            except UnsafeCacheError as err:  # its one line as it is: where, and the fix
                self.failure = str(err)
                raise
            except Exception as err:  # noqa: BLE001  (any build failure: the library is unavailable here)
                self.failure = f"it cannot be built here ({type(err).__name__}: {str(err)[-1500:]})"
                raise RuntimeError(self.failure) from err
            self.loaded = True

    def verified_library(self, folder: Path) -> Path | None:
        """The folder's library if its stamp matches it (a complete build), else None. Raises UnsafeCacheError where
        the folder, the library or the stamp is another user's or writable by others (`check_private`): such a folder
        is neither loaded nor rebuilt over."""
        library, stamp = folder / f"{folder.name}.so", folder / STAMP
        for path in (folder, library, stamp):
            check_private(path)
        try:
            if stamp.read_text().strip() == file_sha256(library):
                return library
        except OSError:  # missing, or the folder is not a folder
            pass
        return None

    def _load(self) -> None:
        cxx = find_compiler()
        if cxx is None:
            raise RuntimeError("no C++ compiler found (set $CXX, or install g++ or clang++)")
        if not self.source.is_file():
            raise RuntimeError(f"the kernel's source {self.source} is missing (a broken installation?)")
        folder = self.folder(cxx)
        root = folder.parent
        if root.exists() and not root.is_dir():
            raise RuntimeError(f"the kernel cache {root} ($DCFORMER_CACHE) is a file, not a folder")
        check_private(root)  # before anything is read from it or made in it
        library = self.verified_library(folder)
        if library is None:
            make_private_folders(root)
            check_private(root)  # what was made: the folders above it may still be others'
            lock = root / f"{folder.name}.lock"
            check_private(lock)
            from filelock import FileLock

            # one build per cache entry at a time; the others wait, then load what it built
            with FileLock(str(lock), timeout=1800, mode=0o600):
                library = self.verified_library(folder)
                if library is None:
                    self.build(folder, cxx)  # builds and loads
        if library is not None:
            torch.ops.load_library(str(library))

    def build(self, folder: Path, cxx: str) -> None:
        """Build and load the library in a private folder beside `folder`, stamp it, then move it into place (the
        caller holds the folder's lock): concurrent builds never share a folder, and the cache entry appears whole
        or not at all. A folder that holds no verified build, or a file in its place, is replaced."""
        if folder.exists() or folder.is_symlink():
            logger.warning(f"the C++ operators cached in {folder} are incomplete or corrupt: rebuilding them once "
                           "(about 30 s)")
        else:  # the one line a first use shows (a cached build loads in silence)
            logger.warning(f"building the C++ operators of {self.source.name} once into {folder} (about 30 s)")
        private = Path(tempfile.mkdtemp(prefix=f"{folder.name}.build-", dir=folder.parent))  # 0700
        try:
            from torch.utils import cpp_extension

            os.environ.setdefault("CXX", cxx)
            cpp_extension.load(name=folder.name, sources=[str(self.source)], extra_cflags=self.cflags,
                               build_directory=str(private), is_python_module=False, verbose=False)
            (private / STAMP).write_text(file_sha256(private / f"{folder.name}.so") + "\n")
            for path in private.rglob("*"):  # whatever the umask: no one else may write what is loaded
                if not path.is_symlink():
                    path.chmod(stat.S_IMODE(path.stat().st_mode) & ~0o022)
            if folder.is_symlink() or folder.is_file():
                folder.unlink()
            elif folder.exists():
                shutil.rmtree(folder)
            os.replace(private, folder)  # the stamped build appears whole, or not at all
        finally:
            shutil.rmtree(private, ignore_errors=True)  # a failed build leaves nothing behind


__all__ = ["CFLAGS", "STAMP", "OperatorLibrary", "UnsafeCacheError", "cache_dir", "check_private",
           "find_compiler"]
