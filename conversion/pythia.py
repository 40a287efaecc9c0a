"""Turn a GPT-NeoX checkpoint (any Pythia size or revision, or any other GPT-NeoX model) into a DCPythia one:
the same body with DCMHA attention whose dynamic composition weights are initialised so that the converted
model computes exactly the source's function, yet every new parameter gets a gradient on the first backward.

    dcformer-convert-pythia EleutherAI/pythia-410m ./dcpythia-410m
    dcformer-convert-pythia EleutherAI/pythia-1b ./dcpythia-1b --revision step100000
    dcformer-convert-pythia ./my-neox ./my-dcneox --dtype bfloat16 --no-verify

The fused `query_key_value` weight (per head [q_h; k_h; v_h]) is regrouped into our [all q; all k; all v];
the vocabulary (padded rows included), rotary fraction and base, norms, residual layout, biases and maximum
positions are kept. qk-norm is off and every layer is global unless --qk-norm / --window-size ask for the
released architecture instead, which changes the function (a warning says so and reports by how much).

It streams: one source tensor at a time is in memory (each is written to disk as it comes), so Pythia-12B
converts on a machine with far less memory than its 24 GB of weights. `--verify` (default: on up to 1.1B
parameters, i.e. Pythia-1B and smaller) loads both models in fp32, runs a few sentences and fails when the
logits differ by more than --tolerance (1e-4). With --dtype bf16/fp16 it checks the weights before the cast
(where the conversion is exact): they are written uncast, verified, then cast in a second pass; the difference
after the cast (rounding) is printed for information. The destination appears only once complete and verified
(written beside it, then renamed). It carries the remote code and a model card (base_model: the source when it is
a Hub id), so it loads with `trust_remote_code=True` where this package is not installed; `--push-to-hub REPO`
then uploads it:

    dcformer-convert-pythia EleutherAI/pythia-410m ./dcpythia-410m --push-to-hub me/dcpythia-410m
"""

import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.activations import ACT2FN
from transformers.utils import logging

from modeling_dcformer import DCFormerConfig
from modeling_dcformer.conversion.converter import HUB, UnknownTensor, flag
from modeling_dcformer.conversion.exact import DEFAULT_TOLERANCE  # noqa: F401  (--verify's bound: the demo reads it)
from modeling_dcformer.conversion.exact import ExactConverter, ExactOptions, kept_config_fields, max_logit_difference

logger = logging.get_logger(__name__)

# GPT-NeoX key (with or without the `gpt_neox.` prefix) -> ours.
TOP_LEVEL = {
    "embed_in.weight": "model.embed_tokens.weight",
    "final_layer_norm.weight": "model.norm.weight",
    "final_layer_norm.bias": "model.norm.bias",
}
PER_LAYER = {
    "input_layernorm.weight": "input_layernorm.weight",
    "input_layernorm.bias": "input_layernorm.bias",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "post_attention_layernorm.bias": "post_attention_layernorm.bias",
    "attention.query_key_value.weight": "self_attn.qkv_proj.weight",
    "attention.query_key_value.bias": "self_attn.qkv_proj.bias",
    "attention.dense.weight": "self_attn.o_proj.weight",
    "attention.dense.bias": "self_attn.o_proj.bias",
    "mlp.dense_h_to_4h.weight": "mlp.up_proj.weight",
    "mlp.dense_h_to_4h.bias": "mlp.up_proj.bias",
    "mlp.dense_4h_to_h.weight": "mlp.down_proj.weight",
    "mlp.dense_4h_to_h.bias": "mlp.down_proj.bias",
}
OUTPUT_HEAD = ("embed_out.weight", "lm_head.weight")  # the head's name in old / transformers-5 checkpoints
LAYER_KEY = re.compile(r"^(?:gpt_neox\.)?layers\.(\d+)\.(.+)$")
# Buffers of old checkpoints (causal mask, its fill value, rotary frequencies): recomputed, never needed.
IGNORED = re.compile(r"(^|\.)(attention\.bias|attention\.masked_bias|rotary_emb\.inv_freq)$")


# ----------------------------------------------------------------------------------------------------------------
# Config and key mapping
# ----------------------------------------------------------------------------------------------------------------
def read_gpt_neox_config(raw: dict, src: str):
    """The source's GPTNeoXConfig (old names rotary_pct / rotary_emb_base / torch_dtype understood), or a clear
    ValueError for anything that is not a GPT-NeoX checkpoint."""
    from transformers import GPTNeoXConfig

    model_type = raw.get("model_type")
    if model_type != "gpt_neox":
        raise ValueError(
            f"{src} is not a GPT-NeoX checkpoint: its config.json has model_type {model_type!r} (expected "
            "'gpt_neox', as in EleutherAI/pythia-*)"
        )
    try:
        return GPTNeoXConfig.from_dict(raw)
    except Exception as err:  # strict validation of the dataclass fields
        raise ValueError(f"{src}: cannot read its GPT-NeoX config.json: {err}") from err


def dcpythia_config(
    source, qk_norm: bool = False, window_size: int | None = None, window_type: str | None = None
) -> DCFormerConfig:
    """Our config for a GPT-NeoX one: same body (LayerNorm, GELU-family MLP with biases, residual layout, rotary
    fraction and base, vocabulary, positions), DCMHA on, qk-norm off and every layer global by default."""
    if source.hidden_act not in ACT2FN:
        raise ValueError(f"hidden_act {source.hidden_act!r} of the source is not an activation transformers knows")
    for name in ("attention_dropout", "hidden_dropout"):
        if getattr(source, name, 0):
            logger.warning(f"the source's {name}={getattr(source, name)} is dropped: DCFormer has no dropout")
    try:
        return DCFormerConfig(
            **kept_config_fields(source),
            use_gated_mlp=False,
            norm_type="layernorm",
            layer_norm_eps=source.layer_norm_eps,
            use_parallel_residual=source.use_parallel_residual,
            attention_bias=source.attention_bias,
            mlp_bias=True,  # GPT-NeoX's MLP always has biases
            rope_parameters=dict(source.rope_parameters),
            use_qk_norm=qk_norm,
            window_size=window_size,
            window_type=window_type,
        )
    except (TypeError, ValueError) as err:
        raise ValueError(f"cannot express this GPT-NeoX model as a DCPythia one: {err}") from err


def target_key(source_key: str) -> tuple[str | None, bool]:
    """(our key or None for an ignored buffer, whether the tensor is a fused q/k/v to regroup)."""
    if IGNORED.search(source_key):
        return None, False
    if source_key in OUTPUT_HEAD:
        return "lm_head.weight", False
    bare = source_key.removeprefix("gpt_neox.")
    if bare in TOP_LEVEL:
        return TOP_LEVEL[bare], False
    match = LAYER_KEY.match(source_key)
    if match and match.group(2) in PER_LAYER:
        layer, rest = match.groups()
        return f"model.layers.{layer}.{PER_LAYER[rest]}", rest.startswith("attention.query_key_value.")
    raise UnknownTensor(f"{source_key!r} is not a tensor of a GPT-NeoX causal LM")


def regroup_qkv(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """GPT-NeoX's fused rows are per head [q_h; k_h; v_h] (shape [N, 3, Dh, ...]); ours are all queries, then all
    keys, then all values ([3, N, Dh, ...]). Works on the weight [3D, D] and on the bias [3D]."""
    rows, rest = tensor.shape[0], tensor.shape[1:]
    if rows % (3 * num_heads):
        raise ValueError(f"query_key_value has {rows} rows, not a multiple of 3 x {num_heads} heads")
    head_dim = rows // (3 * num_heads)
    return tensor.reshape(num_heads, 3, head_dim, *rest).transpose(0, 1).reshape(rows, *rest).contiguous()


# ----------------------------------------------------------------------------------------------------------------
# Conversion
# ----------------------------------------------------------------------------------------------------------------
RELEASED = "released architecture (changes the function: not Pythia's any more)"  # a --help section


@dataclass
class PythiaOptions(ExactOptions):
    """`dcformer-convert-pythia`'s options: those of an exact conversion (`ExactOptions`: the common ones, the
    initialisation of the new weights, the verification), and the released architecture's changes."""

    license: str | None = flag(
        "apache-2.0", "--license", group=HUB, help="license in the model card's metadata (default: apache-2.0)"
    )
    qk_norm: bool = flag(
        False, "--qk-norm", group=RELEASED, action="store_true", help="add qk-norm (scales start at 1)"
    )
    window_size: int | None = flag(
        None, "--window-size", group=RELEASED, type=int, help="local attention window (e.g. 256)"
    )
    window_type: str | None = flag(
        None, "--window-type", group=RELEASED, help="local/global pattern: LG (default), LGLL, LGL6, ..."
    )


class PythiaConverter(ExactConverter):
    """GPT-NeoX -> DCPythia: the same tensors (the fused q/k/v regrouped), plus the dynamic-weight projections
    initialised exactly (and the qk-norm scales with --qk-norm); verified against the source's logits. With
    --qk-norm or --window-size the conversion is not exact: the difference is reported, not bounded."""

    tool = "dcformer-convert-pythia"
    options_class = PythiaOptions
    source_help = "GPT-NeoX checkpoint: local directory or Hub id (e.g. EleutherAI/pythia-410m)"
    source_model = "a GPT-NeoX causal LM"
    push_message = "Convert {src} to DCPythia"
    added_keys = re.compile(r"\.(dyn_w_proj\.[^.]+|q_norm\.weight|k_norm\.weight)$")

    def __init__(self, src: str, dst: str, options: PythiaOptions):
        super().__init__(src, dst, options)
        self.exact = not options.qk_norm and options.window_size is None

    def check_options(self) -> None:
        super().check_options()
        if self.options.window_type is not None and self.options.window_size is None:
            raise ValueError("--window-type needs --window-size (without a window every layer is global)")

    def make_config(self, raw: dict) -> DCFormerConfig:
        o = self.options
        config = dcpythia_config(read_gpt_neox_config(raw, self.src), o.qk_norm, o.window_size, o.window_type)
        config.converted_from_model_type = "gpt_neox"
        return config

    def map_tensor(self, key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        ours, fused = target_key(key)
        if ours is None or (ours == "lm_head.weight" and self.config.tie_word_embeddings):
            return []  # a recomputed buffer, or the head tied to the input embedding (not stored)
        self.num_params += tensor.numel()
        if fused:
            tensor = regroup_qkv(tensor, self.config.num_attention_heads)
            if ours.endswith(".weight"):
                self.layer_dtypes[int(ours.split(".")[2])] = tensor.dtype
        return [(ours, tensor)]

    def layer_tensors(self, layer: int, dtype: torch.dtype, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """The dynamic-weight projection and, with qk-norm, the q/k norm scales (ones)."""
        tensors = super().layer_tensors(layer, dtype, generator)
        if self.config.use_qk_norm:
            prefix = f"model.layers.{layer}.self_attn"
            tensors[f"{prefix}.q_norm.weight"] = torch.ones(self.config.head_dim, dtype=dtype)
            tensors[f"{prefix}.k_norm.weight"] = torch.ones(self.config.head_dim, dtype=dtype)
        return tensors

    def logit_difference(self, directory: Path) -> tuple[float, int, str]:
        from transformers import GPTNeoXForCausalLM

        return max_logit_difference(self.src_dir, directory, self.config, GPTNeoXForCausalLM)

    def warn_function_changes(self) -> None:
        options, changed = self.options, []
        if options.qk_norm:
            changed.append("--qk-norm")
        if options.window_size is not None:
            changed.append(f"--window-size {options.window_size}")
        logger.warning(
            f"{' and '.join(changed)} give the released DCPythia architecture: the converted model no longer computes "
            f"{self.src}'s function (its logits will differ; the measured difference is reported below)"
        )

    def will_verify(self) -> bool:
        """A conversion that changes the function says so first."""
        if not self.exact:
            self.warn_function_changes()
        return super().will_verify()


def convert(src: str, dst: str, **options) -> Path:
    """Convert `src` (local directory or Hub id of a GPT-NeoX causal LM) into a DCPythia checkpoint at `dst`, with
    `options` the fields of `PythiaOptions` (`verify=None`: verify checkpoints up to `VERIFY_DEFAULT_MAX_PARAMS`
    parameters). Raises ValueError (or OSError) with a readable message on any problem; `dst` is then left as it
    was. `dst` also gets the remote code and a model card (`license`); `push_to_hub` (a repository id) uploads it
    once complete (`private`, `token`)."""
    return PythiaConverter.convert(src, dst, **options)


def main(argv: list[str] | None = None) -> int:
    return PythiaConverter.main(argv, description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
