"""Re-save an authors' released DCFormer checkpoint (Caiyun-AI/DCPythia-6.9B, Caiyun-AI/DCFormer-2.8B, or a
local directory in that layout) in this project's native layout: our config, safetensors shards, the
tokenizer files, dtype kept, the remote code (so that it loads with `trust_remote_code=True` where this package is
not installed) and a model card (base_model: the source when it is a Hub id).

    dcformer-convert-released Caiyun-AI/DCPythia-6.9B ./dcpythia-6.9b-hf
    dcformer-convert-released Caiyun-AI/DCPythia-6.9B ./dcpythia-6.9b-hf --push-to-hub me/DCPythia-6.9B-hf

(`--license ID` puts the release's license, as its own model card states it, in the card's metadata.)

It streams: one source shard and one output shard are in memory at a time, so a 14 GB checkpoint converts
within a few GB. The destination appears only once complete (written beside it, then renamed).
"""

import argparse
import re
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers.utils import logging

from modeling_dcformer import DCFormerConfig
from modeling_dcformer.conversion.common import (
    ShardWriter,
    add_hub_arguments,
    check_destination,
    copy_tokenizer_files,
    expected_shapes,
    iter_shard,
    output_directory,
    parse_dtype,
    parse_size,
    push_output,
    read_config,
    resolve_source,
    source_provenance,
    weight_files,
    write_shareable,
)
from modeling_dcformer.checkpoints.fingerprint import checkpoint_fingerprint
from modeling_dcformer.publishing import HubUploadError, check_repo_id
from modeling_dcformer.checkpoints.released_format import SPLIT_QKV, is_released_config, native_key, query_wise_slots

logger = logging.get_logger("dcformer.caiyun_to_hf")
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


def convert(
    src: str,
    dst: str,
    overwrite: bool = False,
    max_shard_size: str | int = "5GB",
    dtype: str | None = None,
    revision: str | None = None,
    push_to_hub: str | None = None,
    private: bool = False,
    token: str | None = None,
    license: str | None = None,
) -> Path:
    """Convert `src` into our layout at `dst` (with the remote code and a model card, `license` in its metadata);
    `push_to_hub` (a repository id) uploads `dst` once complete (`private`, `token`)."""
    if push_to_hub is not None:
        check_repo_id(push_to_hub)
    check_destination(dst, overwrite)  # refused before a download or any work
    src_dir = resolve_source(src, revision)
    raw_config = read_config(src_dir)
    if not is_released_config(raw_config):
        raise ValueError(
            f"{src}: config.json is not in the released DCFormer layout (keys dim, n_layer, n_head); "
            "a checkpoint already in our layout loads with from_pretrained as it is"
        )
    config = DCFormerConfig.from_dict(raw_config)
    for key, value in source_provenance(src, src_dir, revision).items():
        setattr(config, key, value)
    shapes = expected_shapes(config)
    target_dtype = parse_dtype(dtype)
    files = weight_files(src_dir)
    dst_path = Path(dst)

    with output_directory(dst_path, overwrite, source=src_dir) as tmp:
        writer = ShardWriter(tmp, parse_size(max_shard_size))
        written: dict[str, torch.dtype] = {}
        split_parts: dict[tuple[str, str], dict[str, torch.Tensor]] = {}

        def put(key: str, tensor: torch.Tensor, source_key: str) -> None:
            if key not in shapes:
                raise ValueError(f"{source_key}: the model has no tensor {key!r} for it (config mismatch?)")
            if tuple(tensor.shape) != shapes[key]:
                raise ValueError(
                    f"{source_key} -> {key}: checkpoint shape {tuple(tensor.shape)} vs model shape {shapes[key]}"
                )
            if key in written:
                raise ValueError(f"{source_key}: {key} appears twice in the checkpoint")
            written[key] = tensor.dtype
            writer.add(key, tensor if target_dtype is None else tensor.to(target_dtype))

        for file in tqdm(files, desc="Converting shards", unit="shard"):
            for source_key, tensor in iter_shard(file):
                if IDENTITY_BUFFERS.search(source_key):
                    check_identity_buffer(source_key, tensor)
                    continue
                try:
                    key = native_key(source_key, config.use_gated_mlp)
                except KeyError:
                    raise ValueError(f"{file.name}: {source_key!r} is not a key of the released layout") from None
                if key is None:
                    continue  # derived tensor (merged copies, cache buffers): recomputed, never trusted
                split = SPLIT_QKV.match(source_key)
                if split is None:
                    if config.query_wise:
                        tensor = query_wise_slots(key, tensor, config.heads_per_group)
                    put(key, tensor, source_key)
                    continue
                layer, part, kind = split.groups()
                parts = split_parts.setdefault((layer, kind), {})
                parts[part] = tensor
                if len(parts) == 3:
                    fused = torch.cat([parts["wq"], parts["wk"], parts["wv"]], dim=0)
                    put(f"model.layers.{layer}.self_attn.qkv_proj.{kind}", fused, source_key)
                    del split_parts[(layer, kind)]
        if split_parts:
            incomplete = {f"layers.{layer}.attention.*.{kind}": sorted(p) for (layer, kind), p in split_parts.items()}
            raise ValueError(f"split q/k/v projections are incomplete (found only): {incomplete}")
        missing = sorted(set(shapes) - set(written))
        if missing:
            raise ValueError(f"the checkpoint lacks tensors the model needs: {missing}")
        writer.finish()
        saved_dtypes = {target_dtype} if target_dtype is not None else set(written.values())
        config.dtype = max(saved_dtypes, key=lambda d: torch.finfo(d).bits) if saved_dtypes else None
        config.architectures = ["DCFormerForCausalLM"]
        config.conversion = {"tool": "dcformer-convert-released", "weights": checkpoint_fingerprint(tmp, config)}
        config.save_pretrained(tmp)
        copied = copy_tokenizer_files(src_dir, tmp)
        logger.info(f"copied tokenizer files: {copied}")
        write_shareable(tmp, config, dst_path.name, repo_id=push_to_hub, license=license)
    print(f"Converted {src} -> {dst_path} ({len(written)} tensors, {len(files)} source file(s))")
    if push_to_hub is not None:
        push_output(dst_path, push_to_hub, private, token, message=f"Re-save {src} in the native DCFormer layout")
    return dst_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", help="released checkpoint: local directory or Hub id (e.g. Caiyun-AI/DCPythia-6.9B)")
    parser.add_argument("dst", help="output directory (must be empty or absent unless --overwrite)")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a non-empty destination (swapped in once the new output is complete: a crash at any moment "
        "leaves one complete copy; see docs/guarantees.md)",
    )
    parser.add_argument("--max-shard-size", default="5GB", help="largest output shard (default 5GB)")
    parser.add_argument("--dtype", default=None, help="cast to float32/float16/bfloat16 (default: keep)")
    parser.add_argument("--revision", default=None, help="Hub revision of SRC")
    add_hub_arguments(parser, default_license=None)  # the release's own: pass it (see the source's model card)
    args = parser.parse_args(argv)
    try:
        convert(
            args.src,
            args.dst,
            args.overwrite,
            args.max_shard_size,
            args.dtype,
            args.revision,
            push_to_hub=args.push_to_hub,
            private=args.private,
            token=args.token,
            license=args.license,
        )
    except HubUploadError as err:  # the output is complete: one line with the command that retries the upload
        print(f"error: {err}", file=sys.stderr)
        return 3
    except Exception as err:  # a clear one-line error (bad input, corrupt shard) rather than a traceback
        print(f"error: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
