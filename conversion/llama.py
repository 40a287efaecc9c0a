"""Turn a Llama-family checkpoint (Llama 3.x, Qwen2 / Qwen2.5, Qwen3, Mistral: `LlamaForCausalLM`,
`Qwen2ForCausalLM`, `Qwen3ForCausalLM`, `MistralForCausalLM`) into a DCFormer++ one: the same body (RMSNorm,
gated MLP, rotary embedding with the source's scaling, grouped-query attention) with DCMHA attention whose dynamic
composition weights start so that the converted model computes exactly the source's function, yet every new
parameter gets a gradient on the first backward.

    dcformer-convert-llama meta-llama/Llama-3.2-1B ./dc-llama-3.2-1b
    dcformer-convert-llama Qwen/Qwen2.5-0.5B ./dc-qwen2.5-0.5b --dtype bfloat16
    dcformer-convert-llama ./my-mistral ./my-dc-mistral --no-verify

q_proj, k_proj and v_proj of each layer (weights, and biases where the source has them) are fused into qkv_proj
([q | k | v] rows); every other tensor keeps its name. Heads, key/value heads, head_dim, biases (Qwen2: on q, k, v
but not o), Qwen3's per-head q/k RMSNorm, rope_parameters (rope_type and its keys: llama3, yarn, linear, ...),
tied embeddings, Mistral's sliding window and Qwen's layer_types are kept. A config field that cannot be expressed
exactly is refused in one line naming it, with nothing written.

It streams: one source tensor at a time is in memory (q, k and v of a layer until the three have been read), and
every tensor is written to disk as it comes. `--verify` (default: on up to 1.1B parameters) loads both models in
fp32, one after the other, runs a few sentences and fails when the logits differ by more than --tolerance (1e-4);
with --dtype bf16/fp16 it checks the weights before the cast (written uncast, verified, then cast). The destination
appears only once complete and verified. It carries the source's tokenizer and generation config, the remote code
and a model card (base_model: the source when it is a Hub id; licence: the source card's unless --license), so it
loads with `trust_remote_code=True` where this package is not installed; `--push-to-hub REPO` then uploads it.
"""

import importlib
import math
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.activations import ACT2FN
from transformers.utils import logging

from modeling_dcformer import DCFormerConfig
from modeling_dcformer.configuration_dcformer import LAYER_TYPES, ROPE_TYPES
from modeling_dcformer.conversion.common import SOURCE_CARD, one_line
from modeling_dcformer.conversion.converter import HUB, UnknownTensor, flag
from modeling_dcformer.conversion.exact import ExactConverter, ExactOptions, kept_config_fields, max_logit_difference
from modeling_dcformer.modeling_dcformer import DCFormerRotaryEmbedding

logger = logging.get_logger(__name__)


@dataclass(frozen=True)
class Family:
    """A source family: its name, transformers' model_type and class prefix (`{prefix}ForCausalLM`,
    `{prefix}Config`, `{prefix}RotaryEmbedding` in `transformers.models.{model_type}`)."""

    name: str
    model_type: str
    prefix: str

    @property
    def architecture(self) -> str:
        return f"{self.prefix}ForCausalLM"

    def transformers_class(self, suffix: str) -> type:
        """transformers' `{prefix}{suffix}` class ("Config", "ForCausalLM", "RotaryEmbedding")."""
        kind = "configuration" if suffix == "Config" else "modeling"
        module = importlib.import_module(f"transformers.models.{self.model_type}.{kind}_{self.model_type}")
        return getattr(module, f"{self.prefix}{suffix}")


FAMILIES = {
    family.architecture: family
    for family in (
        Family("Llama", "llama", "Llama"),
        Family("Qwen2", "qwen2", "Qwen2"),
        Family("Qwen3", "qwen3", "Qwen3"),
        Family("Mistral", "mistral", "Mistral"),
    )
}
BY_MODEL_TYPE = {family.model_type: family for family in FAMILIES.values()}
HINTS = {"gpt_neox": " (dcformer-convert-pythia converts GPT-NeoX checkpoints)",
         "dcformer": " (it is a DCFormer checkpoint already)", "dcpythia": " (dcformer-convert-released reads it)"}

# Source keys: the top level and a layer's tensors that keep their names; a layer's q/k/v parts, fused.
TOP_LEVEL = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
PER_LAYER = {
    "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight", "self_attn.o_proj.bias",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    *(f"mlp.{proj}_proj.{kind}" for proj in ("gate", "up", "down") for kind in ("weight", "bias")),
}
LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
QKV_PART = re.compile(r"^self_attn\.([qkv])_proj\.(weight|bias)$")
IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")  # a buffer of old checkpoints: recomputed


# ----------------------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------------------
def source_family(raw: dict, src: str) -> Family:
    """The family of a config.json (its `architectures`, else its `model_type`), or a one-line ValueError."""
    architectures, model_type = raw.get("architectures") or [], raw.get("model_type")
    names = ", ".join(FAMILIES)
    if not isinstance(architectures, list):
        architectures = [architectures]
    known = [name for name in architectures if name in FAMILIES]
    if architectures and not known:
        raise ValueError(
            f"{src} is not a Llama, Qwen2, Qwen3 or Mistral causal LM: its config.json has architectures "
            f"{architectures} (model_type {model_type!r}); expected one of {names}{HINTS.get(model_type, '')}"
        )
    if not architectures and model_type not in BY_MODEL_TYPE:
        raise ValueError(
            f"{src} is not a Llama, Qwen2, Qwen3 or Mistral causal LM: its config.json has model_type {model_type!r} "
            f"and no architectures (expected one of {names}){HINTS.get(model_type, '')}"
        )
    family = FAMILIES[known[0]] if known else BY_MODEL_TYPE[model_type]
    if model_type != family.model_type:
        raise ValueError(
            f"{src}: config.json has architectures {architectures} but model_type {model_type!r} (expected "
            f"{family.model_type!r} for {family.architecture})"
        )
    if quantization := raw.get("quantization_config"):
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
        raise ValueError(
            f"{src}: config.json has quantization_config (quant_method {method!r}): its weights are stored quantized; "
            "convert the unquantized checkpoint"
        )
    return family


def read_source_config(raw: dict, src: str):
    """(family, the source's transformers config) for a config.json, or a one-line ValueError."""
    family = source_family(raw, src)
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # its notes on fields we check ourselves below (an unknown rope_type, ...)
    try:
        return family, family.transformers_class("Config").from_dict(raw)
    except Exception as err:  # strict validation of the dataclass fields
        raise ValueError(f"{src}: cannot read its {family.name} config.json ({one_line(err)})") from None
    finally:
        logging.set_verbosity(verbosity)


class Unmappable(ValueError):
    """A source config field the converted model cannot express exactly."""

    def __init__(self, family: Family, field: str, value, why: str):
        super().__init__(f"cannot convert this {family.name} model: {field}={value!r} {why}")


def attention_biases(family: Family, source) -> dict:
    """attention_bias (q, k, v), attention_output_bias (o) and mlp_bias as the family's modules have them."""
    if family.model_type == "qwen2":  # biases on q, k and v, none on o or in the MLP, whatever the config says
        return dict(attention_bias=True, attention_output_bias=False, mlp_bias=False)
    if family.model_type == "llama":  # one flag for all four projections, one for the MLP
        return dict(attention_bias=source.attention_bias, attention_output_bias=None, mlp_bias=source.mlp_bias)
    if family.model_type == "qwen3":
        return dict(attention_bias=source.attention_bias, attention_output_bias=None, mlp_bias=False)
    return dict(attention_bias=False, attention_output_bias=None, mlp_bias=False)  # Mistral


def windows(family: Family, source) -> tuple[int | None, list[str] | None]:
    """(window_size, layer_types) for the source's sliding windows: Mistral's `sliding_window` on every layer, Qwen's
    `layer_types` (from use_sliding_window / max_window_layers) as they are. A window of at least
    max_position_embeddings keys never leaves one out: its layers are global."""
    layers, window = source.num_hidden_layers, getattr(source, "sliding_window", None)
    if family.model_type == "llama":
        return None, None
    if family.model_type == "mistral":
        types = ["sliding_attention"] * layers if window is not None else ["full_attention"] * layers
    else:
        types = list(source.layer_types or ["full_attention"] * layers)
        bad = [t for t in types if t not in LAYER_TYPES]
        if bad or len(types) != layers:
            raise Unmappable(family, "layer_types", bad[0] if bad else types,
                             f"cannot be expressed: DCFormer's layers are one of {LAYER_TYPES}, one per layer")
        if "sliding_attention" in types and window is None:
            raise Unmappable(family, "layer_types", types, "has sliding_attention layers but the source has no "
                             "sliding_window (use_sliding_window is false): which keys they see is not defined")
    if "sliding_attention" not in types:
        return None, types
    if not (isinstance(window, int) and not isinstance(window, bool) and window >= 1):
        raise Unmappable(family, "sliding_window", window, "is not a positive number of keys")
    if window >= source.max_position_embeddings:
        logger.info(f"sliding_window={window} covers every one of the {source.max_position_embeddings} positions: "
                    "the layers are global")
        return None, ["full_attention"] * layers
    return window, types


def rope_parameters(family: Family, source, head_dim: int) -> dict:
    """The source's rope_parameters (rope_type and its keys) with partial_rotary_factor set to the fraction of each
    head its rotary embedding covers (the family's default rotary ignores the factor: all of it)."""
    rope = dict(source.rope_parameters or {})
    rope_type = rope.setdefault("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise Unmappable(family, "rope_parameters.rope_type", rope_type,
                         f"is not a rotary embedding transformers knows ({', '.join(ROPE_TYPES)})")
    rotary = family.transformers_class("RotaryEmbedding")(config=source)
    dims = 2 * rotary.inv_freq.numel()
    factor = rope.get("partial_rotary_factor", 1.0)
    if int(head_dim * factor) != dims:
        factor = dims / head_dim
    rope["partial_rotary_factor"] = factor
    return rope


def check_rotary(family: Family, source, config: DCFormerConfig) -> None:
    """The converted model's rotary frequencies and scaling are the source's, or a one-line error."""
    theirs = family.transformers_class("RotaryEmbedding")(config=source)
    ours = DCFormerRotaryEmbedding(config)
    same = theirs.inv_freq.shape == ours.inv_freq.shape and torch.allclose(
        theirs.inv_freq.double(), ours.inv_freq.double(), rtol=1e-6, atol=0)
    if not same or not math.isclose(theirs.attention_scaling, ours.attention_scaling, rel_tol=1e-6):
        raise Unmappable(family, "rope_parameters", dict(source.rope_parameters or {}),
                         "gives rotary frequencies DCFormer's rotary embedding does not reproduce")


def dcformer_config(family: Family, source, src_has_head_dim: bool) -> DCFormerConfig:
    """Our config for a Llama-family one: the same body (RMSNorm, gated MLP, sequential residual, rotary with the
    source's parameters, GQA, biases, qk-norm for Qwen3, windows), DCMHA on."""
    if source.hidden_act not in ACT2FN:
        raise Unmappable(family, "hidden_act", source.hidden_act, "is not an activation transformers knows")
    if getattr(source, "attention_dropout", 0):
        logger.warning(f"the source's attention_dropout={source.attention_dropout} is dropped: DCFormer has no "
                       "dropout")
    head_dim = getattr(source, "head_dim", None) or source.hidden_size // source.num_attention_heads
    window_size, layer_types = windows(family, source)
    rope = rope_parameters(family, source, head_dim)
    qwen3 = family.model_type == "qwen3"
    try:
        config = DCFormerConfig(
            **kept_config_fields(source),
            num_key_value_heads=source.num_key_value_heads,
            head_dim=head_dim if src_has_head_dim else None,
            use_gated_mlp=True,
            norm_type="rmsnorm",
            layer_norm_eps=source.rms_norm_eps,
            use_parallel_residual=False,
            **attention_biases(family, source),
            rope_parameters=rope,
            use_qk_norm=qwen3,
            qk_norm_eps=source.rms_norm_eps if qwen3 else 1e-6,
            window_size=window_size,
            layer_types=layer_types,
        )
    except (TypeError, ValueError) as err:
        raise ValueError(f"cannot express this {family.name} model as a DCFormer one: {one_line(err)}") from None
    check_rotary(family, source, config)
    return config


def source_card_license(src_dir: Path) -> dict:
    """The licence metadata of the source's model card (README.md): `license`, and `license_name`, `license_link`
    where it says "other"; {} when it has none."""
    card = src_dir / SOURCE_CARD
    if not card.is_file():
        return {}
    try:
        from huggingface_hub import ModelCard

        data = ModelCard.load(card).data
    except Exception as err:  # a card whose metadata does not parse: no licence read, said once
        logger.info(f"could not read the licence of {card} ({one_line(err)})")
        return {}
    found = {key: getattr(data, key, None) for key in ("license", "license_name", "license_link")}
    return {key: value for key, value in found.items() if isinstance(value, str) and value}


# ----------------------------------------------------------------------------------------------------------------
# Conversion
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class LlamaOptions(ExactOptions):
    """`dcformer-convert-llama`'s options: those of an exact conversion (`ExactOptions`: the common ones, the
    initialisation of the new weights, the verification), the licence's default read from the source."""

    license: str | None = flag(
        None, "--license", group=HUB,
        help="license in the model card's metadata (default: the one the source's model card states, if any)",
    )


class LlamaConverter(ExactConverter):
    """Llama / Qwen2 / Qwen3 / Mistral -> DCFormer++: the same tensors (q, k, v fused), plus the dynamic-weight
    projections initialised exactly; verified against the source's logits."""

    tool = "dcformer-convert-llama"
    options_class = LlamaOptions
    source_help = "Llama, Qwen2, Qwen3 or Mistral checkpoint: local directory or Hub id (e.g. Qwen/Qwen2.5-0.5B)"
    source_model = "a Llama-family causal LM"
    push_message = "Convert {src} to DCFormer"

    def __init__(self, src: str, dst: str, options: LlamaOptions):
        super().__init__(src, dst, options)
        self.family: Family | None = None
        self.pending: dict[tuple[int, str], dict[str, torch.Tensor]] = {}  # (layer, weight/bias) -> q/k/v read
        self.license: dict = {}

    def make_config(self, raw: dict) -> DCFormerConfig:
        self.family, source = read_source_config(raw, self.src)
        config = dcformer_config(self.family, source, raw.get("head_dim") is not None)
        config.converted_from_model_type = self.family.model_type
        self.license = source_card_license(self.src_dir)
        return config

    def conversion_record(self) -> dict:
        record = super().conversion_record()
        if "license" in self.license:
            record["source_license"] = self.license["license"]
        return record

    def map_tensor(self, key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if IGNORED.search(key):
            return []
        if key in TOP_LEVEL:
            if key == "lm_head.weight" and self.config.tie_word_embeddings:
                return []  # the head is the input embedding (a save that also stores it: not used by the source)
            self.num_params += tensor.numel()
            return [(key, tensor)]
        match = LAYER_KEY.match(key)
        if match is None or (match.group(2) not in PER_LAYER and not QKV_PART.match(match.group(2))):
            raise UnknownTensor(f"{key!r} is not a tensor of a {self.family.name} causal LM")
        self.num_params += tensor.numel()
        layer, rest = int(match.group(1)), match.group(2)
        part = QKV_PART.match(rest)
        if part is None:
            return [(key, tensor)]
        which, kind = part.groups()
        parts = self.pending.setdefault((layer, kind), {})
        if which in parts:
            raise ValueError(f"{key} appears twice in the checkpoint")
        parts[which] = tensor
        if len(parts) < 3:
            return []  # held until the layer's other parts are read
        del self.pending[(layer, kind)]
        if kind == "weight":
            self.layer_dtypes[layer] = tensor.dtype
        return [(f"model.layers.{layer}.self_attn.qkv_proj.{kind}", torch.cat([parts[p] for p in "qkv"]))]

    def added_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each layer's dynamic-weight projection (`ExactConverter.added_tensors`); a layer whose q, k and v did not
        all come is refused first."""
        if self.pending:
            (layer, kind), parts = min(self.pending.items())
            missing = [f"model.layers.{layer}.self_attn.{p}_proj.{kind}" for p in "qkv" if p not in parts]
            raise ValueError(f"the checkpoint lacks {', '.join(missing)} (it has the layer's other q/k/v "
                             "projections)")
        yield from super().added_tensors()

    def logit_difference(self, directory: Path) -> tuple[float, int, str]:
        source_class = self.family.transformers_class("ForCausalLM")
        return max_logit_difference(self.src_dir, directory, self.config, source_class)

    def card_metadata(self) -> dict:
        """--license, else the source card's licence metadata, else none (never one made up)."""
        if self.options.license is not None:
            return {"license": self.options.license}
        return {"license": None, **self.license}


def convert(src: str, dst: str, **options) -> Path:
    """Convert `src` (local directory or Hub id of a Llama, Qwen2, Qwen3 or Mistral causal LM) into a DCFormer
    checkpoint at `dst`, with `options` the fields of `LlamaOptions` (`verify=None`: verify checkpoints up to
    `VERIFY_DEFAULT_MAX_PARAMS` parameters). Raises ValueError (or OSError) with a one-line message on any problem;
    `dst` is then left as it was."""
    return LlamaConverter.convert(src, dst, **options)


def main(argv: list[str] | None = None) -> int:
    return LlamaConverter.main(argv, description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
