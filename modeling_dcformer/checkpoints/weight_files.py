"""Why a checkpoint's weight files cannot be read: one line naming the file and the reason, after transformers failed
to load it (empty, truncated, a header that is not JSON, a shard index naming absent shards). Installed package only:
a load through a save's remote code alone gives transformers' own error.

Also the rule for the shard names of an index (`shard_name_problem`, `check_shard_names`): a `weight_map` entry
names a file inside the index's folder, never an absolute path or one through "..", which transformers would follow
(`check_index_names` applies it before a load; the converters apply it to their source).
"""

import json
import os
import struct
from pathlib import Path, PurePosixPath, PureWindowsPath

from ..checkpoint_checks import listing


# The shard indexes transformers reads (`variant` goes before ".json", as transformers' `_add_variant` puts it)
INDEX_NAMES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def shard_name_problem(name) -> str | None:
    """Why the shard name `name` of a `weight_map` leaves the folder of its index, or is no file name at all: an
    absolute path, a drive, a ".." part, a backslash (a separator on Windows); None for a name inside the folder,
    subfolders included. The name is judged, not the file it leads to: a shard that is a symbolic link, as every file
    of a Hugging Face cache snapshot is (`../../blobs/<hash>`), is the folder owner's and is followed."""
    if not isinstance(name, str) or not name.strip("./"):
        return "not a file name"
    if "\\" in name or "\0" in name:
        return "a backslash or NUL in a file name"
    if PurePosixPath(name).is_absolute() or PureWindowsPath(name).drive or PureWindowsPath(name).root:
        return "an absolute path"
    if ".." in name.split("/"):
        return "a path through \"..\""
    return None


def check_shard_names(index, weight_map: dict) -> None:
    """Refuses the shard index `index` (its path, for the message) if an entry of its `weight_map` names a file outside
    its folder (`shard_name_problem`): one ValueError naming the index and the entry."""
    for key, name in weight_map.items():
        problem = shard_name_problem(name)
        if problem:
            raise ValueError(f"{index}: the weight_map entry {key!r}: {name!r} does not name a file inside "
                             f"{Path(index).parent} ({problem}); refused: a shard must be a file of the checkpoint's "
                             "folder")


def _with_variant(name: str, variant: str | None) -> str:
    if not variant:
        return name
    stem, suffix = name.rsplit(".", 1)
    return f"{stem}.{variant}.{suffix}"


def check_index_names(source, *, subfolder: str = "", variant: str | None = None, **hub_kwargs) -> None:
    """Before `from_pretrained` reads `source` (a local folder, or a Hub id whose index is already in the local cache):
    refuses a shard index naming a file outside its folder (`check_shard_names`). An index that does not read is left
    to transformers' error (and `describe_unreadable`'s line)."""
    if source is None:
        return
    resolve = _resolver(source, subfolder, **hub_kwargs)
    for name in INDEX_NAMES:
        index = resolve(_with_variant(name, variant))
        if index is None:
            continue
        try:
            content = json.loads(index.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            continue
        weight_map = content.get("weight_map") if isinstance(content, dict) else None
        if isinstance(weight_map, dict):
            check_shard_names(index, weight_map)


def _resolver(source, subfolder: str = "", **hub_kwargs):
    """name -> the local Path of that file of `source` (a local directory, or a Hub id whose files are already in the
    local cache), or None."""
    if os.path.isdir(source):
        folder = Path(source, subfolder or "")
        return lambda name: folder / name if (folder / name).is_file() else None
    from transformers.utils import cached_file

    options = {k: hub_kwargs[k] for k in ("revision", "cache_dir", "token") if hub_kwargs.get(k) is not None}

    def resolve(name):
        try:
            path = cached_file(
                str(source), name, subfolder=subfolder or "", local_files_only=True,
                _raise_exceptions_for_missing_entries=False, **options,
            )
        except Exception:  # noqa: BLE001 - not in the cache: nothing to check here
            return None
        return Path(path) if path else None

    return resolve


def _safetensors_problem(path: Path) -> str | None:
    """What makes `path` unreadable as a safetensors file (empty, truncated, a header length past the end of the
    file, a header that is not JSON or does not describe tensors, tensor data past the end); None if it reads."""
    size = path.stat().st_size
    if size == 0:
        return f"{path} is empty (0 bytes): the write that made it did not finish, or it is not a weight file"
    if size < 8:
        return f"{path} is {size} bytes long, too short for a safetensors file: the file is truncated"
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        if length > size - 8:
            return (
                f"{path} is not a readable safetensors file: its first 8 bytes announce a {length}-byte header but the "
                f"file holds {size} bytes; it is truncated or not a safetensors file"
            )
        raw = handle.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        return f"{path} is not a readable safetensors file: its header is not JSON; the file is corrupt"
    if not isinstance(header, dict):
        return f"{path} is not a readable safetensors file: its header is not a JSON object; the file is corrupt"
    data = size - 8 - length
    try:
        end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    except (KeyError, IndexError, TypeError):
        return f"{path} is not a readable safetensors file: its header does not describe tensors; the file is corrupt"
    if end > data:
        return f"{path} is truncated: its tensors need {end} bytes of data but the file holds {data}"
    return None


def _index_problem(index: Path, check_shards: bool = True) -> str | None:
    """What makes a sharded checkpoint's index unusable (not JSON, no weight_map, a shard that is not there:
    `check_shards`, for a local folder; a Hub cache may not hold every shard yet)."""
    try:
        content = json.loads(index.read_text())
    except (UnicodeDecodeError, ValueError) as err:
        return f"{index} is not valid JSON ({err}); the index of a sharded checkpoint is corrupt"
    if not isinstance(content, dict) or not isinstance(content.get("weight_map"), dict):
        return f"{index} has no \"weight_map\" object naming the shard of each tensor; the index is corrupt"
    try:
        check_shard_names(index, content["weight_map"])
    except ValueError as err:
        return str(err)
    shards = set(content["weight_map"].values()) if check_shards else ()
    absent = sorted(str(shard) for shard in shards if not (index.parent / str(shard)).is_file())
    if absent:
        return f"{index} names shards that are not in {index.parent}: {listing(absent)}"
    if not isinstance(content.get("metadata"), dict):
        return f"{index} has no \"metadata\" object (transformers writes one with the total size); the index is corrupt"
    return None


def describe_unreadable(source, *, subfolder: str = "", **hub_kwargs) -> str | None:
    """After a load failed: one line naming the weight file or shard index of `source` that cannot be read and why
    (see `_safetensors_problem`, `_index_problem`); None when every file reads, so the original error stands. Looks
    only at local folders and files already in the Hub cache."""
    if source is None:
        return None
    resolve = _resolver(source, subfolder, **hub_kwargs)
    index = resolve("model.safetensors.index.json")
    if index is not None:
        problem = _index_problem(index, check_shards=os.path.isdir(source))
        if problem:
            return problem
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        paths = [path for shard in shards if (path := resolve(shard)) is not None]
    else:
        paths = [path for path in [resolve("model.safetensors")] if path is not None]
    for path in paths:
        if path.suffix == ".safetensors" and (problem := _safetensors_problem(path)):
            return problem
    return None
