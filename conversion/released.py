"""Re-save an authors' released DCFormer checkpoint (Caiyun-AI/DCPythia-6.9B, Caiyun-AI/DCFormer-2.8B, or a
local directory in that layout) in this project's native layout: our config, safetensors shards, the
tokenizer files, dtype kept, the remote code (so that it loads with `trust_remote_code=True` where this package is
not installed) and a model card (base_model: the source when it is a Hub id).

    dcformer-convert-released Caiyun-AI/DCPythia-6.9B ./dcpythia-6.9b-hf
    dcformer-convert-released Caiyun-AI/DCPythia-6.9B ./dcpythia-6.9b-hf --push-to-hub me/DCPythia-6.9B-hf

(`--license ID` puts the release's license, as its own model card states it, in the card's metadata.)

It streams: at most one source shard is in memory at a time (a memory-mapped `.bin`; safetensors are read one
tensor at a time) and every tensor is written to disk as it comes, so a 14 GB checkpoint converts within a few
GB. The destination appears only once complete (written beside it, then renamed).
"""

import re
import sys
from pathlib import Path

import torch

from modeling_dcformer import DCFormerConfig
from modeling_dcformer.checkpoints.released_format import SPLIT_QKV, is_released_config, native_key, query_wise_slots
from modeling_dcformer.conversion.converter import Converter, UnknownTensor

IDENTITY_BUFFERS = re.compile(r"dyn_w_proj\.(pre_proj|post_proj)\.w$")


def check_identity_buffer(key: str, tensor: torch.Tensor) -> None:
    """The released static composition weights must be the identity (static weights off); anything else
    would change the function and is refused rather than silently dropped."""
    if tensor.dim() < 2 or tensor.shape[-1] != tensor.shape[-2]:
        raise ValueError(f"{key}: expected identity matrices, got shape {tuple(tensor.shape)}")
    eye = torch.eye(tensor.shape[-1], dtype=tensor.dtype).expand_as(tensor)
    if not torch.equal(tensor, eye):
        raise ValueError(
            f"{key} is not the identity: this checkpoint uses learned static composition weights, "
            "which this implementation does not support"
        )


def fuse_qkv(parts: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    """Split q, k and v projections (`wq`, `wk`, `wv`) as our fused one, or a one-line error naming `key`."""
    try:
        return torch.cat([parts["wq"], parts["wk"], parts["wv"]], dim=0)
    except RuntimeError as err:  # their other dimensions differ
        shapes = {name: tuple(tensor.shape) for name, tensor in sorted(parts.items())}
        raise ValueError(f"{key}: the split q/k/v projections do not fit together: {shapes}") from err


class ReleasedConverter(Converter):
    """The released layout -> ours: the config translated, the tensors renamed (split q/k/v fused, query-wise slots
    laid out as ours), the derived ones (merged copies, cache buffers) dropped and the static composition weights
    checked to be the identity."""

    tool = "dcformer-convert-released"
    source_help = "released checkpoint: local directory or Hub id (e.g. Caiyun-AI/DCPythia-6.9B)"
    push_message = "Re-save {src} in the native DCFormer layout"

    def __init__(self, src: str, dst: str, options):
        super().__init__(src, dst, options)
        self.split_parts: dict[tuple[str, str], dict[str, torch.Tensor]] = {}

    def make_config(self, raw: dict) -> DCFormerConfig:
        if not is_released_config(raw):
            raise ValueError(
                f"{self.src}: config.json is not in the released DCFormer layout (keys dim, n_layer, n_head); "
                "a checkpoint already in our layout loads with from_pretrained as it is"
            )
        return DCFormerConfig.from_dict(raw)

    def map_tensor(self, key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if IDENTITY_BUFFERS.search(key):
            check_identity_buffer(key, tensor)
            return []
        try:
            ours = native_key(key, self.config.use_gated_mlp)
        except KeyError:
            raise UnknownTensor(f"{key!r} is not a key of the released layout") from None
        if ours is None:
            return []  # derived tensor (merged copies, cache buffers): recomputed, never trusted
        split = SPLIT_QKV.match(key)
        if split is None:
            if self.config.query_wise:
                tensor = query_wise_slots(ours, tensor, self.config.heads_per_group)
            return [(ours, tensor)]
        layer, part, kind = split.groups()
        parts = self.split_parts.setdefault((layer, kind), {})
        parts[part] = tensor
        if len(parts) < 3:
            return []  # held until its companions arrive
        del self.split_parts[(layer, kind)]
        return [(f"model.layers.{layer}.self_attn.qkv_proj.{kind}", fuse_qkv(parts, key))]

    def added_tensors(self) -> list:
        """None: a release holds every tensor. Split q/k/v projections still held are an incomplete source."""
        if self.split_parts:
            incomplete = {
                f"layers.{layer}.attention.*.{kind}": sorted(parts) for (layer, kind), parts in self.split_parts.items()
            }
            raise ValueError(f"split q/k/v projections are incomplete (found only): {incomplete}")
        return []

    def summary(self) -> str:
        return f"{len(self.written)} tensors, {len(self.files)} source file(s)"


def convert(src: str, dst: str, **options) -> Path:
    """Convert `src` into our layout at `dst` (with the remote code and a model card, `license` in its metadata),
    with `options` the fields of `ConversionOptions`; `push_to_hub` (a repository id) uploads `dst` once complete
    (`private`, `token`)."""
    return ReleasedConverter.convert(src, dst, **options)


def main(argv: list[str] | None = None) -> int:
    return ReleasedConverter.main(argv, description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
