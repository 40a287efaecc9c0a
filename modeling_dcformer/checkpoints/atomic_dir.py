"""Atomic directory output: a whole directory is written beside its destination, then swapped in.

Used by `save_pretrained` (`modeling_dcformer.publishing.saving`) and by the converters. It stays in the installed
package: a saved model's remote code never carries it.

API (stable):

    from modeling_dcformer.checkpoints import atomic_dir

    with atomic_dir.replacing(destination, overwrite=True, keep=None) as tmp:
        ...                                  # write every file of the new directory into `tmp`
    # on success `tmp` has taken the destination's place; on any exception it is removed and the destination is
    # exactly as it was

    atomic_dir.resolve(destination) -> Path  # the real folder a destination names (".", "..", symlinks resolved)
    atomic_dir.write_file(path, data)        # one file (text or bytes), written beside it and swapped in

- `destination` may be relative, ".", "..", the current directory or one above it, or a symlink (to a folder,
  to an empty folder, or dangling): the folder it names is replaced and the link is kept. An existing file there is
  a `NotADirectoryError`.
- `overwrite=False`: only an absent or empty destination is taken (one rename); one that is not empty when the
  new copy is ready is a `FileExistsError` and the new copy is discarded.
- `keep(name) -> bool`: entries of the old directory to bring into the new one when it has none of that name
  (hard links where the file system allows them, else copies): a tokenizer saved beside a model survives a
  re-save of the model. None: nothing is carried over.
- One writer at a time per destination: a `filelock.FileLock` on the hidden sibling `.NAME.lock` is held for the
  whole write (other writers wait for it; with filelock >= 4.3 the file is removed when the write ends). Hidden
  siblings that writers killed meanwhile left (`.NAME.tmp-*`, `.NAME.old-*`) are removed once the lock is held (an
  old copy is first put back if the destination is missing).
- The new folder gets the mode a plain `mkdir` would give (the umask respected: 0755 under umask 022) or, when the
  destination exists, that folder's mode and group (a 2775 shared folder stays 2775).
- The swap: Linux `renameat2(RENAME_EXCHANGE)` exchanges the two folders in one step, so the destination always
  names one complete copy; elsewhere the old copy is first renamed to `.NAME.old-*` (a crash between the two
  renames leaves it whole there, and the next write puts it back). The old copy is then deleted.
- Readers: the swap takes an exclusive `flock` on the old folder first; `DCFormerPreTrainedModel.from_pretrained`
  holds a shared one (`reading`) while it reads a local folder, so a load sees one copy, never two.
- A process whose working directory was inside the replaced folder is moved to the same path in the new copy.
"""

import errno
import json
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock
from filelock import __version__ as filelock_version
from transformers.utils import logging

try:
    import fcntl
except ImportError:  # not POSIX: no reader lock
    fcntl = None

logger = logging.get_logger(__name__)

# filelock >= 4.3 notices a lock file unlinked under a waiter and retries with the new one, so the holder may remove
# it (no `.NAME.lock` left behind); with older versions the empty file stays.
_UNLINK_HELD_LOCK = tuple(int(x) for x in re.findall(r"\d+", filelock_version)[:2]) >= (4, 3)
_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def resolve(destination: str | os.PathLike) -> Path:
    """The absolute real path of the folder `destination` names: ".", ".." and symlinks resolved (a dangling link:
    the path it points to). An existing file is a `NotADirectoryError`."""
    path = Path(destination).expanduser().resolve()
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"cannot write the directory {destination}: {path} is a file, not a directory")
    if path == Path(path.anchor):
        raise OSError(f"cannot replace {path}: it is the root of the file system")
    return path


def _sibling(target: Path, kind: str) -> Path:
    return target.with_name(f".{target.name}.{kind}-{secrets.token_hex(4)}")


def _siblings(target: Path, kind: str) -> list[Path]:
    escaped = re.sub(r"([*?\[])", r"[\1]", target.name)
    return sorted(target.parent.glob(f".{escaped}.{kind}-*"), key=lambda p: p.lstat().st_mtime)


def _make_folder(target: Path) -> Path:
    """A new empty hidden sibling of `target`, with the mode `mkdir` gives (umask respected) or `target`'s own."""
    while True:
        tmp = _sibling(target, "tmp")
        try:
            os.mkdir(tmp, 0o777)  # the umask applies, as for any mkdir
            break
        except FileExistsError:
            continue
    try:
        old = target.stat()
    except FileNotFoundError:
        return tmp
    try:
        if old.st_gid != tmp.stat().st_gid:
            os.chown(tmp, -1, old.st_gid)
        os.chmod(tmp, stat.S_IMODE(old.st_mode))
    except OSError as err:  # another user's folder: the mode we may set
        logger.warning(f"{target}'s mode or group could not be given to its new copy: {err.strerror}")
    return tmp


def _remove_leftovers(target: Path) -> None:
    """Under the lock: a missing `target` gets its newest whole old copy back; other hidden siblings of killed
    writers are removed, saying so."""
    old = [p for p in _siblings(target, "old") if p.is_dir() and not p.is_symlink()]
    if old and not os.path.lexists(target):
        os.replace(old.pop(), target)
        logger.warning(f"{target} was missing after an interrupted replacement: its previous copy was put back")
    for stale in old + [p for p in _siblings(target, "tmp") if p.is_dir() and not p.is_symlink()]:
        shutil.rmtree(stale, ignore_errors=True)
        logger.warning(f"removed {stale}, left beside {target} by an interrupted write")


def _carry_over(old: Path, new: Path, keep: Callable[[str], bool]) -> None:
    for entry in old.iterdir():
        dest = new / entry.name
        if os.path.lexists(dest) or not keep(entry.name):
            continue
        if entry.is_symlink():
            os.symlink(os.readlink(entry), dest)
        elif entry.is_dir():
            try:
                shutil.copytree(entry, dest, symlinks=True, copy_function=os.link)
            except (OSError, shutil.Error):
                shutil.rmtree(dest, ignore_errors=True)
                shutil.copytree(entry, dest, symlinks=True)
        else:
            try:
                os.link(entry, dest)
            except OSError:
                shutil.copy2(entry, dest)


def _exchange(a: Path, b: Path) -> bool:
    """Exchange the two existing folders `a` and `b` in one step (Linux `renameat2`); False where the system or the
    file system cannot (nothing happened then)."""
    try:
        import ctypes

        renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    except (OSError, AttributeError, TypeError):
        return False
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM, errno.EXDEV):
        return False
    raise OSError(code, f"cannot put the new copy of {b} in place: {os.strerror(code)}; {b} is unchanged")


def _put_in_place(new: Path, target: Path) -> None:
    """The second rename where the folders cannot be exchanged (a separate step, so tests can stop a write there)."""
    os.replace(new, target)


def _swap(tmp: Path, target: Path, overwrite: bool) -> None:
    """Put the complete folder `tmp` at `target`; the old copy (if any) is deleted after."""
    if not target.is_dir() or not any(target.iterdir()):
        try:
            os.rename(tmp, target)  # absent or empty; POSIX refuses a folder filled meanwhile
            return
        except OSError as err:
            if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
    if not overwrite:
        raise FileExistsError(f"{target} exists and is not empty: left as it is, the new copy was discarded")
    fd = os.open(target, os.O_RDONLY)
    try:
        if fcntl is not None:  # loads of the old copy hold a shared lock on it (`reading`): they finish first
            fcntl.flock(fd, fcntl.LOCK_EX)
        if _exchange(tmp, target):
            old = tmp
        else:
            old = _sibling(target, "old")
            os.replace(target, old)
            try:
                _put_in_place(tmp, target)
            except BaseException:
                os.replace(old, target)
                raise
        shutil.rmtree(old, ignore_errors=True)
    finally:
        os.close(fd)
    if old.exists():
        logger.warning(f"could not remove all of the replaced copy of {target} at {old}: delete it")


def _working_directory() -> Path | None:
    try:
        return Path.cwd()
    except OSError:  # already deleted
        return None


@contextmanager
def replacing(
    destination: str | os.PathLike, *, overwrite: bool = True, keep: Callable[[str], bool] | None = None
) -> Iterator[Path]:
    """Yields an empty hidden sibling of `destination` to write the new directory into; on success it takes the
    destination's place in one step, on any exception it is removed and the destination is unchanged. See the
    module's docstring for symlinks, modes, locking and what a crash leaves."""
    target = resolve(destination)
    target.parent.mkdir(parents=True, exist_ok=True)
    cwd = _working_directory()
    lock = target.with_name(f".{target.name}.lock")
    with FileLock(lock):
        _remove_leftovers(target)
        tmp = _make_folder(target)
        try:
            yield tmp
            if keep is not None and target.is_dir():
                _carry_over(target, tmp, keep)
            _swap(tmp, target, overwrite)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            if _UNLINK_HELD_LOCK:  # a waiter on the unlinked file sees it and takes the new one
                lock.unlink(missing_ok=True)
    if cwd is not None and cwd.is_relative_to(target) and cwd.is_dir():
        os.chdir(cwd)  # it was inside the old copy, now deleted: the same path in the new one


def write_file(path: str | os.PathLike, data: str | bytes) -> None:
    """Write `data` (text as UTF-8, or bytes: a figure) to a new hidden sibling of the file `path` (mode as for any
    new file: the umask applies), then rename it over `path`: a reader, or a crash at any moment, sees the old file or
    the new one, whole."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as handle:
            handle.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextmanager
def reading(folder: str | os.PathLike | None, subfolder: str | None = None) -> Iterator[str | None]:
    """While a local folder is read (`DCFormerPreTrainedModel.from_pretrained`), a shared `flock` on it, which
    `replacing`'s swap waits for: a load never reads two saves. Yields config.json's `save_id` (None: none).
    Nothing to lock for a Hub id or without `fcntl`."""
    folder = Path(str(folder), subfolder or "") if folder is not None else None
    if folder is None or not folder.is_dir():
        yield None
        return
    fd = None
    while fcntl is not None:
        fd = os.open(folder, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_SH)
        if os.path.samestat(os.fstat(fd), os.stat(folder)):
            break
        os.close(fd)  # a save took the folder's place while we waited: lock the new one
    try:
        save_id = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("save_id")
    except (OSError, ValueError, AttributeError):  # no config.json, or not one: transformers says so
        save_id = None
    try:
        yield save_id
    finally:
        if fd is not None:
            os.close(fd)


__all__ = ["reading", "replacing", "resolve", "write_file"]
