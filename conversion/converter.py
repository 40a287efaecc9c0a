"""The skeleton every converter fills in: `Converter.run()` is the pipeline all `dcformer-convert-*` commands share,
`Converter.main()` their command line, and `ConversionOptions` (a dataclass whose fields declare their own flags with
`flag`) their options.

The pipeline, in order:

1. `check`: the options (the converter's own in `check_options`) and the destination, before any download or work;
2. `read_source`: the source resolved (local folder or Hub id), its config.json translated (`make_config`) and
   recorded (`conversion_record`, where it comes from);
3. `write_weights`: every source tensor read one at a time, mapped (`map_tensor`) and streamed into safetensors shards,
   then the tensors the source lacks (`added_tensors`); shapes checked against the model's, a tensor written twice or
   missing refused;
4. verification, when the converter asks for it (`will_verify`, `verify`): on the weights as read, before any
   `--dtype` cast, which comes after it in a second pass (`verify_cast` reports what the cast changed);
5. `finalize`: config (dtype, architectures, the conversion record with the fingerprint of the weights written),
   tokenizer and generation config files, the remote code and the model card;
6. the output takes the destination's place in one swap (`output_directory`), then `--push-to-hub` uploads it.
"""

import argparse
import shutil
import sys
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers.utils import logging

from modeling_dcformer.checkpoints.fingerprint import checkpoint_fingerprint
from modeling_dcformer.conversion.common import (
    ShardWriter,
    cast_checkpoint,
    check_destination,
    copy_tokenizer_files,
    count_tensors,
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
from modeling_dcformer.publishing import HubUploadError, check_repo_id
from modeling_dcformer.publishing.saving import stamp_indexes

logger = logging.get_logger(__name__)

HUB = "sharing on the Hub"  # the --help section of the Hub options


def flag(default, *names: str, group: str | None = None, **argparse_options):
    """A field of an options dataclass that is also a command-line option: its flag `names` (e.g. "--dtype"), the
    `argparse_options` of `add_argument` (`help`, `type`, `action`, ...) and the --help section `group` it is listed
    in (None: the main one). The field's name is the option's `dest`, its default the option's."""
    return field(default=default, metadata={"flags": names, "group": group, "argparse": argparse_options})


@dataclass
class ConversionOptions:
    """The options of every converter, each also a flag of its command. A converter with options of its own
    subclasses this with more `flag` fields (or redefines one to change its default)."""

    overwrite: bool = flag(
        False,
        "--overwrite",
        action="store_true",
        help="replace a non-empty destination (swapped in once the new output is complete: a crash at any moment "
        "leaves one complete copy; see docs/guarantees.md)",
    )
    dtype: str | None = flag(None, "--dtype", help="cast to float32/float16/bfloat16 (default: keep the source's)")
    max_shard_size: str | int = flag("5GB", "--max-shard-size", help="largest output shard (default 5GB)")
    revision: str | None = flag(None, "--revision", help="Hub revision of SRC: a branch, tag or commit")
    push_to_hub: str | None = flag(
        None,
        "--push-to-hub",
        group=HUB,
        metavar="REPO",
        help="upload the finished output directory to this Hub model repository ('name' or 'namespace/name'; "
        "created if needed); the output carries the remote code and a model card either way",
    )
    private: bool = flag(False, "--private", group=HUB, action="store_true", help="create the repository private")
    token: str | None = flag(None, "--token", group=HUB, help="Hub token (default: the saved login or $HF_TOKEN)")
    license: str | None = flag(
        None, "--license", group=HUB, help="license in the model card's metadata (default: none written)"
    )


def build_parser(options_class: type, source_help: str, description: str | None = None) -> argparse.ArgumentParser:
    """The command line of a converter: SRC, DST, then one flag per `flag` field of `options_class`, in field order,
    each in its --help section."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", help=source_help)
    parser.add_argument("dst", help="output directory (must be empty or absent unless --overwrite)")
    sections = {None: parser}
    for option in fields(options_class):
        if "flags" not in option.metadata:
            continue
        title = option.metadata["group"]
        if title not in sections:
            sections[title] = parser.add_argument_group(title)
        sections[title].add_argument(
            *option.metadata["flags"], dest=option.name, default=option.default, **option.metadata["argparse"]
        )
    return parser


class UnknownTensor(ValueError):
    """A source tensor a converter has no place for (`map_tensor` raises it; the error names the file too)."""


class Converter:
    """One conversion of `src` into `dst` with `options` (an instance of `options_class`). A converter subclasses it,
    sets the class attributes and fills in the hooks; `convert` and `main` are then its Python function and its
    command. Required: `make_config`, `map_tensor`. Optional: `check_options`, `conversion_record`, `added_tensors`,
    `will_verify`, `verify`, `verify_cast`, `summary`, `card_metadata`. During a run the hooks can read `src_dir`
    (the source folder), `config` (once made), `shapes` (every tensor the model needs, with its shape), `dtype`
    (`--dtype` as a torch dtype, or None), `files` (the source's weight files) and `written` (what was written:
    key -> dtype as given)."""

    tool = "dcformer-convert"  # the command: conversion.tool in the output's config.json
    options_class: type = ConversionOptions
    source_help = "source checkpoint: local directory or Hub id"
    source_model = "the model"  # what the source is, in "the checkpoint lacks tensors ... needs"
    push_message = "Convert {src}"  # the Hub commit message

    def __init__(self, src: str, dst: str, options: ConversionOptions):
        self.src, self.dst, self.options = str(src), Path(dst), options
        self.dtype: torch.dtype | None = None
        self.max_shard_size = 0
        self.src_dir: Path | None = None
        self.config = None
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.files: list[Path] = []
        self.written: dict[str, torch.dtype] = {}

    # ------------------------------------------------------------------------------------------------------------
    # The hooks a converter fills in
    # ------------------------------------------------------------------------------------------------------------
    def check_options(self) -> None:
        """Refuse bad values of this converter's own options (a one-line ValueError), before any download."""

    def make_config(self, raw: dict):
        """The `DCFormerConfig` for the source's config.json `raw`, or a ValueError naming the field or the file."""
        raise NotImplementedError

    def conversion_record(self) -> dict:
        """What `config.conversion` records besides the tool, the verification's results and the fingerprint."""
        return {}

    def map_tensor(self, key: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """(our key, tensor) pairs for the source tensor `key`: none for a buffer that is recomputed, one as a rule;
        a converter that fuses several source tensors holds the parts and returns the whole with the last one.
        A key with no place: raise `UnknownTensor`."""
        raise NotImplementedError

    def added_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The tensors the source lacks, written after its own; also where a source whose parts came incomplete is
        refused."""
        return ()

    def will_verify(self) -> bool:
        """Whether `verify` runs (decided once the config and shapes are known, before any tensor is written)."""
        return False

    def verify(self, directory: Path, cast_to: torch.dtype | None) -> None:
        """Check the converted model saved in `directory` against the source; raise a ValueError to fail the run
        (nothing is written). `cast_to`: the dtype the weights are cast to after this check, or None."""

    def verify_cast(self, directory: Path) -> None:
        """After `--dtype`'s cast of verified weights: report what the rounding changed (for information)."""

    def summary(self) -> str:
        """The end of the line "Converted SRC -> DST (...)"."""
        return f"{len(self.written)} tensors"

    def card_metadata(self) -> dict:
        """The model card's licence metadata (`license`, and `license_name`, `license_link` for "other"): `--license`
        by default."""
        return {"license": self.options.license}

    # ------------------------------------------------------------------------------------------------------------
    # The pipeline
    # ------------------------------------------------------------------------------------------------------------
    @classmethod
    def convert(cls, src: str, dst: str, **options) -> Path:
        """Convert `src` (local directory or Hub id) into `dst` with `options` (the fields of `options_class`).
        Raises ValueError or OSError with a one-line message on any problem, `dst` then left as it was;
        `HubUploadError` when only the upload failed (`dst` is then complete)."""
        return cls(src, dst, cls.options_class(**options)).run()

    @classmethod
    def main(cls, argv: list[str] | None = None, description: str | None = None) -> int:
        """The command: 0 on success; 2 and one `error: ...` line on stderr for bad input or a failed write, check or
        verification (nothing written); 3 when only the upload failed (the output is complete)."""
        args = build_parser(cls.options_class, cls.source_help, description).parse_args(argv)
        options = cls.options_class(**{name: value for name, value in vars(args).items() if name not in ("src", "dst")})
        try:
            cls(args.src, args.dst, options).run()
        except HubUploadError as err:  # the output is complete: one line with the command that retries the upload
            print(f"error: {err.for_command_line(token_given=options.token is not None)}", file=sys.stderr)
            return 3
        except (ValueError, OSError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        return 0

    def run(self) -> Path:
        """The pipeline (the steps the module's docstring lists); returns `dst`."""
        self.check()
        self.read_source()
        verify = self.will_verify()
        # With --dtype bf16/fp16 a verified conversion is checked before any rounding: the weights are written uncast
        # into a subfolder, verified, then cast into the output.
        staged = verify and self.dtype not in (None, torch.float32)
        with output_directory(self.dst, self.options.overwrite, source=self.src_dir) as tmp:
            out = tmp / "uncast" if staged else tmp
            out.mkdir(exist_ok=True)
            self.write_weights(out, None if staged else self.dtype)
            if verify:
                self.config.save_pretrained(out)
                self.verify(out, self.dtype if staged else None)
            if staged:
                cast_checkpoint(out, tmp, self.dtype, self.max_shard_size)
                shutil.rmtree(out)
                self.config.dtype = self.dtype
                self.config.save_pretrained(tmp)
                self.verify_cast(tmp)
            self.finalize(tmp)
        print(f"Converted {self.src} -> {self.dst} ({self.summary()})")
        if self.options.push_to_hub is not None:
            options = self.options
            message = self.push_message.format(src=self.src)
            push_output(self.dst, options.push_to_hub, options.private, options.token, message=message)
        return self.dst

    def check(self) -> None:
        """Every refusal that can be known from the options and the destination alone, before any download."""
        if self.options.push_to_hub is not None:
            check_repo_id(self.options.push_to_hub)
        self.dtype = parse_dtype(self.options.dtype)
        self.max_shard_size = parse_size(self.options.max_shard_size)
        if self.options.revision is not None and Path(self.src).is_dir():
            raise ValueError(f"--revision applies to Hub ids only; {self.src} is a local directory")
        self.check_options()
        check_destination(self.dst, self.options.overwrite)

    def read_source(self) -> None:
        """The source folder (downloaded if a Hub id), its translated config with where it comes from, the tensors
        the model needs and the source's weight files."""
        self.src_dir = resolve_source(self.src, self.options.revision)
        self.config = self.make_config(read_config(self.src_dir))
        for key, value in source_provenance(self.src, self.src_dir, self.options.revision).items():
            setattr(self.config, key, value)
        self.config.conversion = {"tool": self.tool, **self.conversion_record()}
        self.shapes = expected_shapes(self.config)
        self.files = weight_files(self.src_dir)

    def write_weights(self, out: Path, dtype: torch.dtype | None) -> None:
        """Every mapped source tensor, then the added ones, into shards in `out` (cast to `dtype` unless None); the
        config's dtype is then the one the weights were saved in (the widest, for mixed ones)."""
        writer = ShardWriter(out, self.max_shard_size)
        with tqdm(total=count_tensors(self.files), desc="Converting", unit="tensor") as bar:
            for file in self.files:
                for source_key, tensor in iter_shard(file):
                    bar.update(1)
                    try:
                        mapped = list(self.map_tensor(source_key, tensor))
                    except UnknownTensor as err:
                        raise ValueError(f"{file.name}: {err}") from None
                    for key, converted in mapped:
                        self.put(writer, key, converted, source_key, dtype)
                    tensor = mapped = converted = None  # written: not kept while the next one is read
        for key, tensor in self.added_tensors():
            self.put(writer, key, tensor, "(new)", dtype)
        missing = sorted(set(self.shapes) - set(self.written))
        if missing:
            raise ValueError(f"the checkpoint lacks tensors {self.source_model} needs: {missing}")
        writer.finish()
        saved = {dtype} if dtype is not None else set(self.written.values())
        self.config.dtype = max(saved, key=lambda d: torch.finfo(d).bits) if saved else None
        self.config.architectures = ["DCFormerForCausalLM"]

    def put(self, writer: ShardWriter, key: str, tensor: torch.Tensor, source_key: str, dtype) -> None:
        """One tensor into the shards, once its key and shape are the model's and it was not written before."""
        if key not in self.shapes:
            raise ValueError(f"{source_key}: the model has no tensor {key!r} for it (config mismatch?)")
        if tuple(tensor.shape) != self.shapes[key]:
            raise ValueError(
                f"{source_key} -> {key}: checkpoint shape {tuple(tensor.shape)} vs model shape {self.shapes[key]}"
            )
        if key in self.written:
            raise ValueError(f"{source_key}: {key} appears twice in the checkpoint")
        self.written[key] = tensor.dtype
        writer.add(key, tensor if dtype is None else tensor.to(dtype))

    def finalize(self, tmp: Path) -> None:
        """The complete output in `tmp`: the config with the fingerprint of the weights written (which weights the
        conversion made: a model card written later can tell whether they changed since) and a new `save_id`, also in
        the shard index (as a save has: a load by the remote code alone refuses the config of one conversion with the
        weights of the next), the source's tokenizer and generation config files, the remote code and the model card."""
        self.config.conversion = {**self.config.conversion, "weights": checkpoint_fingerprint(tmp, self.config)}
        self.config.save_id = uuid.uuid4().hex
        self.config.save_pretrained(tmp)
        stamp_indexes(tmp, self.config.save_id)
        copied = copy_tokenizer_files(self.src_dir, tmp)
        logger.info(f"copied tokenizer files: {copied}")
        write_shareable(tmp, self.config, self.dst.name, repo_id=self.options.push_to_hub, **self.card_metadata())
