"""The fingerprint of a DCFormer model's weights: sha256 over its state dict, each tensor in name order as its name,
dtype and shape, then its bytes. A converter records the fingerprint of the weights it wrote (`checkpoint_fingerprint`,
read from the files); a save computes it from the model (`model_fingerprint`), so that the model card can tell whether
a converted model still holds exactly the converted weights."""

import hashlib
import json
from pathlib import Path

import torch

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip
CHUNK = 16 << 20  # bytes of a stored tensor hashed at a time


def add_tensor(digest, name: str, dtype: torch.dtype, shape: tuple, data) -> None:
    """One tensor of the fingerprint: its name, dtype and shape, then its bytes."""
    digest.update(f"{name} {dtype} {tuple(shape)}\n".encode())
    digest.update(data)


def model_fingerprint(model) -> str | None:
    """The fingerprint of `model`'s state dict; None where a tensor is not all here (offloaded, a tensor-parallel
    shard)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        if type(tensor) is not torch.Tensor or tensor.device.type == "meta":  # a DTensor shard, an offloaded tensor
            return None
        add_tensor(digest, name, tensor.dtype, tensor.shape,
                   tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())
    return "sha256:" + digest.hexdigest()


def safetensors_header(path: Path) -> dict[str, tuple[torch.dtype, list[int], int, int]]:
    """name -> (dtype, shape, first byte, end byte) of every tensor of a safetensors file, from its header."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return {
        name: (SAFETENSORS_DTYPES[info["dtype"]], info["shape"], 8 + size + info["data_offsets"][0],
               8 + size + info["data_offsets"][1])
        for name, info in header.items()
    }  # fmt: skip


def safetensors_files(directory: Path) -> list[Path]:
    """The safetensors files of a saved checkpoint: the shards its index names, or its `model.safetensors`."""
    index = Path(directory) / "model.safetensors.index.json"
    if index.is_file():
        shards = json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()
        return [Path(directory) / name for name in sorted(set(shards))]
    return [Path(directory) / "model.safetensors"]


def checkpoint_fingerprint(directory: Path, config) -> str:
    """The fingerprint of the model a saved checkpoint loads as (in `config.dtype`, which `from_pretrained` loads; a
    tied head is the embedding), equal to `model_fingerprint` of that model. Read from the files with plain reads,
    one tensor in memory at a time (no memory map that would stay resident)."""
    from ..modeling_dcformer import DCFormerForCausalLM

    with torch.device("meta"):
        names = sorted(DCFormerForCausalLM(config).state_dict())
    dtype = config.dtype if isinstance(config.dtype, torch.dtype) else getattr(torch, str(config.dtype))
    where = {}
    for file in safetensors_files(directory):
        where.update({key: (file, entry) for key, entry in safetensors_header(file).items()})
    digest = hashlib.sha256()
    for name in names:
        stored = "model.embed_tokens.weight" if name == "lm_head.weight" and config.tie_word_embeddings else name
        file, (stored_dtype, shape, begin, end) = where[stored]
        with open(file, "rb") as f:
            f.seek(begin)
            if stored_dtype == dtype:  # the bytes as stored, hashed as they are read: no copy of the tensor
                add_tensor(digest, name, dtype, shape, b"")
                for done in range(begin, end, CHUNK):
                    digest.update(f.read(min(CHUNK, end - done)))
                continue
            data = bytearray(end - begin)
            f.readinto(data)
        tensor = torch.frombuffer(data, dtype=stored_dtype).to(dtype) if data else torch.empty(0, dtype=dtype)
        add_tensor(digest, name, dtype, shape, tensor.contiguous().view(torch.uint8).numpy())
    return "sha256:" + digest.hexdigest()


__all__ = ["checkpoint_fingerprint", "model_fingerprint"]
