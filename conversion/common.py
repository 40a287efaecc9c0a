"""Pieces shared by the converters: finding a source checkpoint, reading it shard by shard, writing
safetensors shards, and producing the output directory atomically (all or nothing)."""

import errno
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.utils import logging

logger = logging.get_logger("dcformer.conversion")

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "generation_config.json",
)
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
        patterns = ["config.json", *weights, *TOKENIZER_FILES]
        return Path(snapshot_download(src, revision=revision, allow_patterns=patterns))
    except Exception as err:
        raise OSError(f"downloading {src!r} from the Hub failed ({one_line(err)}); run again to resume it") from None


def read_config(src: Path) -> dict:
    config_file = src / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in {src}")
    return json.loads(config_file.read_text())


def weight_files(src: Path) -> list[Path]:
    """The checkpoint's weight files in order: from an index if there is one, else the single file."""
    for index_name, single in (
        ("model.safetensors.index.json", "model.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model.bin"),
    ):
        index = src / index_name
        if index.is_file():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
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


def iter_shard(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors of one weight file, read one at a time (safetensors) or memory-mapped (.bin)."""
    if path.suffix == ".safetensors":
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)
    else:
        state = torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
        for key in list(state):
            yield key, state.pop(key)
        del state


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


class ShardWriter:
    """Writes tensors into safetensors shards of at most `max_shard_size` bytes, holding one shard in memory,
    then the index (`model.safetensors.index.json`) or a single `model.safetensors`."""

    def __init__(self, directory: Path, max_shard_size: int):
        self.directory = directory
        self.max_shard_size = max_shard_size
        self.buffer: dict[str, torch.Tensor] = {}
        self.buffer_bytes = 0
        self.shards: list[tuple[str, list[str]]] = []
        self.total_bytes = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.buffer and self.buffer_bytes + size > self.max_shard_size:
            self.flush()
        self.buffer[key] = tensor.contiguous()
        self.buffer_bytes += size
        self.total_bytes += size

    def flush(self) -> None:
        if not self.buffer:
            return
        name = f"shard-{len(self.shards):05d}.tmp"
        save_file(self.buffer, str(self.directory / name), metadata={"format": "pt"})
        self.shards.append((name, list(self.buffer)))
        self.buffer, self.buffer_bytes = {}, 0

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


def check_destination(dst: Path, overwrite: bool) -> None:
    if dst.exists() and not dst.is_dir():
        raise FileExistsError(f"destination {dst} exists and is not a directory")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        raise FileExistsError(f"destination {dst} is not empty; pass --overwrite to replace its contents")


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


@contextmanager
def claim_destination(dst: Path):
    """Hold an exclusive lock (`.NAME.lock` beside `dst`) for as long as this process writes `dst`: a second
    conversion into the same destination fails at once instead of racing this one. The lock dies with the
    process (a crash never leaves it held) and its file is removed when done."""
    lock_path = dst.parent / f".{dst.name}.lock"
    try:
        import fcntl
    except ImportError:  # not POSIX: the lock library transformers already depends on
        from filelock import FileLock, Timeout

        lock = FileLock(str(lock_path), timeout=0)
        try:
            lock.acquire()
        except Timeout:
            raise FileExistsError(
                f"another conversion is writing {dst} (lock {lock_path}): wait for it or choose another destination"
            ) from None
        try:
            yield
        finally:
            lock.release()
        return
    for _ in range(10):
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = os.read(fd, 32).decode(errors="replace").strip()
            os.close(fd)
            if err.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            raise FileExistsError(
                f"another conversion{f' (process {holder})' if holder else ''} is writing {dst}: wait for it to "
                "finish or choose another destination"
            ) from None
        try:
            same = os.stat(lock_path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the previous holder removed the file between our open and our lock: take the new one
    else:
        raise FileExistsError(f"cannot lock {lock_path}: other conversions keep taking it")
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        try:
            os.unlink(lock_path)
        except OSError:
            pass
        os.close(fd)


def clean_stale_siblings(dst: Path) -> list[Path]:
    """Once `dst` is claimed, the hidden siblings of earlier runs into it are left-overs of a crash or a kill:
    a replaced old copy is put back if `dst` is missing (see `swap_directory`), and the `.NAME.partial-*` and
    `.NAME.replaced-*` directories (unfinished outputs, superseded copies) are removed. Says what it did."""
    from modeling_dcformer.hub import glob_escape, restore_replaced

    restore_replaced(dst)  # logs what it restored
    removed = []
    for kind in ("partial", "replaced"):
        for stale in sorted(dst.parent.glob(f".{glob_escape(dst.name)}.{kind}-*")):
            if stale.is_dir() and not stale.is_symlink():
                size = sum(f.stat().st_size for f in stale.rglob("*") if f.is_file() and not f.is_symlink())
                shutil.rmtree(stale)
                removed.append(stale)
                logger.warning(
                    f"removed {stale} ({size / 1e6:.1f} MB), left behind by an interrupted conversion into {dst}"
                )
    return removed


def install_output(tmp: Path, dst: Path, overwrite: bool) -> None:
    """Put the finished `tmp` at `dst` without ever deleting what this run did not create: an absent or empty
    `dst` is taken by one rename (which fails if another process filled it meanwhile); with `overwrite` an existing
    one is swapped atomically (`swap_directory`), so a crash at any moment leaves one complete copy."""
    from modeling_dcformer.hub import swap_directory

    if overwrite and dst.is_dir() and any(dst.iterdir()):
        swap_directory(tmp, dst)
        return
    try:
        os.rename(tmp, dst)  # POSIX: replaces an empty directory only
    except OSError as err:
        if err.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise FileExistsError(
                f"destination {dst} was filled by another process during the conversion: left as it is, the "
                "result was discarded; run again (with --overwrite to replace it) or choose another destination"
            ) from None
        raise


@contextmanager
def atomic_output_dir(dst: Path, overwrite: bool = False, source: Path | None = None):
    """Yields a temporary directory beside `dst`; on success it takes `dst`'s place (`install_output`), on failure
    it is removed, so `dst` is either the complete result or untouched. `dst` is claimed for the whole run
    (`claim_destination`), and may not be, hold or lie inside `source`; left-overs of earlier interrupted runs
    into `dst` are cleaned up first (`clean_stale_siblings`)."""
    dst = Path(dst)
    check_not_source(dst, source)
    if dst.exists() and not dst.is_dir():
        raise FileExistsError(f"destination {dst} exists and is not a directory")
    dst.parent.mkdir(parents=True, exist_ok=True)
    with claim_destination(dst):
        clean_stale_siblings(dst)
        check_destination(dst, overwrite)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
        try:
            yield tmp
            install_output(tmp, dst, overwrite)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


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


def parse_dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    dtypes = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
              "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if name not in dtypes:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(dtypes)}")
    return dtypes[name]


def add_hub_arguments(parser, default_license: str | None) -> None:
    """`--push-to-hub REPO`, `--private`, `--token`, `--license` (the converters' Hub options)."""
    hub = parser.add_argument_group("sharing on the Hub")
    hub.add_argument(
        "--push-to-hub",
        metavar="REPO",
        default=None,
        help="upload the finished output directory to this Hub model repository ('name' or 'namespace/name'; "
        "created if needed); the output carries the remote code and a model card either way",
    )
    hub.add_argument("--private", action="store_true", help="create the repository private")
    hub.add_argument("--token", default=None, help="Hub token (default: the saved login or $HF_TOKEN)")
    hub.add_argument(
        "--license",
        default=default_license,
        help=f"license in the model card's metadata (default: {default_license or 'none written'})",
    )


def write_shareable(directory: Path, config, name: str, repo_id: str | None = None, **card_kwargs) -> None:
    """Make a converted directory (holding its config.json) loadable without this package and describe it: the
    remote code with `auto_map`, and the model card (`card_kwargs`: `license`, `base_model`, ...)."""
    from modeling_dcformer.hub import write_model_card, write_remote_code

    write_remote_code(directory)
    write_model_card(directory, config, model_name=(repo_id or name).split("/")[-1], repo_id=repo_id, **card_kwargs)


def push_output(directory: Path, repo_id: str, private: bool = False, token: str | None = None, message: str = ""):
    """Upload a finished output directory. A failed upload leaves it in place and raises `hub.HubUploadError`, whose
    one-line message names the directory, the failure and the `hf upload` command that retries just the upload."""
    from modeling_dcformer.hub import HubUploadError, push_folder, retry_upload_command

    try:
        info = push_folder(directory, repo_id, private=private or None, token=token, commit_message=message or None)
    except Exception as err:  # network, authentication, permissions: one line, not the HTTP client's traceback
        retry = retry_upload_command(repo_id, Path(directory).resolve(), private)
        raise HubUploadError(
            f"the conversion is complete in {Path(directory).resolve()}, but uploading it to {repo_id} failed "
            f"({one_line(err)}); retry the upload with: {retry}"
        ) from err
    print(f"Pushed {directory} -> {getattr(info, 'commit_url', None) or repo_id}")
