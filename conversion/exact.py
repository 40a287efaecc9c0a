"""A conversion whose output computes the source's function: the DCMHA weights a plain-attention model lacks,
initialised exactly (`init_dynamic_weights_exact`), the options that control it and the verification against the
source's logits (`ExactOptions`, `ExactConverter`), on which the converters of such families are built (`pythia`,
`llama`).

A family's converter subclasses `ExactConverter` (and `ExactOptions` for options of its own), fills in the
skeleton's required hooks (`make_config`, with `kept_config_fields`; `map_tensor`, which counts the source's
parameters in `num_params` and records each layer's dtype in `layer_dtypes`) and `logit_difference`
(`max_logit_difference` with the family's transformers class). Where it differs it overrides `layer_tensors`
(more tensors a layer lacks), `added_keys` (the keys the conversion adds) or sets `exact` to False (options that
change the function: the difference is then measured and reported, never bounded).
"""

import argparse
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.utils import logging

from modeling_dcformer import DCFormerConfig, DCFormerForCausalLM
from modeling_dcformer.conversion.converter import ConversionOptions, Converter, flag
from modeling_dcformer.modeling_dcformer import DynamicWeightProjection

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
DYNAMIC_WEIGHT_KEYS = re.compile(r"\.dyn_w_proj\.")  # the tensors of the dynamic-weight projections


class VerificationError(ValueError):
    """The converted model's logits differ from the source's by more than the tolerance."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def kept_config_fields(source) -> dict:
    """The `DCFormerConfig` fields a conversion takes as they are from the source's transformers config, which names
    them as ours (sizes, activation, positions, initialiser range, cache, special tokens, tied embeddings), with
    DCMHA on."""
    names = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
             "hidden_act", "max_position_embeddings", "initializer_range", "use_cache", "bos_token_id",
             "eos_token_id", "pad_token_id", "tie_word_embeddings")
    return {name: getattr(source, name) for name in names} | {"use_dcmha": True}


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


def new_layer_tensors(
    config: DCFormerConfig, layer: int, dtype: torch.dtype, scale: float, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """A layer's dynamic-weight projection, initialised exactly (`init_dynamic_weights_exact`), in `dtype`."""
    proj = DynamicWeightProjection(config)
    init_dynamic_weights_exact(proj, scale, generator)
    prefix = f"model.layers.{layer}.self_attn.dyn_w_proj"
    return {f"{prefix}.{name}": p.detach().to(dtype) for name, p in proj.named_parameters()}


def source_parameter_count(shapes: dict[str, tuple[int, ...]], added: re.Pattern = DYNAMIC_WEIGHT_KEYS) -> int:
    """Parameters the source checkpoint holds: every tensor of the converted model but the ones the conversion adds
    (the keys `added` finds)."""
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
    src_dir: Path, converted_dir: Path, config: DCFormerConfig, source_class: type
) -> tuple[float, int, str]:
    """Max |logit difference| in fp32 between the source (a `source_class`, transformers' causal LM of its family)
    and the converted model on the verification inputs: (difference, how many sequences, where their tokens come
    from). The models are loaded one after the other, so the peak is one fp32 model (4 bytes a parameter)."""
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
# The converter
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class ExactOptions(ConversionOptions):
    """The options of an exact conversion: the common ones, the initialisation of the new weights and the
    verification."""

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


class ExactConverter(Converter):
    """A plain-attention source -> DCFormer: its tensors, plus each layer's dynamic-weight projection initialised
    exactly; verified against the source's logits (`--verify`, by default up to `VERIFY_DEFAULT_MAX_PARAMS` source
    parameters). Warnings go to the logger of the converter's module. The family fills in `make_config`,
    `map_tensor` (adding to `num_params` and `layer_dtypes`) and `logit_difference`."""

    options_class = ExactOptions
    added_keys: re.Pattern = DYNAMIC_WEIGHT_KEYS  # the keys of the tensors the conversion adds

    def __init__(self, src: str, dst: str, options: ExactOptions):
        super().__init__(src, dst, options)
        self.exact = True  # False: the options change the function (the difference is reported, not bounded)
        self.num_params = 0  # the source's parameters read
        self.layer_dtypes: dict[int, torch.dtype] = {}  # a layer's dtype (its attention weights'), for its new tensors
        self.logger = logging.get_logger(type(self).__module__)

    # ------------------------------------------------------------------------------------------------------------
    # The hooks a family fills in or changes
    # ------------------------------------------------------------------------------------------------------------
    def logit_difference(self, directory: Path) -> tuple[float, int, str]:
        """`max_logit_difference` between the source and the converted model in `directory`, with the family's
        transformers class for the source."""
        raise NotImplementedError

    def layer_tensors(self, layer: int, dtype: torch.dtype, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """The tensors layer `layer` lacks, in `dtype`: its dynamic-weight projection, initialised exactly."""
        return new_layer_tensors(self.config, layer, dtype, self.options.init_scale, generator)

    # ------------------------------------------------------------------------------------------------------------
    # The skeleton's hooks
    # ------------------------------------------------------------------------------------------------------------
    def check_options(self) -> None:
        o = self.options
        if not (isinstance(o.init_scale, (int, float)) and math.isfinite(o.init_scale) and o.init_scale > 0):
            raise ValueError(f"--init-scale must be a positive number, got {o.init_scale!r}")
        if not (isinstance(o.tolerance, (int, float)) and o.tolerance >= 0):  # NaN too: no difference would fail it
            raise ValueError(f"--tolerance must be a number >= 0, got {o.tolerance!r}")

    def conversion_record(self) -> dict:
        return {
            "dynamic_weights_init": "exact (active/dormant halves, dd = 0)",
            "init_scale": self.options.init_scale,
            "seed": self.options.seed,
            "exact": self.exact,
        }

    def added_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each layer's new tensors (`layer_tensors`), drawn in fp32 and cast once, straight to their final dtype
        (also when the weights are verified before a cast): `--dtype`, else their layer's."""
        generator = torch.Generator().manual_seed(self.options.seed)
        default_dtype = max(set(self.written.values()) or {torch.float32}, key=lambda d: torch.finfo(d).bits)
        for layer in range(self.config.num_hidden_layers):
            dtype = self.dtype or self.layer_dtypes.get(layer, default_dtype)
            yield from self.layer_tensors(layer, dtype, generator).items()

    def will_verify(self) -> bool:
        """--verify / --no-verify, by default on up to `VERIFY_DEFAULT_MAX_PARAMS` source parameters."""
        verify = self.options.verify
        if verify is None:
            source_params = source_parameter_count(self.shapes, self.added_keys)
            verify = source_params <= VERIFY_DEFAULT_MAX_PARAMS
            if not verify:
                self.logger.warning(
                    f"verify: skipped by default for {source_params / 1e9:.2f}B parameters (more than "
                    f"{VERIFY_DEFAULT_MAX_PARAMS / 1e9:.1f}B); pass --verify to run it (one fp32 model in memory "
                    "at a time)"
                )
        if not verify and not self.exact:
            self.logger.warning("the logit difference was not measured (verification off); pass --verify")
        return verify

    def verify(self, directory: Path, cast_to: torch.dtype | None) -> None:
        """The fp32 logits of the converted model against the source's: within --tolerance for an exact
        conversion (else a VerificationError), measured and reported otherwise."""
        compared = "fp32" if cast_to is None else f"fp32, before casting to {dtype_name(cast_to)}"
        diff, count, how = self.logit_difference(directory)
        self.config.conversion = {**self.config.conversion, "max_logit_difference": diff, "verified_in": compared}
        if not self.exact:
            self.logger.warning(
                f"max |logit difference| ({compared}) from {self.src} on {count} sequences ({how}) = {diff:.3e} "
                "(expected: the function is no longer the source's; no bound applied)"
            )
            return
        tolerance = self.options.tolerance
        passed = diff <= tolerance  # False for a NaN difference: a failure, never a pass
        print(
            f"verify: max |logit difference| ({compared}) on {count} sequences ({how}) = {diff:.3e} "
            f"(bound {tolerance:.0e}): {'OK' if passed else 'FAILED'}"
        )
        if not passed:
            raise VerificationError(
                f"the converted model's logits differ from {self.src}'s by {diff:.3e} > {tolerance:.0e}; "
                f"nothing was written to {self.dst}"
            )

    def verify_cast(self, directory: Path) -> None:
        rounded = self.logit_difference(directory)[0]
        self.config.conversion = {**self.config.conversion, "max_logit_difference_after_cast": rounded}
        name = dtype_name(self.config.dtype)
        print(
            f"verify: after casting to {name}: max |logit difference| = {rounded:.3e} (the {name} rounding of "
            "the weights, run in fp32; for information, not checked)"
        )

    def summary(self) -> str:
        return f"{len(self.written)} tensors, {self.num_params / 1e6:.1f}M source parameters"
