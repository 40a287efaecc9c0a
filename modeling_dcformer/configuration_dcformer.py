"""Configuration of DCFormer: a GPT-NeoX (DCPythia) or LLaMA-style (DCFormer++) body with DCMHA attention.

Self-contained (imports only `transformers` and the standard library) so that it can travel to the Hub
as remote code next to `modeling_dcformer.py`.
"""

import math
import os
import re

from huggingface_hub.dataclasses import strict
from transformers.activations import ACT2FN
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters

from .dcmha_base import implementation_names
from .released_format import is_released_config, translate_released_config

NORM_TYPES = ("layernorm", "rmsnorm")
LAYER_TYPES = ("full_attention", "sliding_attention")
DYNAMIC_INITS = ("authors", "normal")


def check_attn_implementation(value: str, dcmha_implementation: str | None = None) -> str:
    """`attn_implementation` for DCFormer is `dcmha_implementation` under transformers' name: returns `value` when it
    is a DCMHA implementation, else a ValueError that says why transformers' attention functions cannot be used.
    `dcmha_implementation`: a value given with it, which must agree."""
    known = implementation_names()  # the DCMHA registry's names, built-in and registered
    if value in known:
        if dcmha_implementation is not None and dcmha_implementation != value:
            raise ValueError(
                f"attn_implementation={value!r} and dcmha_implementation={dcmha_implementation!r} disagree: for "
                "DCFormer they are two names of one choice; give one of them"
            )
        return value
    raise ValueError(
        f"attn_implementation={value!r} cannot compute DCFormer's attention: DCMHA composes the heads before and after "
        "the softmax, and transformers' attention functions (sdpa, flash_attention_*, flex_attention, paged|*, Hub "
        "kernels) compute plain attention. For DCFormer, attn_implementation is the same choice as the config field "
        f"dcmha_implementation, one of {known}: 'auto' (the default) picks the fastest that applies, 'eager' is the "
        "reference in PyTorch ops; see docs/implementations.md"
    )


def parse_window_type(window_type: str | None, num_hidden_layers: int) -> list[bool]:
    """Per-layer "is local" flags for a window pattern.

    `None` means the default pattern "LG" (even layers local, odd layers global). A pattern is a string
    of `L` (local) and `G` (global) letters, each optionally followed by a repeat count, repeated over the
    layers: "LGLL" is [L, G, L, L]; "LGL6" is [L, G, L, L, L, L, L, L].
    """
    pattern = "LG" if window_type is None else window_type
    if not isinstance(pattern, str) or not re.fullmatch(r"([LG]\d*)+", pattern):
        raise ValueError(
            f"window_type={window_type!r} is not a window pattern: use None, 'LG', 'LGLL', 'LGL6' or any "
            "string of L (local) / G (global) letters, each optionally followed by a repeat count"
        )
    flags = []
    for letter, count in re.findall(r"([LG])(\d*)", pattern):
        repeat = int(count) if count else 1
        if repeat < 1:
            raise ValueError(f"window_type={window_type!r}: a repeat count must be at least 1")
        flags += [letter == "L"] * repeat
    return [flags[i % len(flags)] for i in range(num_hidden_layers)]


@strict
class DCFormerConfig(PreTrainedConfig):
    r"""
    Configuration of a DCFormer model: a decoder-only Transformer whose attention is DCMHA (Dynamically
    Composable Multi-Head Attention, Xiao et al., ICML 2024).

    One config covers both released bodies:
    - DCPythia (GPT-NeoX style, the default): `norm_type="layernorm"`, `use_parallel_residual=True`,
      `hidden_act="gelu"`, `use_gated_mlp=False`, biases on, `partial_rotary_factor=0.25`.
    - DCFormer++ (LLaMA style): `norm_type="rmsnorm"`, `use_parallel_residual=False`, `hidden_act="silu"`,
      `use_gated_mlp=True` (SwiGLU), `attention_bias=mlp_bias=False`, `partial_rotary_factor=1.0`.

    DCMHA options:
        use_dcmha (`bool`, defaults to `True`): compose heads; `False` is plain multi-head attention.
        use_qk_norm (`bool`, defaults to `False`): RMSNorm (learned scale, eps `qk_norm_eps`) on q and k per head.
        window_size (`int`, *optional*): keys a local layer sees, the current one included. `None`: every layer global.
        window_type (`str`, *optional*): which layers are local when `window_size` is set; see `parse_window_type`.
        layer_types (`list[str]`, *optional*): explicit per-layer "sliding_attention"/"full_attention"; derived from
            `window_size`/`window_type` when not given.
        query_wise (`bool`, defaults to `False`): only the query-wise composition terms (an ablation in the paper).
        num_head_groups (`int`, defaults to 1): heads are composed within groups of `num_attention_heads / groups`.
        dynamic_rank (`int`, defaults to 2): rank I of each low-rank dynamic term.
        dynamic_hidden_size (`int`, *optional*): width K of the dynamic-weight MLP per group and slot,
            `4 * num_attention_heads / num_head_groups` when not given.
        attention_chunk_size (`int`, defaults to 128): queries processed at a time by the attention, bounding its
            memory to (heads x chunk x visible keys). Measured on a CPU (Pythia-160M shape, T=1024, "compiled"):
            128 beats 256 (prefill attention ~10% faster, training step 1.19x instead of 1.24x GPT-NeoX's) by
            computing fewer masked scores above the causal diagonal (12% more than the causal triangle instead of
            25%) with the scores in cache; 64 is slower again (per-chunk overhead). Local layers use chunks of at
            most max(64, window_size // 2) queries, so that the keys a chunk touches (chunk + window - 1) stay close
            to the window band.
        attention_recompute (`bool`, defaults to `True`): in training, recompute each chunk's attention in the
            backward pass instead of keeping its (heads x chunk x keys) intermediates.
        dcmha_implementation (`str`, defaults to `"auto"`): how a chunk of attention is computed; every choice gives
            the same numbers (to float rounding). `"eager"`: PyTorch ops, one at a time. `"compiled"`: each Compose
            step (with the mask) as two stages through `torch.compile`, each one generated loop over the scores; the
            matrix products and the softmax are PyTorch's own kernels; the first call of each kind compiles
            (seconds). `"kernel"`: CPU, inference only (no gradients): a C function (`cpu_kernel.py`, built
            on first use with the system's C compiler, about a second, cached in `~/.cache/dcformer`) does Compose,
            mask, softmax and Compose in place between the two matrix products, a few query rows at a time in the
            core's cache; elsewhere it is an error that says why. `"triton"`: CUDA, forward and backward:
            flash-style Triton kernels (`triton_kernel.py`; `pip install triton`) that recompute the scores block
            by block and never store a (heads x queries x keys) tensor; calls with `output_attentions` run `"eager"`.
            On a CPU it runs only under Triton's interpreter (`TRITON_INTERPRET=1`, slow: for tests).
            `"auto"`: `"kernel"` where it applies (CPU, nothing needs gradients: prefill, decoding, evaluation)
            and a C compiler is found; otherwise `"compiled"` for attention calls big enough to pay for
            it (training at real sizes) on a device torch.compile can generate code for (CPU with a C++ compiler,
            CUDA with Triton), else `"eager"`. If building either fails, a warning, and `"auto"` does without it.
            `"auto"` does not choose `"triton"` yet: its speed against `"compiled"` has not been measured on a GPU.
            transformers' `attn_implementation` (config, `from_pretrained`, `from_config`, `set_attn_implementation`)
            is a second name for this field; its own values ("sdpa", "flash_attention_2", ...) are an error.
        dynamic_init (`str`, defaults to `"authors"`): how `dw1`, `qkw` and `dd` are initialised in a model built from
            its config (training from scratch). `"authors"`: normal with the standard deviations of the authors'
            training code, sqrt(2 / (D + K)) for dw1, sqrt(1 / K) * 2 / (M + I) * 0.01 for qkw and
            sqrt(2 / (D + M)) * 0.005 for dd, so the composition starts close to the identity. `"normal"`: standard
            deviation `initializer_range` for all three (this package's earlier default). Weights loaded from a
            checkpoint and the Pythia converter's exact start are not affected.
    """

    model_type = "dcformer"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]
    attribute_map = {"sliding_window": "window_size", "rms_norm_eps": "layer_norm_eps"}
    base_model_tp_plan = None
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    vocab_size: int = 50432
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    use_gated_mlp: bool = False
    norm_type: str = "layernorm"
    layer_norm_eps: float = 1e-5
    use_parallel_residual: bool = True
    attention_bias: bool = True
    mlp_bias: bool = True
    max_position_embeddings: int = 2048
    rope_parameters: RopeParameters | dict | None = None
    initializer_range: float = 0.02
    use_cache: bool = True
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 0
    pad_token_id: int | None = None
    tie_word_embeddings: bool = False
    # DCMHA
    use_dcmha: bool = True
    use_qk_norm: bool = False
    qk_norm_eps: float = 1e-6
    window_size: int | None = None
    window_type: str | None = None
    layer_types: list[str] | None = None
    query_wise: bool = False
    num_head_groups: int = 1
    dynamic_rank: int = 2
    dynamic_hidden_size: int | None = None
    attention_chunk_size: int = 128
    attention_recompute: bool = True
    dcmha_implementation: str = "auto"
    dynamic_init: str = "authors"

    def __post_init__(self, **kwargs):
        if kwargs.get("attn_implementation") is not None:  # given to the config itself: checked at once
            given = self.dcmha_implementation if self.dcmha_implementation != "auto" else None  # both given: agree
            check_attn_implementation(kwargs["attn_implementation"], given)
        # Pythia's name for the rotary fraction is accepted on the way in.
        if "rotary_pct" in kwargs:
            kwargs.setdefault("partial_rotary_factor", kwargs.pop("rotary_pct"))
        if self.rope_parameters is None and "partial_rotary_factor" not in kwargs:
            kwargs["partial_rotary_factor"] = 0.25
        head_dim = kwargs.pop("head_dim", None)  # HF-style configs often spell it out: derived here, so only checked
        self.validate_sizes()
        if head_dim is not None and head_dim != self.hidden_size // self.num_attention_heads:
            raise ValueError(
                f"head_dim={head_dim!r} does not match hidden_size / num_attention_heads = {self.hidden_size} / "
                f"{self.num_attention_heads} = {self.hidden_size // self.num_attention_heads}; DCFormer derives "
                "head_dim from those two: leave it out or make it agree"
            )
        if self.dynamic_hidden_size is None:
            self.dynamic_hidden_size = 4 * (self.num_attention_heads // self.num_head_groups)
        if self.layer_types is None:
            if self.window_size is None:
                self.layer_types = ["full_attention"] * self.num_hidden_layers
            else:
                local = parse_window_type(self.window_type, self.num_hidden_layers)
                self.layer_types = ["sliding_attention" if f else "full_attention" for f in local]
        super().__post_init__(**kwargs)
        self.validate_dcmha()
        self.validate_dynamic_init()

    # The checks are the strict dataclass's class validators (`validate_*`): called here first, so that a bad value
    # is a ValueError naming the field when the config is built, and run again by `config.validate()`, which
    # `save_pretrained` calls, so that a value changed after construction is checked before it is written.
    def validate_sizes(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
            "num_head_groups",
            "dynamic_rank",
            "attention_chunk_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.dynamic_hidden_size is not None and self.dynamic_hidden_size < 1:
            raise ValueError(f"dynamic_hidden_size must be a positive integer, got {self.dynamic_hidden_size!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.num_attention_heads % self.num_head_groups:
            raise ValueError(
                f"num_head_groups ({self.num_head_groups}) must divide num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.norm_type not in NORM_TYPES:
            raise ValueError(f"norm_type must be one of {NORM_TYPES}, got {self.norm_type!r}")
        for name in ("layer_norm_eps", "qk_norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")
        if self.hidden_act not in ACT2FN:
            raise ValueError(
                f"hidden_act={self.hidden_act!r} is not an activation transformers knows; use one of "
                f"{', '.join(sorted(ACT2FN))}"
            )
        if self.window_type is not None and self.window_size is None:
            raise ValueError(
                f"window_type={self.window_type!r} is given without window_size: the pattern says which layers are "
                "local, window_size how many keys they see; set window_size, or window_type=None for global layers"
            )
        if self.window_size is not None:
            if not isinstance(self.window_size, int) or self.window_size < 1:
                raise ValueError(f"window_size must be a positive integer or None, got {self.window_size!r}")
            if self.window_size > self.max_position_embeddings:
                raise ValueError(
                    f"window_size ({self.window_size}) is larger than max_position_embeddings "
                    f"({self.max_position_embeddings}): a local layer would be global; use window_size=None"
                )
        parse_window_type(self.window_type, 1)  # validates the pattern even when no layer is local
        known = implementation_names()  # the DCMHA registry's names, built-in and registered
        if self.dcmha_implementation not in known:
            raise ValueError(f"dcmha_implementation must be one of {known}, got {self.dcmha_implementation!r}")

    def validate_dcmha(self):
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}"
            )
        for layer_type in self.layer_types:
            if layer_type not in LAYER_TYPES:
                raise ValueError(f"layer_types entries must be one of {LAYER_TYPES}, got {layer_type!r}")
        if "sliding_attention" in self.layer_types and self.window_size is None:
            raise ValueError("layer_types has sliding_attention layers but window_size is None")
        theta = self.rope_parameters.get("rope_theta")
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
            raise ValueError(f"rope_theta must be a positive finite number, got {theta!r}")
        factor = self.rope_parameters.get("partial_rotary_factor", 1.0)
        if not 0.0 <= factor <= 1.0:
            raise ValueError(f"partial_rotary_factor must be in [0, 1], got {factor!r}")
        if int(self.head_dim * factor) % 2:
            raise ValueError(
                f"partial_rotary_factor ({factor}) times head_dim ({self.head_dim}) must give an even number "
                "of rotary dimensions"
            )

    def validate_dynamic_init(self):
        if self.dynamic_init not in DYNAMIC_INITS:
            raise ValueError(f"dynamic_init must be one of {DYNAMIC_INITS}, got {self.dynamic_init!r}")

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """Also accepts the authors' released config files (keys `dim`, `n_layer`, `n_head`, ...; model_type
        "dcpythia" or "dcformer"), translated to ours."""
        if is_released_config(config_dict):
            config_dict = translate_released_config(config_dict)
        if kwargs.get("attn_implementation") is not None:  # a load's kwargs: transformers' name for ours, checked here
            attn_implementation = kwargs.pop("attn_implementation")
            kwargs["dcmha_implementation"] = check_attn_implementation(
                attn_implementation, kwargs.get("dcmha_implementation")
            )
        return super().from_dict(config_dict, **kwargs)

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs) -> tuple[dict, dict]:
        """transformers' reading of config.json, refusing a file without `model_type` (a released config in the
        authors' key names excepted, whose type defaults to "dcpythia"): the Auto classes could not tell such a
        folder from remote code, and a config of another model would load as DCFormer's defaults."""
        config_dict, unused = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        if config_dict and "model_type" not in config_dict and not is_released_config(config_dict):
            name = str(pretrained_model_name_or_path)
            subfolder = kwargs.get("subfolder") or ""
            where = os.path.join(name, subfolder, "config.json") if os.path.isdir(name) else f"config.json of {name!r}"
            raise ValueError(
                f"{where} has no \"model_type\": a DCFormer config says \"model_type\": \"dcformer\"; add that line "
                "(without it transformers' Auto classes cannot tell the model and ask to run remote code)"
            )
        return config_dict, unused

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rope_theta(self) -> float:
        if not self.rope_parameters or "rope_theta" not in self.rope_parameters:
            raise AttributeError("rope_theta is not set yet")  # read by transformers while standardising
        return self.rope_parameters["rope_theta"]

    @property
    def partial_rotary_factor(self) -> float:
        if not self.rope_parameters:
            raise AttributeError("partial_rotary_factor is not set yet")
        return self.rope_parameters.get("partial_rotary_factor", 1.0)

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_head_groups

    @property
    def num_composition_slots(self) -> int:
        """C: (pre-query, pre-key, post-query, post-key), or only the query slots when `query_wise`."""
        return 2 if self.query_wise else 4

    # transformers' attention choice. DCMHA has implementations of its own and none of transformers' (sdpa, flash,
    # flex): `attn_implementation` (config, `from_pretrained`, `from_config`, `set_attn_implementation`) is a second
    # name for `dcmha_implementation`, and `_attn_implementation` reads it, so it always says what runs. As in
    # transformers, setting `config._attn_implementation` to one of transformers' own functions is not an error by
    # itself (its common model tests do it on every config): the value is kept as a request, `_attn_implementation`
    # reads it back, and building a model from the config refuses it (`_check_and_adjust_attn_implementation`).
    @property
    def _attn_implementation(self) -> str:
        requested = self.__dict__.get("_attn_implementation_internal")
        if requested is not None and requested not in implementation_names():
            return requested  # a request no DCMHA implementation answers, refused when a model is built
        return self.dcmha_implementation

    @_attn_implementation.setter
    def _attn_implementation(self, value: str | dict | None):
        if isinstance(value, dict):  # transformers' per-sub-config form; DCFormer has no sub-configs
            value = value.get("")
        if value is None:
            return
        try:
            self.dcmha_implementation = check_attn_implementation(value)
            self.__dict__["_attn_implementation_internal"] = None
        except ValueError:
            self.__dict__["_attn_implementation_internal"] = value

    # Every DCMHA implementation returns the attention probabilities ("triton" leaves such calls to "eager"), so
    # output_attentions needs no particular attn_implementation, unlike transformers' models (there only "eager").
    @property
    def output_attentions(self) -> bool:
        return self._output_attentions

    @output_attentions.setter
    def output_attentions(self, value: bool):
        self._output_attentions = value

    def validate_output_attentions(self):
        pass

    @classmethod
    def from_preset(cls, name: str, **kwargs) -> "DCFormerConfig":
        """The config of a preset shipped with the package (`configuration/NAME.json` in the repository,
        `modeling_dcformer.configuration` once installed), e.g. `DCFormerConfig.from_preset("dcpythia-6.9b")`.
        Keyword arguments override the preset's values (`from_preset("dcformer-tiny", window_size=None)`)."""
        import json

        try:  # the one preset resolver (also behind dcformer-train --config_name and compare_small.py --shape)
            from modeling_dcformer.configuration import preset_file
        except ModuleNotFoundError as err:  # remote code on the Hub: the presets come with the installed package
            raise ValueError("presets need the installed modeling_dcformer package (pip install modeling-dcformer)") from err
        return cls.from_dict({**json.loads(preset_file(name).read_text()), **kwargs})


class DCPythiaConfig(DCFormerConfig):
    """model_type "dcpythia" of the released Caiyun-AI/DCPythia-6.9B: loading such a config gives the
    equivalent `DCFormerConfig` (our names, model_type "dcformer")."""

    model_type = "dcpythia"

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        config_dict = dict(config_dict)
        config_dict.setdefault("model_type", "dcpythia")
        if not is_released_config(config_dict):
            raise ValueError("a model_type 'dcpythia' config must carry the released keys dim, n_layer, n_head")
        return DCFormerConfig.from_dict(config_dict, **kwargs)


__all__ = ["DCFormerConfig", "DCPythiaConfig", "parse_window_type"]
