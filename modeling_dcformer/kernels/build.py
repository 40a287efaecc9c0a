"""Building and loading a C++ source of PyTorch operators, once per machine (the CPU kernel's `csrc/dcmha_cpu.cpp`).

A source is built on first use with `torch.utils.cpp_extension` and the system's C++ compiler into `cache_dir()`
(`$DCFORMER_CACHE`, default `~/.cache/dcformer`), in a folder named by a hash of the source, the compiler, the
flags, the torch version and the CPU (the flags hold `-march=native`). A build ends by writing a stamp with the
library's checksum; a library that does not match its stamp (a crash mid-write, a corrupt file) is rebuilt, never
loaded. Processes that build at once take turns on a lock file beside the folder: one builds into a private folder
and renames it into place once stamped, the others then load what it built.
"""

import hashlib
import os
import platform
import shutil
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
            except Exception as err:  # noqa: BLE001  (any build failure: the library is unavailable here)
                self.failure = f"it cannot be built here ({type(err).__name__}: {str(err)[-1500:]})"
                raise RuntimeError(self.failure) from err
            self.loaded = True

    def verified_library(self, folder: Path) -> Path | None:
        """The folder's library if its stamp matches it (a complete build), else None."""
        library, stamp = folder / f"{folder.name}.so", folder / STAMP
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
        library = self.verified_library(folder)
        if library is None:
            root = folder.parent
            if root.exists() and not root.is_dir():
                raise RuntimeError(f"the kernel cache {root} ($DCFORMER_CACHE) is a file, not a folder")
            root.mkdir(parents=True, exist_ok=True)
            from filelock import FileLock

            # one build per cache entry at a time; the others wait, then load what it built
            with FileLock(str(root / f"{folder.name}.lock"), timeout=1800):
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
            logger.warning(f"the C++ operators cached in {folder} are incomplete or corrupt: rebuilding them")
        private = Path(tempfile.mkdtemp(prefix=f"{folder.name}.build-", dir=folder.parent))
        try:
            logger.info(f"building the C++ operators of {self.source.name} into {folder} (once; about 30 s)")
            from torch.utils import cpp_extension

            os.environ.setdefault("CXX", cxx)
            cpp_extension.load(name=folder.name, sources=[str(self.source)], extra_cflags=self.cflags,
                               build_directory=str(private), is_python_module=False, verbose=False)
            (private / STAMP).write_text(file_sha256(private / f"{folder.name}.so") + "\n")
            if folder.is_symlink() or folder.is_file():
                folder.unlink()
            elif folder.exists():
                shutil.rmtree(folder)
            os.replace(private, folder)  # the stamped build appears whole, or not at all
        finally:
            shutil.rmtree(private, ignore_errors=True)  # a failed build leaves nothing behind


__all__ = ["CFLAGS", "STAMP", "OperatorLibrary", "cache_dir", "find_compiler"]
