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

import argparse
import math
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.activations import ACT2FN
from transformers.utils import logging

from modeling_dcformer import DCFormerConfig, DCFormerForCausalLM
from modeling_dcformer.conversion.converter import HUB, ConversionOptions, Converter, UnknownTensor, flag
from modeling_dcformer.modeling_dcformer import DynamicWeightProjection

logger = logging.get_logger(__name__)

DEFAULT_INIT_SCALE = 0.02
DEFAULT_TOLERANCE = 1e-4
VERIFY_DEFAULT_MAX_PARAMS = 1_100_000_000  # Pythia-1B has 1.01B parameters; Pythia-1.4B is the first one left out
VERIFY_SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "In 1969, Neil Armstrong became the first person to walk on the Moon.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Attention is all you need, but composing the heads dynamically may help a little more.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
)

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


class VerificationError(ValueError):
    """The converted model's logits differ from the source's by more than the tolerance."""


# ----------------------------------------------------------------------------------------------------------------
# The exact-and-trainable initialisation of the dynamic composition weights
# ----------------------------------------------------------------------------------------------------------------
def _dynamic_projections(module: torch.nn.Module) -> list[torch.nn.Module]:
    """Every DCMHA dynamic-weight projection in `module` (itself included), recognised by its dw1/qkw/dd
    parameters so that a copy loaded as Hub remote code is found too."""
    found = []
    for m in module.modules():
        params = [getattr(m, name, None) for name in ("dw1", "qkw", "dd")]
        if all(isinstance(p, torch.Tensor) for p in params) and [p.dim() for p in params] == [4, 5, 3]:
            found.append(m)
    return found


@torch.no_grad()
def init_dynamic_weights_exact(
    model_or_module: torch.nn.Module,
    scale: float = DEFAULT_INIT_SCALE,
    generator: torch.Generator | None = None,
) -> torch.nn.Module:
    """Initialise every DCMHA dynamic-weight projection (dw1 [D, G, C, K], qkw [G, C, K, 2I, M], dd [D, G, C*M])
    so that the composition is exactly the identity (the model computes plain multi-head attention) while
    dw1, qkw and dd all receive a non-zero gradient on the first backward pass.

    The K hidden units of each (group, slot) are split into an active half Ka and a dormant half Kb:
      - dw1[..., Ka] ~ N(0, scale^2), dw1[..., Kb] = 0, so h_b = gelu(0) = 0 exactly while h_a != 0;
      - qkw's w1 rows (first I): N(0, scale^2) on Ka, 0 on Kb, so w1 = h_a qkw_w1[Ka] != 0 and its RMS
        normalisation is well conditioned;
      - qkw's w2 rows (last I): 0 on Ka, N(0, scale^2) on Kb, so w2 = h_a 0 + 0 qkw_w2[Kb] = 0 exactly:
        every low-rank term sum_i (A w1_i) w2_i vanishes;
      - dd = 0, so the diagonal terms tanh(x dd) = 0 vanish.
    Gradients at that point: dL/dw2 is proportional to A w1 != 0, hence dL/dqkw_w2[Ka] = h_a^T dL/dw2 != 0
    (qkw), dL/dh_b = dL/dw2 qkw_w2[Kb]^T != 0 and gelu'(0) = 1/2, hence dL/ddw1[..., Kb] = x^T dL/dh_b / 2 != 0
    (dw1), and dL/ddd = x^T (A * dL/dout) != 0 (dd). All zeros instead would be a saddle: w1 = w2 = 0 give
    each other zero gradient and h = 0 passes none back to dw1.

    Works on a whole model or on one projection; random draws are fp32 from `generator` (CPU) and cast to each
    parameter's dtype and device (zeros stay exact zeros in any dtype). Returns `model_or_module`.
    """
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"the init scale must be a positive number, got {scale!r}")
    projections = _dynamic_projections(model_or_module)
    if not projections:
        raise ValueError(
            f"{type(model_or_module).__name__} has no DCMHA dynamic-weight projection (dw1, qkw, dd parameters)"
        )

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator, dtype=torch.float32) * scale

    for proj in projections:
        D, G, C, K = proj.dw1.shape
        two_i, M = proj.qkw.shape[-2:]
        I = two_i // 2
        if tuple(proj.qkw.shape) != (G, C, K, 2 * I, M) or two_i != 2 * I or proj.dd.shape[:2] != (D, G):
            raise ValueError(
                f"inconsistent dynamic-weight shapes dw1 {tuple(proj.dw1.shape)}, qkw {tuple(proj.qkw.shape)}, "
                f"dd {tuple(proj.dd.shape)}"
            )
        if K < 2:
            raise ValueError(
                f"the dynamic-weight MLP has K={K} hidden unit(s); an exact and trainable init needs K >= 2 "
                "(an active and a dormant half)"
            )
        active = K // 2
        dw1 = torch.zeros(D, G, C, K)
        dw1[..., :active] = normal(D, G, C, active)
        qkw = torch.zeros(G, C, K, 2 * I, M)
        qkw[:, :, :active, :I] = normal(G, C, active, I, M)  # w1 rows: active units only
        qkw[:, :, active:, I:] = normal(G, C, K - active, I, M)  # w2 rows: dormant units only
        proj.dw1.copy_(dw1)
        proj.qkw.copy_(qkw)
        proj.dd.zero_()
    return model_or_module


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
            vocab_size=source.vocab_size,
            hidden_size=source.hidden_size,
            num_hidden_layers=source.num_hidden_layers,
            num_attention_heads=source.num_attention_heads,
            intermediate_size=source.intermediate_size,
            hidden_act=source.hidden_act,
            use_gated_mlp=False,
            norm_type="layernorm",
            layer_norm_eps=source.layer_norm_eps,
            use_parallel_residual=source.use_parallel_residual,
            attention_bias=source.attention_bias,
            mlp_bias=True,  # GPT-NeoX's MLP always has biases
            max_position_embeddings=source.max_position_embeddings,
            rope_parameters=dict(source.rope_parameters),
            initializer_range=source.initializer_range,
            use_cache=source.use_cache,
            bos_token_id=source.bos_token_id,
            eos_token_id=source.eos_token_id,
            pad_token_id=source.pad_token_id,
            tie_word_embeddings=source.tie_word_embeddings,
            use_dcmha=True,
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


def new_layer_tensors(
    config: DCFormerConfig, layer: int, dtype: torch.dtype, scale: float, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """The tensors a GPT-NeoX layer lacks: the dynamic-weight projection (exact init) and, with qk-norm, the
    q/k norm scales (ones)."""
    proj = DynamicWeightProjection(config)
    init_dynamic_weights_exact(proj, scale, generator)
    prefix = f"model.layers.{layer}.self_attn"
    tensors = {f"{prefix}.dyn_w_proj.{name}": p.detach().to(dtype) for name, p in proj.named_parameters()}
    if config.use_qk_norm:
        tensors[f"{prefix}.q_norm.weight"] = torch.ones(config.head_dim, dtype=dtype)
        tensors[f"{prefix}.k_norm.weight"] = torch.ones(config.head_dim, dtype=dtype)
    return tensors


def source_parameter_count(shapes: dict[str, tuple[int, ...]]) -> int:
    """Parameters the source checkpoint holds: every tensor of the converted model but the ones the conversion
    adds (dynamic-weight projections, qk-norm scales)."""
    added = re.compile(r"\.(dyn_w_proj\.[^.]+|q_norm\.weight|k_norm\.weight)$")
    return sum(math.prod(shape) for key, shape in shapes.items() if not added.search(key))


# ----------------------------------------------------------------------------------------------------------------
# Verification
# ----------------------------------------------------------------------------------------------------------------
def verification_inputs(src_dir: Path, config: DCFormerConfig) -> tuple[list[torch.Tensor], str]:
    """A few sentences tokenised by the source's tokenizer plus one longer passage (longer than a local window,
    so that a window's effect shows); random token ids when the source has no usable tokenizer."""
    long_len = min(config.max_position_embeddings, max(128, (config.window_size or 0) + 64))
    sequences, how = [], "the source's tokenizer"
    try:
        from transformers import AutoTokenizer

        if not any((src_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
            raise FileNotFoundError("no tokenizer files")
        tokenizer = AutoTokenizer.from_pretrained(str(src_dir))
        for text in VERIFY_SENTENCES:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            sequences.append(torch.tensor(ids[: config.max_position_embeddings], dtype=torch.long))
        passage = torch.cat(sequences)
        if passage.numel() == 0 or int(passage.max()) >= config.vocab_size:
            raise ValueError("the tokenizer does not fit the vocabulary")
        repeats = -(-long_len // passage.numel())
        sequences.append(passage.repeat(repeats)[:long_len])
        sequences = [s for s in sequences if s.numel() > 0]
    except Exception:  # no tokenizer, or one that does not load or fit: raw token ids still test the function
        generator = torch.Generator().manual_seed(0)
        lengths = [min(n, config.max_position_embeddings) for n in (8, 16, 32)] + [long_len]
        sequences = [torch.randint(0, config.vocab_size, (n,), generator=generator) for n in lengths]
        how = "random token ids: no usable tokenizer"
    return sequences, how


@torch.no_grad()
def max_logit_difference(
    src_dir: Path, converted_dir: Path, config: DCFormerConfig, source_class: type | None = None
) -> tuple[float, int, str]:
    """Max |logit difference| in fp32 between the source (a `source_class`, by default GPT-NeoX) and the converted
    model on the verification inputs. The models are loaded one after the other, so the peak is one fp32 model
    (4 bytes a parameter)."""
    if source_class is None:
        from transformers import GPTNeoXForCausalLM as source_class

    sequences, how = verification_inputs(src_dir, config)
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        source = source_class.from_pretrained(str(src_dir), dtype=torch.float32, attn_implementation="eager")
        source.eval()
        reference = [source(ids[None], use_cache=False).logits[0] for ids in sequences]
        del source
        converted = DCFormerForCausalLM.from_pretrained(str(converted_dir), dtype=torch.float32).eval()
        diff = 0.0
        for ids, ref in zip(sequences, reference):
            logits = converted(ids[None], use_cache=False).logits[0]
            step = float((logits - ref).abs().max())
            diff = max(diff, step if math.isfinite(step) else math.inf)  # a NaN must fail, not vanish in max()
        del converted
    finally:
        logging.set_verbosity(verbosity)
    return diff, len(sequences), how


# ----------------------------------------------------------------------------------------------------------------
# Conversion
# ----------------------------------------------------------------------------------------------------------------
RELEASED = "released architecture (changes the function: not Pythia's any more)"  # a --help section


@dataclass
class PythiaOptions(ConversionOptions):
    """`dcformer-convert-pythia`'s options: the common ones, the initialisation of the new weights, the
    verification, and the released architecture's changes."""

    license: str | None = flag(
        "apache-2.0", "--license", group=HUB, help="license in the model card's metadata (default: apache-2.0)"
    )
    init_scale: float = flag(
        DEFAULT_INIT_SCALE,
        "--init-scale",
        type=float,
        help=f"std of the random halves of the dynamic weights (default {DEFAULT_INIT_SCALE}); the function is "
        "exact whatever the scale",
    )
    seed: int = flag(0, "--seed", type=int, help="seed of the dynamic-weight init (default 0)")
    verify: bool | None = flag(
        None,
        "--verify",
        action=argparse.BooleanOptionalAction,
        help="compare both models' fp32 logits on a few sentences, before any --dtype cast (default: on up to 1.1B "
        "parameters)",
    )
    tolerance: float = flag(
        DEFAULT_TOLERANCE, "--tolerance", type=float, help="largest allowed |logit difference| (1e-4)"
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


class PythiaConverter(Converter):
    """GPT-NeoX -> DCPythia: the same tensors (the fused q/k/v regrouped), plus the dynamic-weight projections
    initialised exactly (and the qk-norm scales with --qk-norm); verified against the source's logits."""

    tool = "dcformer-convert-pythia"
    options_class = PythiaOptions
    source_help = "GPT-NeoX checkpoint: local directory or Hub id (e.g. EleutherAI/pythia-410m)"
    source_model = "a GPT-NeoX causal LM"
    push_message = "Convert {src} to DCPythia"

    def __init__(self, src: str, dst: str, options: PythiaOptions):
        super().__init__(src, dst, options)
        self.exact = not options.qk_norm and options.window_size is None
        self.num_params = 0
        self.layer_dtypes: dict[int, torch.dtype] = {}

    def check_options(self) -> None:
        o = self.options
        if not (isinstance(o.init_scale, (int, float)) and math.isfinite(o.init_scale) and o.init_scale > 0):
            raise ValueError(f"--init-scale must be a positive number, got {o.init_scale!r}")
        if not (isinstance(o.tolerance, (int, float)) and o.tolerance >= 0):  # NaN too: no difference would fail it
            raise ValueError(f"--tolerance must be a number >= 0, got {o.tolerance!r}")
        if o.window_type is not None and o.window_size is None:
            raise ValueError("--window-type needs --window-size (without a window every layer is global)")

    def make_config(self, raw: dict) -> DCFormerConfig:
        o = self.options
        config = dcpythia_config(read_gpt_neox_config(raw, self.src), o.qk_norm, o.window_size, o.window_type)
        config.converted_from_model_type = "gpt_neox"
        return config

    def conversion_record(self) -> dict:
        return {
            "dynamic_weights_init": "exact (active/dormant halves, dd = 0)",
            "init_scale": self.options.init_scale,
            "seed": self.options.seed,
            "exact": self.exact,
        }

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

    def added_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each layer's dynamic-weight projection (and qk-norm scales), drawn in fp32 and cast once, straight to
        their final dtype (also when the weights are verified before a cast): `--dtype`, else their layer's."""
        generator = torch.Generator().manual_seed(self.options.seed)
        default_dtype = max(set(self.written.values()) or {torch.float32}, key=lambda d: torch.finfo(d).bits)
        for layer in range(self.config.num_hidden_layers):
            dtype = self.dtype or self.layer_dtypes.get(layer, default_dtype)
            yield from new_layer_tensors(self.config, layer, dtype, self.options.init_scale, generator).items()

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
        """--verify / --no-verify, by default on up to `VERIFY_DEFAULT_MAX_PARAMS` source parameters; a conversion
        that changes the function says so first."""
        options = self.options
        if not self.exact:
            self.warn_function_changes()
        verify = options.verify
        if verify is None:
            source_params = source_parameter_count(self.shapes)
            verify = source_params <= VERIFY_DEFAULT_MAX_PARAMS
            if not verify:
                logger.warning(
                    f"verify: skipped by default for {source_params / 1e9:.2f}B parameters (more than "
                    f"{VERIFY_DEFAULT_MAX_PARAMS / 1e9:.1f}B); pass --verify to run it (one fp32 model in memory "
                    "at a time)"
                )
        if not verify and not self.exact:
            logger.warning("the logit difference was not measured (verification off); pass --verify")
        return verify

    def verify(self, directory: Path, cast_to: torch.dtype | None) -> None:
        """The fp32 logits of the converted model against the source's: within --tolerance for an exact
        conversion (else a VerificationError), measured and reported otherwise."""
        compared = "fp32" if cast_to is None else f"fp32, before casting to {dtype_name(cast_to)}"
        diff, count, how = max_logit_difference(self.src_dir, directory, self.config)
        self.config.conversion = {**self.config.conversion, "max_logit_difference": diff, "verified_in": compared}
        if not self.exact:
            logger.warning(
                f"max |logit difference| ({compared}) from {self.src} on {count} sequences ({how}) = {diff:.3e} "
                "(expected: the function is no longer the source's; no bound applied)"
            )
            return
        tolerance = self.options.tolerance
        passed = diff <= tolerance  # False for a NaN difference: a failure, never a pass
        verdict = "OK" if passed else "FAILED"
        print(
            f"verify: max |logit difference| ({compared}) on {count} sequences ({how}) = {diff:.3e} "
            f"(bound {tolerance:.0e}): {verdict}"
        )
        if not passed:
            raise VerificationError(
                f"the converted model's logits differ from {self.src}'s by {diff:.3e} > {tolerance:.0e}; "
                f"nothing was written to {self.dst}"
            )

    def verify_cast(self, directory: Path) -> None:
        rounded = max_logit_difference(self.src_dir, directory, self.config)[0]
        self.config.conversion = {**self.config.conversion, "max_logit_difference_after_cast": rounded}
        name = dtype_name(self.config.dtype)
        print(
            f"verify: after casting to {name}: max |logit difference| = {rounded:.3e} (the {name} rounding of "
            "the weights, run in fp32; for information, not checked)"
        )

    def summary(self) -> str:
        return f"{len(self.written)} tensors, {self.num_params / 1e6:.1f}M source parameters"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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
