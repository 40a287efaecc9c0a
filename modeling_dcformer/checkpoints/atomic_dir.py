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
    atomic_dir.lock_file(destination) -> Path  # the lock file `replacing` takes for that destination

- `destination` may be relative, ".", "..", the current directory or one above it, or a symlink (to a folder,
  to an empty folder, or dangling): the folder it names is replaced and the link is kept. An existing file there, or
  in place of one of the folders above it, is a `NotADirectoryError` naming it (nothing is written). A link is
  followed as Linux's `protected_symlinks` would: in a world-writable folder with the sticky bit, only a link of the
  current user or of that folder's owner (another user's `/tmp/m` -> a folder of yours is a `PermissionError`).
- `overwrite=False`: only an absent or empty destination is taken (one rename); one that is not empty when the
  new copy is ready is a `FileExistsError` and the new copy is discarded.
- `keep(name) -> bool`: entries of the old directory to bring into the new one when it has none of that name
  (hard links where the file system allows them, else copies): a tokenizer saved beside a model survives a
  re-save of the model. None: nothing is carried over.
- One writer at a time per destination: a `filelock.FileLock` on the hidden sibling `.NAME.lock` is held for the
  whole write (other writers wait for it; with filelock >= 4.3 the file is removed when the write ends). A lock file
  another user owns is left alone (saying so) and `.NAME.lock-UID` is locked instead (`lock_file`).
- Hidden siblings that writers killed meanwhile left (`.NAME.tmp-*`, `.NAME.old-*`) are removed once the lock is held
  (an old copy is first put back if the destination is missing). Only siblings this module made for this destination
  and this user are touched: each one's name ends in a random part and a check of it computed from the destination,
  the kind and the user id, and the folder must belong to the current user. Anything else named like one (another
  user's folder, planted where others can write) is left alone, with a warning naming it. (The mark is in the name,
  not in a file inside: the old copy set aside is the user's folder exactly as it was, and stays so.)
- `keep` carries over only what the current user owns (a folder: when everything in it is theirs); entries of other
  users are left out, with one warning naming them, so a new save never holds a hard link to another user's file.
- Names near the file system's limit (255 bytes): the siblings are named after a shortened form of NAME (its start
  and a hash of the whole), so that any name a folder can have can be written.
- In a folder with the sticky bit (a shared `/tmp`-like folder, mode 1777) only an entry's owner may rename it: a
  destination there that another user owns is refused before anything is written, in one line.
- A full disk (ENOSPC, EDQUOT, EFBIG, also as safetensors' own error) while the new copy is written is one
  `DestinationUnchanged` (an OSError with that errno and `filename` the destination): "writing DEST failed: No space
  left on device; it was left as it was and the partial copy removed".
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
import hashlib
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


DISK_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC), errno.EFBIG)
_SIBLING_SUFFIX = 22  # the longest a sibling's name adds to NAME's stem: "." + ".tmp-" + 16 hex characters
_KINDS = ("old", "tmp")


class DestinationUnchanged(OSError):
    """A write of the new copy failed for lack of space: the destination (`filename`) is as it was, the partial copy
    removed. `strerror` is the failure as it was reported (`filename2`: the file whose write failed, if known)."""

    def __str__(self) -> str:
        return f"writing {self.filename} failed: {self.strerror}; it was left as it was and the partial copy removed"


def _uid() -> int | None:
    """The current user, whose folders this module may take over (None: a system without owners, e.g. Windows)."""
    return os.geteuid() if hasattr(os, "geteuid") else None


def _owner(path: str | os.PathLike) -> int:
    """The user who owns `path` itself (a link: the link)."""
    return os.lstat(path).st_uid


def _links(path: Path) -> Iterator[Path]:
    """The symbolic links that resolving the absolute `path` follows, each under the real path of its folder."""
    pending, current, hops = list(reversed(path.parts[1:])), Path(path.anchor), 0
    while pending and hops <= 40:  # (the system's own limit on a chain of links)
        part = pending.pop()
        if part in ("", "."):
            continue
        if part == "..":
            current = current.parent
            continue
        candidate = current / part
        try:
            link = os.readlink(candidate)
        except OSError:  # not a link, or not there
            current = candidate
            continue
        yield candidate
        hops += 1
        if os.path.isabs(link):
            current = Path(Path(link).anchor)
        pending.extend(reversed(Path(link).parts[1:] if os.path.isabs(link) else Path(link).parts))


def _check_links(destination: str | os.PathLike, path: Path) -> None:
    """The rule of Linux's `protected_symlinks`, which resolving a path ourselves bypasses: a link in a world-writable
    folder with the sticky bit is followed only if the current user or the folder's owner owns it. Another user's
    link there (say `/tmp/m` -> a folder of yours) is refused in one line: a save through it would replace that
    folder."""
    uid = _uid()
    if uid is None:
        return
    for link in _links(path):
        folder = os.stat(link.parent)
        if folder.st_mode & stat.S_ISVTX and folder.st_mode & stat.S_IWOTH:
            owner = _owner(link)
            if owner not in (uid, _owner(link.parent)):
                raise PermissionError(f"cannot write the directory {destination}: {link} is a symbolic link of another "
                                      f"user (uid {owner}) in the shared folder {link.parent}, which the system would "
                                      "not follow either: remove it or choose another folder")


def resolve(destination: str | os.PathLike) -> Path:
    """The absolute real path of the folder `destination` names: ".", ".." and symlinks resolved (a dangling link:
    the path it points to). An existing file there, or in place of a folder above it, is a `NotADirectoryError`;
    another user's symbolic link in a shared folder with the sticky bit, a `PermissionError` (`_check_links`)."""
    given = Path(destination).expanduser()
    _check_links(destination, given if given.is_absolute() else Path.cwd() / given)
    path = given.resolve()
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"cannot write the directory {destination}: {path} is a file, not a directory")
    for above in path.parents:
        if os.path.lexists(above):
            if not above.is_dir():
                raise NotADirectoryError(f"cannot write the directory {destination}: {above} is a file, not a "
                                         "directory")
            break
    if path == Path(path.anchor):
        raise OSError(f"cannot replace {path}: it is the root of the file system")
    return path


def _stem(target: Path) -> str:
    """NAME in the names of `target`'s hidden siblings: NAME itself, or where the siblings' longer names would pass
    the file system's limit on a name, its start and a hash of the whole."""
    name = target.name
    try:
        limit = os.pathconf(target.parent, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        limit = 255
    budget = min(limit, 255) - _SIBLING_SUFFIX
    if len(os.fsencode(name)) <= budget:
        return name
    digest = hashlib.sha256(os.fsencode(name)).hexdigest()[:16]
    start = ""
    for char in name:
        if len(os.fsencode(start + char)) > budget - len(digest) - 1:
            break
        start += char
    return f"{start}~{digest}"


def _check(target: Path, kind: str, nonce: str) -> str:
    """The second half of a sibling's random part: marks it as made by this module, as a `kind` sibling of a folder
    named as `target` is (the name only: a copy of the parent folder, with its leftovers, is recovered as well)."""
    text = f"modeling_dcformer.atomic_dir\0{kind}\0{target.name}\0{nonce}"
    return hashlib.sha256(os.fsencode(text)).hexdigest()[:8]


def _sibling(target: Path, kind: str) -> Path:
    nonce = secrets.token_hex(4)
    return target.with_name(f".{_stem(target)}.{kind}-{nonce}{_check(target, kind, nonce)}")


def _siblings(target: Path, kind: str) -> list[Path]:
    """Whatever is named like a hidden `kind` sibling of `target` (this module's, or an older version's: 8 hex
    characters), oldest first."""
    prefix = f".{_stem(target)}.{kind}-"
    escaped = re.sub(r"([*?\[])", r"[\1]", prefix)
    found = []
    for path in target.parent.glob(f"{escaped}*"):
        if re.fullmatch(r"[0-9a-f]{8}([0-9a-f]{8})?", path.name[len(prefix):]):
            try:
                found.append((path.lstat().st_mtime, path))
            except FileNotFoundError:
                continue
    return [path for _, path in sorted(found)]


def _stranger(path: Path, target: Path, kind: str) -> str | None:
    """None where `path` is a folder this module made beside `target` (the check in its name) that the current user
    owns; else why it is not."""
    try:
        info, owner = path.lstat(), _owner(path)
    except FileNotFoundError:
        return "it is gone"
    uid = _uid()
    if uid is not None and owner != uid:
        return f"it belongs to another user (uid {owner})"
    random_part = path.name[len(f".{_stem(target)}.{kind}-"):]
    if not stat.S_ISDIR(info.st_mode) or random_part[8:] != _check(target, kind, random_part[:8]):
        return "its name lacks this package's mark (if it holds something of yours, rename it; else delete it)"
    return None


def lock_file(destination: str | os.PathLike) -> Path:
    """The lock file `replacing` holds while it writes `destination`'s folder: `.NAME.lock` beside it, or where another
    user owns that file (planted, or left by an older filelock), `.NAME.lock-UID` (saying so)."""
    target = resolve(destination)
    lock = target.with_name(f".{_stem(target)}.lock")
    uid = _uid()
    try:
        owner = _owner(lock)
    except OSError:
        return lock
    if uid is None or owner == uid:
        return lock
    own = target.with_name(f".{_stem(target)}.lock-{uid}")
    logger.warning(f"left {lock} alone: it belongs to another user (uid {owner}); {own} locks this write instead")
    return own


def _check_replaceable(target: Path) -> None:
    """In a folder with the sticky bit only an entry's owner, the folder's owner or root may rename it: refuse another
    user's destination there before anything is written."""
    uid = _uid()
    if not uid:  # root, or no owners
        return
    try:
        owner, parent_owner, parent_mode = _owner(target), _owner(target.parent), target.parent.stat().st_mode
    except FileNotFoundError:
        return
    if parent_mode & stat.S_ISVTX and uid not in (owner, parent_owner):
        raise PermissionError(f"cannot replace {target}: it belongs to another user (uid {owner}) and in "
                              f"{target.parent} (a shared folder with the sticky bit) only its owner may replace it: "
                              "choose another folder")


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
    writers are removed, saying so. What this module did not make for this user is left alone, saying so."""
    ours = {}
    for kind in _KINDS:
        ours[kind] = []
        for path in _siblings(target, kind):
            why = _stranger(path, target, kind)
            if why is None:
                ours[kind].append(path)
            elif os.path.lexists(path):
                logger.warning(f"left {path} alone: it is named like a hidden copy of {target} that an interrupted "
                               f"write left, but {why}")
    old = ours["old"]
    if old and not os.path.lexists(target):
        os.replace(old.pop(), target)
        logger.warning(f"{target} was missing after an interrupted replacement: its previous copy was put back")
    for stale in old + ours["tmp"]:
        shutil.rmtree(stale, ignore_errors=True)
        logger.warning(f"removed {stale}, left beside {target} by an interrupted write")


def carried_over(path: str | os.PathLike) -> bool:
    """Whether a re-save of the folder that holds `path` carries it over into the new save (`replacing`): the
    current user owns it (and, for a folder, everything in it)."""
    return _owned(Path(path), _uid())


def _owned(path: Path, uid: int | None) -> bool:
    """Whether the current user owns `path` (not followed if a link) and, for a folder, everything in it."""
    if uid is None:
        return True
    try:
        if _owner(path) != uid:
            return False
        if path.is_dir() and not path.is_symlink():
            for root, folders, files in os.walk(path):
                if any(_owner(os.path.join(root, name)) != uid for name in folders + files):
                    return False
    except FileNotFoundError:
        return False
    return True


def _carry_over(old: Path, new: Path, keep: Callable[[str], bool]) -> None:
    """Entries of `old` that `keep` names and `new` lacks, brought into `new`: only the current user's (checked again
    on what was linked, which another user cannot have swapped in). Others' are left out, saying so."""
    uid, foreign = _uid(), []
    for entry in old.iterdir():
        dest = new / entry.name
        if os.path.lexists(dest) or not keep(entry.name):
            continue
        if not _owned(entry, uid):
            foreign.append(entry.name)
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
        if not _owned(dest, uid):  # replaced between the check and the link
            shutil.rmtree(dest) if dest.is_dir() and not dest.is_symlink() else dest.unlink()
            foreign.append(entry.name)
    if foreign:
        logger.warning(f"not carried over into the new copy of {old}: {', '.join(sorted(foreign))} (another user's)")


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
            try:
                os.replace(target, old)
            except PermissionError as err:
                raise PermissionError(f"cannot replace {target}: {err.strerror}; it is unchanged") from None
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


def _disk_full(err: BaseException) -> int | None:
    """The errno of a full disk (or quota, or file size limit) behind `err`, as Python or safetensors reports it."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        code = getattr(err, "errno", None)
        if code is None:
            match = re.search(r"\(os error (\d+)\)", str(err))
            code = int(match.group(1)) if match else None
        if code in DISK_FULL:
            return code
        err = err.__cause__ or err.__context__
    return None


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
    module's docstring for symlinks, modes, locking, other users' files and what a crash leaves."""
    target = resolve(destination)
    target.parent.mkdir(parents=True, exist_ok=True)
    _check_replaceable(target)
    cwd = _working_directory()
    lock = lock_file(target)
    with FileLock(lock):
        _remove_leftovers(target)
        tmp = _make_folder(target)
        try:
            try:
                yield tmp
            except BaseException as err:
                code = _disk_full(err)
                if code is None:
                    raise
                where = getattr(err, "filename2", None) or getattr(err, "filename", None)
                failure = getattr(err, "strerror", None) or os.strerror(code)
                raise DestinationUnchanged(code, failure, str(target), None, where) from None
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
    new file: the umask applies; a long name shortened as `replacing`'s siblings are), then rename it over `path`: a
    reader, or a crash at any moment, sees the old file or the new one, whole."""
    path = Path(path)
    tmp = path.with_name(f".{_stem(path)}.{secrets.token_hex(4)}.tmp")
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


__all__ = ["DISK_FULL", "DestinationUnchanged", "lock_file", "reading", "replacing", "resolve", "write_file"]
