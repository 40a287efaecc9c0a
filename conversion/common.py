"""Pieces shared by the converters: finding a source checkpoint, reading it shard by shard, writing
safetensors shards, producing the output directory atomically (all or nothing), recording where a conversion comes
from, and sharing its result. `converter.Converter` is the pipeline that puts them together."""

import errno
import json
import os
import pickle
import re
import shutil
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from filelock import FileLock, Timeout
from safetensors import SafetensorError, safe_open
from transformers.utils import logging

from modeling_dcformer.checkpoints import atomic_dir
from modeling_dcformer.checkpoints.weight_files import check_shard_names

logger = logging.get_logger(__name__)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
SOURCE_CARD = "README.md"  # the source's model card, downloaded with it: its licence (`card_metadata`)
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json")


def one_line(err: BaseException) -> str:
    """An exception as `Type: first line of its message` (at most 200 characters of it)."""
    reason = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
    return f"{type(err).__name__}: {reason}" if reason else type(err).__name__


def resolve_source(src: str, revision: str | None = None) -> Path:
    """A local checkpoint directory, or a Hub id downloaded (config, weights and tokenizer files only)."""
    path = Path(src)
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"source {src!r} is a file, not a checkpoint directory")
    if src.startswith((".", "/")) or src.count("/") > 1:
        raise FileNotFoundError(f"source directory {src!r} does not exist")
    from huggingface_hub import HfApi, snapshot_download

    from huggingface_hub.utils import logging as hub_logging

    logger.info(f"{src!r} is not a local directory: looking it up on the Hub")
    verbosity = hub_logging.get_verbosity()
    hub_logging.set_verbosity_error()  # no "Retrying in 8s" lines for what may be a mistyped local path
    try:
        # Many repositories carry the same weights twice (.bin and .safetensors): fetch one format only.
        files = HfApi().list_repo_files(src, revision=revision)
    except Exception as err:  # a mistyped local path reads as a Hub id: one line, not the HTTP client's traceback
        at = f" at revision {revision!r}" if revision else ""
        raise FileNotFoundError(
            f"source {src!r}: no such directory, and not reachable as a Hub id{at} ({one_line(err)}); check the "
            "path, or the id and your network"
        ) from None
    finally:
        hub_logging.set_verbosity(verbosity)
    has_safetensors = any(name.endswith(".safetensors") for name in files)
    weights = [p for p in WEIGHT_PATTERNS if ("safetensors" in p) == has_safetensors]
    try:
        patterns = ["config.json", *weights, *TOKENIZER_FILES, SOURCE_CARD]
        return Path(snapshot_download(src, revision=revision, allow_patterns=patterns))
    except Exception as err:
        raise OSError(f"downloading {src!r} from the Hub failed ({one_line(err)}); run again to resume it") from None


def read_json(path: Path) -> dict:
    """A JSON object from `path`, or a one-line ValueError naming the file (a hand-edited or truncated config or
    index reads as "Expecting value: line 1 column 1" otherwise, which names nothing)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({one_line(err)})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, not an object")
    return data


def read_config(src: Path) -> dict:
    config_file = src / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in {src}")
    return read_json(config_file)


def weight_files(src: Path) -> list[Path]:
    """The checkpoint's weight files in order: from an index if there is one, else the single file. An index naming
    a file outside `src` (an absolute path, a ".." part: `check_shard_names`) is refused before anything is read."""
    for index_name, single in (
        ("model.safetensors.index.json", "model.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model.bin"),
    ):
        index = src / index_name
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ValueError(f"{index} has no weight_map of tensor names to file names")
            check_shard_names(index, weight_map)
            names = sorted(set(weight_map.values()))
            missing = [name for name in names if not (src / name).is_file()]
            if missing:
                raise FileNotFoundError(f"{index} names shard files that are missing: {missing}")
            return [src / name for name in names]
        if (src / single).is_file():
            return [src / single]
    loose = sorted(src.glob("*.safetensors")) or sorted(src.glob("*.bin"))
    if not loose:
        raise FileNotFoundError(f"no weights (*.safetensors or *.bin) in {src}")
    return loose


def unreadable(path: Path, err: BaseException) -> ValueError:
    """The one-line error for a weight file that cannot be read (truncated, garbage, not a checkpoint)."""
    return ValueError(f"cannot read the weight file {path}: it is truncated or corrupt ({one_line(err)})")


def shard_keys(path: Path) -> list[str]:
    """The tensor names of a safetensors file (its header only), or a one-line error naming the file."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError, RuntimeError) as err:
        raise unreadable(path, err) from None


# safetensors' dtype names, for the files read and written here without the whole file mapped into memory
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def safetensors_header(path: Path) -> tuple[dict, int]:
    """(the header's tensor entries, where the data starts) of a safetensors file that `safe_open` has validated."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header, 8 + length


def read_into(f, tensor: torch.Tensor, offset: int) -> bool:
    """Fill `tensor` (contiguous) with the bytes of the open file `f` from `offset`; False if the file ends first."""
    view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    f.seek(offset)
    done = 0
    while done < len(view):
        count = f.readinto(view[done:])
        if not count:
            return False
        done += count
    return True


def iter_shard(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors of one weight file, read one at a time (safetensors) or memory-mapped (.bin). A file that cannot be
    read is a one-line ValueError naming it. A safetensors file is validated by `safe_open`, then each tensor is read
    with plain reads into its own memory: a mapping of the whole file would keep every page read so far resident in
    the process until the file is closed (a single-file checkpoint: all of it)."""
    if path.suffix == ".safetensors":
        try:
            with safe_open(str(path), framework="pt") as f:
                keys = list(f.keys())
            header, start = safetensors_header(path)
        except (SafetensorError, OSError, RuntimeError, ValueError, struct.error) as err:
            raise unreadable(path, err) from None
        with open(path, "rb", buffering=0) as f:
            for key in keys:
                entry = header[key]
                dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
                if dtype is None:  # a dtype read here without a mapping: safetensors' own reader, for this tensor
                    try:
                        with safe_open(str(path), framework="pt") as mapped:
                            tensor = mapped.get_tensor(key)
                    except (SafetensorError, OSError, RuntimeError) as err:
                        raise unreadable(path, err) from None
                else:
                    tensor = torch.empty(entry["shape"], dtype=dtype)
                    if not read_into(f, tensor, start + entry["data_offsets"][0]):
                        raise unreadable(path, EOFError(f"the file ends inside the tensor {key!r}"))
                yield key, tensor
                del tensor  # not kept while the next one is read
    else:
        try:
            state = torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
        except (pickle.UnpicklingError, EOFError, OSError, RuntimeError, ValueError) as err:
            raise unreadable(path, err) from None
        if not isinstance(state, dict):
            raise ValueError(f"{path} holds a {type(state).__name__}, not a dictionary of tensors")
        for key in list(state):
            yield key, state.pop(key)
        del state


def count_tensors(files: list[Path]) -> int | None:
    """How many tensors the checkpoint holds (for the progress bar), when cheap to know."""
    index = sorted(files[0].parent.glob("*.index.json")) if files else []
    if index:
        return len(read_json(index[0]).get("weight_map") or {}) or None
    if all(f.suffix == ".safetensors" for f in files):
        return sum(len(shard_keys(f)) for f in files)
    return None


def parse_size(size: str | int) -> int:
    """'5GB', '500MB', '2GiB' or a number of bytes."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", size, re.IGNORECASE)
    if not match:
        raise ValueError(f"cannot read the size {size!r}: use e.g. 5GB or 500MB")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    factor = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[unit]
    return int(number * factor)


def append_file(out, path: Path) -> None:
    """The bytes of the file `path` appended to the open file `out` (copied by the kernel where it can)."""
    with open(path, "rb") as data:
        size, done = os.fstat(data.fileno()).st_size, 0
        out.flush()
        try:
            while done < size:
                copied = os.copy_file_range(data.fileno(), out.fileno(), size - done)
                if copied == 0:
                    break
                done += copied
        except (AttributeError, OSError) as err:  # no copy_file_range (or not across these file systems)
            if isinstance(err, OSError) and err.errno in DISK_FULL:
                raise
        if done < size:
            data.seek(done)
            out.seek(0, os.SEEK_END)
            shutil.copyfileobj(data, out, 16 << 20)


class ShardWriter:
    """Writes tensors into safetensors shards of at most `max_shard_size` bytes, then the index
    (`model.safetensors.index.json`) or a single `model.safetensors`. It streams: each tensor's bytes go to a data
    file as it is added (nothing is kept in memory); `flush` writes the shard, its header then that data."""

    def __init__(self, directory: Path, max_shard_size: int):
        self.directory = directory
        self.max_shard_size = max_shard_size
        self.entries: dict[str, dict] = {}  # the current shard's header entries
        self.buffer_bytes = 0  # its data's size
        self.data = None  # its data file, open
        self.shards: list[tuple[str, list[str]]] = []
        self.total_bytes = 0

    def shard_name(self) -> str:
        return f"shard-{len(self.shards):05d}.tmp"

    def add(self, key: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.entries and self.buffer_bytes + size > self.max_shard_size:
            self.flush()
        if tensor.dtype not in DTYPE_NAMES:
            raise ValueError(f"{key}: dtype {tensor.dtype} cannot be saved in safetensors by this converter")
        data_path = self.directory / (self.shard_name() + ".data")
        try:
            if self.data is None:
                self.data = open(data_path, "wb")
            if size:
                self.data.write(memoryview(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
        except OSError as err:
            raise write_error(data_path, err) from None
        offsets = [self.buffer_bytes, self.buffer_bytes + size]
        self.entries[key] = {"dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": offsets}
        self.buffer_bytes += size
        self.total_bytes += size

    def flush(self) -> None:
        if not self.entries:
            return
        name = self.shard_name()
        data_path = self.directory / (name + ".data")
        header = json.dumps({"__metadata__": {"format": "pt"}, **self.entries}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned (as safetensors' own writer does)
        try:
            self.data.close()
            with open(self.directory / name, "wb") as out:
                out.write(struct.pack("<Q", len(header)) + header)
                append_file(out, data_path)
            os.remove(data_path)
        except OSError as err:
            raise write_error(self.directory / name, err) from None
        self.shards.append((name, list(self.entries)))
        self.entries, self.buffer_bytes, self.data = {}, 0, None

    def finish(self) -> list[str]:
        """Names the shards in transformers' scheme and writes the index; returns the weight file names."""
        self.flush()
        if len(self.shards) == 1:
            os.replace(self.directory / self.shards[0][0], self.directory / "model.safetensors")
            return ["model.safetensors"]
        weight_map, names = {}, []
        for i, (tmp_name, keys) in enumerate(self.shards):
            name = f"model-{i + 1:05d}-of-{len(self.shards):05d}.safetensors"
            os.replace(self.directory / tmp_name, self.directory / name)
            weight_map.update({key: name for key in keys})
            names.append(name)
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return names


def cast_checkpoint(src: Path, dst: Path, dtype: torch.dtype, max_shard_size: int) -> list[str]:
    """Write the weights of the checkpoint directory `src` into `dst`, cast to `dtype`, in shards of at most
    `max_shard_size` bytes (one tensor in memory at a time). Returns the weight file names."""
    writer = ShardWriter(dst, max_shard_size)
    for file in weight_files(src):
        for key, tensor in iter_shard(file):
            writer.add(key, tensor.to(dtype))
    return writer.finish()


def write_error(path: Path, err: BaseException) -> OSError:
    """A one-line OSError for a failed write of `path` that keeps the system's error number (a full disk stays
    ENOSPC) wherever it can be read: safetensors wraps it into a message of its own ("... (os error 28)")."""
    code = getattr(err, "errno", None)
    if code is None:
        match = re.search(r"os error (\d+)", str(err))
        code = int(match.group(1)) if match else None
    if code is None:
        return OSError(f"cannot write {path}: {one_line(err)}")
    return OSError(code, f"cannot write {path}: {os.strerror(code)}")


DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def check_not_source(dst: Path, source: Path | None) -> None:
    """Refuse a destination that is the source, inside it, or holding it: replacing it would delete the source."""
    if source is None:
        return
    d, s = Path(dst).resolve(), Path(source).resolve()
    if d == s:
        raise ValueError(f"destination {dst} is the source checkpoint itself: choose another output directory")
    if s in d.parents:
        raise ValueError(f"destination {dst} is inside the source checkpoint {source}: choose a directory outside it")
    if d in s.parents:
        raise ValueError(f"destination {dst} contains the source checkpoint {source}: choose another output directory")


def check_replaceable(real: Path, dst) -> None:
    """Refuse a destination that a conversion cannot replace as a whole: the current directory or one holding it
    (the result takes that folder's place: a shell inside it would be left in a deleted folder, and everything
    else the folder holds would go), or a mount point (no rename replaces it)."""
    try:
        cwd = Path.cwd().resolve()
    except OSError:  # the working directory was deleted: nothing to protect
        cwd = None
    if cwd is not None and (cwd == real or real in cwd.parents):
        what = "is" if cwd == real else "holds"
        raise ValueError(
            f"destination {dst} {what} the current directory ({cwd}): a conversion replaces its destination folder "
            "as a whole; run it from outside that folder or choose another destination"
        )
    if os.path.ismount(real):
        raise ValueError(f"destination {dst} is a mount point, which cannot be replaced: choose a folder inside it")


def check_empty(real: Path, dst, overwrite: bool) -> None:
    if not overwrite and real.is_dir() and any(real.iterdir()):
        raise FileExistsError(f"destination {dst} is not empty; pass --overwrite to replace its contents")


def check_destination(dst, overwrite: bool = False, source: Path | None = None) -> Path:
    """Every refusal of a destination that can be known before converting (so that none comes after hours of
    work): the real folder `dst` names (a symbolic link: the folder it points to), or a one-line error."""
    real = atomic_dir.resolve(dst)  # a file there: NotADirectoryError
    check_not_source(real, source)
    check_replaceable(real, dst)
    check_empty(real, dst, overwrite)
    return real


@contextmanager
def output_directory(dst, overwrite: bool = False, source: Path | None = None):
    """Yields an empty hidden folder to write the conversion into; on success it takes the place of the folder `dst`
    names (`atomic_dir.replacing`: one swap, a crash at any moment leaves one complete copy; a symbolic link stays
    a link and its folder gets the result), on any failure `dst` is left as it was. Destinations that cannot be
    taken are refused before any work (`check_destination`); a second conversion into the same folder fails at
    once instead of waiting hours for the first; a failed write (a full disk) is one line naming `dst`."""
    real = check_destination(dst, overwrite, source)
    real.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(atomic_dir.lock_file(real)), timeout=0)  # the lock atomic_dir.replacing takes
    try:
        lock.acquire()
    except Timeout:
        raise FileExistsError(
            f"another conversion is writing {dst}: wait for it to finish or choose another destination"
        ) from None
    lock.release()  # (a writer that takes it now is waited for, then the destination is checked again)
    try:
        with atomic_dir.replacing(real, overwrite=overwrite) as tmp:
            check_empty(real, dst, overwrite)  # filled while this run waited for the lock
            yield tmp
    except OSError as err:
        if err.errno not in DISK_FULL:
            raise
        where = f" ({err.filename2 or err.filename})" if err.filename2 or err.filename else ""
        raise OSError(
            err.errno,
            f"writing the conversion into {dst} failed: {err.strerror}{where}; {dst} was left as it was and the "
            "partial output removed",
        ) from None


def copy_tokenizer_files(src: Path, dst: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied


def expected_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every tensor a `DCFormerForCausalLM` of this config needs, with its shape (built on the meta device:
    no memory). A tied output head is not a tensor of its own."""
    from modeling_dcformer import DCFormerForCausalLM

    with torch.device("meta"):
        model = DCFormerForCausalLM(config)
    shapes = {key: tuple(t.shape) for key, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def snapshot_of(src_dir: Path) -> tuple[str | None, str | None]:
    """(Hub id, commit) of a directory in the Hub cache (`.../models--NAMESPACE--NAME/snapshots/<sha>`), else
    (None, None)."""
    repo, parent = src_dir.parent.parent.name, src_dir.parent.name
    if parent == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", src_dir.name) and repo.startswith("models--"):
        return repo.removeprefix("models--").replace("--", "/"), src_dir.name
    return None, None


def source_provenance(src: str, src_dir: Path, revision: str | None = None) -> dict:
    """Where a converted model comes from, as a reader of its config (or of its card, once uploaded) can use it:
    `converted_from` a Hub id (given, or recovered from a Hub cache folder) with `converted_from_revision` and
    `converted_from_commit`; for any other local folder only `converted_from_folder`, its name. Never an absolute
    local path: it means nothing elsewhere and an upload would publish it."""
    repo_id, commit = snapshot_of(src_dir)
    if not Path(src).is_dir():  # a Hub id, downloaded into the cache
        repo_id = src
    folder = None if repo_id else Path(os.path.abspath(src_dir)).name
    return dict(
        converted_from=repo_id,
        converted_from_folder=folder,
        converted_from_revision=revision,
        converted_from_commit=commit,
    )


def parse_dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    dtypes = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
              "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if name not in dtypes:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(dtypes)}")
    return dtypes[name]


def write_shareable(directory: Path, config, name: str, repo_id: str | None = None, **card_kwargs) -> None:
    """Make a converted directory (holding its config.json) loadable without this package and describe it: the
    remote code with `auto_map`, and the model card (`card_kwargs`: `license`, `base_model`, ...)."""
    from modeling_dcformer.publishing import write_model_card, write_remote_code

    write_remote_code(directory)
    write_model_card(directory, config, model_name=(repo_id or name).split("/")[-1], repo_id=repo_id, **card_kwargs)


def push_output(directory: Path, repo_id: str, private: bool = False, token: str | None = None, message: str = ""):
    """Upload a finished output directory. A failed upload leaves it in place and raises `hub.HubUploadError` (the
    error `save_pretrained(push_to_hub=True)` raises), whose one-line message names the directory, the failure and the
    `hf upload` command that retries just the upload."""
    from modeling_dcformer.publishing import HubUploadError, push_folder

    try:
        info = push_folder(directory, repo_id, private=private or None, token=token, commit_message=message or None)
    except Exception as err:  # network, authentication, permissions: one line, not the HTTP client's traceback
        raise HubUploadError.of(err, repo_id, Path(directory).resolve(), private) from None
    print(f"Pushed {directory} -> {getattr(info, 'commit_url', None) or repo_id}")
