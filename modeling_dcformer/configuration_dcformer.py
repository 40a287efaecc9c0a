"""Configuration of DCFormer: a GPT-NeoX (DCPythia) or LLaMA-style (DCFormer++) body with DCMHA attention.
Travels as remote code next to `modeling_dcformer.py`; `PACKAGE` is the flat modules' one link to what only the
installed package has."""

import json
import math
import os
import re

from huggingface_hub.dataclasses import strict
from transformers.activations import ACT2FN
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, RopeParameters

from .dcmha import RENAMED_IMPLEMENTATIONS, current_name, implementation_names

NORM_TYPES = ("layernorm", "rmsnorm")
LAYER_TYPES = ("full_attention", "sliding_attention")
DYNAMIC_INITS = ("authors", "normal")
ROPE_TYPES = ("default", *ROPE_INIT_FUNCTIONS)  # transformers' rotary embeddings (`DCFormerRotaryEmbedding`)
POSITIVE_INTS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                 "max_position_embeddings", "num_head_groups", "dynamic_rank", "attention_chunk_size")


def positive_number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def raise_first(checks) -> None:
    """A ValueError with the message of the first (check, message) whose check fails."""
    for check, message in checks:
        if not check() and message:
            raise ValueError(message)


def is_released_config(config_dict: dict) -> bool:
    """A config in the authors' released key names (`dim`, `n_layer`, `n_head`) rather than ours."""
    return "dim" in config_dict and "n_layer" in config_dict and "hidden_size" not in config_dict


class InstalledPackage:
    """What the installed package adds to the flat modules, which are all a save's remote code carries.
    `modeling_dcformer/__init__.py` sets these when the package is imported; where only the remote code is here they
    stay None, and the model saves, uploads and loads as any transformers model does.

        released    modeling_dcformer.checkpoints.released_format: the authors' released config keys and tensor names
        loading     modeling_dcformer.checkpoints.loading: `from_pretrained` under a reader lock, with diagnoses
        publishing  modeling_dcformer.publishing: `save_pretrained` written beside and swapped in, the model card,
                    uploads
        presets     modeling_dcformer.configuration: the JSON presets of `DCFormerConfig.from_preset`
    """

    released = loading = publishing = presets = None


PACKAGE = InstalledPackage()


def released_format(where: str = "this config"):
    """The installed package's reader of the authors' released checkpoints (`PACKAGE.released`). A save's remote
    code does not carry it (a save is in our names): without the package, one error."""
    if PACKAGE.released is None:
        raise ValueError(f"{where} is in the layout of the authors' released DCFormer checkpoints (keys dim, n_layer, "
                         "n_head): reading it needs the modeling_dcformer package (pip install modeling-dcformer), or "
                         "convert it once with dcformer-convert-released")
    return PACKAGE.released


def check_attn_implementation(value: str, dcmha_implementation: str | None = None) -> str:
    """`attn_implementation` for DCFormer is `dcmha_implementation` under transformers' name: returns `value` when it
    is a DCMHA implementation, else a ValueError that says why transformers' attention functions cannot be used.
    `dcmha_implementation`: a value given with it, which must agree."""
    known = implementation_names()  # the DCMHA registry's names, built-in and registered
    value = current_name(value) if isinstance(value, str) else value
    if value in known:
        if dcmha_implementation is not None and dcmha_implementation != value:
            raise ValueError(f"attn_implementation={value!r} and dcmha_implementation={dcmha_implementation!r} "
                             "disagree: for DCFormer they are two names of one choice; give one of them")
        return value
    raise ValueError(f"attn_implementation={value!r} cannot compute DCFormer's attention: DCMHA composes the heads "
                     "before and after the softmax, and transformers' attention functions (sdpa, flash_attention_*, "
                     "flex_attention, paged|*, Hub kernels) compute plain attention. For DCFormer, attn_implementation "
                     f"is the same choice as the config field dcmha_implementation, one of {known}: 'auto' (the "
                     "default) picks the fastest that applies, 'eager' is the reference in PyTorch ops; see "
                     "docs/implementations.md")


def parse_window_type(window_type: str | None, num_hidden_layers: int) -> list[bool]:
    """Per-layer "is local" flags: `L` (local) and `G` (global) letters, each optionally followed by a repeat count,
    repeated over the layers ("LGLL" is [L, G, L, L]; "LGL6" is [L, G, L, L, L, L, L, L]; None is "LG")."""
    pattern = "LG" if window_type is None else window_type
    if not isinstance(pattern, str) or not re.fullmatch(r"([LG]\d*)+", pattern):
        raise ValueError(f"window_type={window_type!r} is not a window pattern: use None, 'LG', 'LGLL', 'LGL6' or any "
                         "string of L (local) / G (global) letters, each optionally followed by a repeat count")
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
    Composable Multi-Head Attention, Xiao et al., ICML 2024). One config covers both released bodies: DCPythia
    (GPT-NeoX style, the default: layernorm, parallel residual, gelu, biases, partial_rotary_factor=0.25) and
    DCFormer++ (LLaMA style: `norm_type="rmsnorm"`, `use_parallel_residual=False`, `hidden_act="silu"`,
    `use_gated_mlp=True`, `attention_bias=mlp_bias=False`, `partial_rotary_factor=1.0`).

    Attention shapes:
        num_key_value_heads (`int`, *optional*): key/value heads (grouped-query attention); query head n uses
            key/value head n // (num_attention_heads // num_key_value_heads). None: num_attention_heads.
        head_dim (`int`, *optional*): dimensions per head; None: hidden_size // num_attention_heads. An explicit
            value need not make head_dim * num_attention_heads equal hidden_size.
        attention_bias (`bool`, True): bias on the q, k and v projections.
        attention_output_bias (`bool`, *optional*): bias on o_proj; None: the same as attention_bias.
        rope_parameters (`dict`, *optional*): transformers' rotary parameters: rope_type ("default", "linear",
            "dynamic", "yarn", "llama3", ...) with that type's keys, rope_theta, partial_rotary_factor (rotary over
            the first int(head_dim * partial_rotary_factor) dims of each head).

    DCMHA options (docs/implementations.md has the details):
        use_dcmha (`bool`, True): compose the query heads; `False` is plain multi-head attention.
        use_qk_norm (`bool`, False): RMSNorm (learned scale, eps `qk_norm_eps`) on q and k per head.
        window_size (`int`, *optional*): keys a local layer sees, the current one included; `None`: all global.
        window_type (`str`, *optional*): which layers are local ("LG", "LGLL", "LGL6"; see `parse_window_type`).
        layer_types (`list[str]`, *optional*): per-layer "sliding_attention"/"full_attention", else derived.
        query_wise (`bool`, False): only the query-wise composition terms (an ablation in the paper).
        num_head_groups (`int`, 1): heads are composed within groups of `num_attention_heads / groups`.
        dynamic_rank (`int`, 2): rank I of each low-rank dynamic term.
        dynamic_hidden_size (`int`, *optional*): width K of the dynamic-weight MLP per group and slot
            (default `4 * num_attention_heads / num_head_groups`).
        attention_chunk_size (`int`, 128): queries attended at a time (memory: heads x chunk x visible keys);
            local layers use chunks of at most max(64, window_size // 2) queries.
        attention_recompute (`bool`, True): in training, recompute each chunk's attention in the backward pass.
        dcmha_implementation (`str`, "auto"): how attention is computed (the same numbers to float rounding):
            "eager" (the reference), "compiled", "cpu" (a C++ CPU kernel), "triton" (CUDA), "auto" (the fastest
            that applies) or a registered backend; `attn_implementation` is a second name (its "sdpa", ... are an
            error). The old name "kernel" is read as "cpu", with a FutureWarning.
        dynamic_init (`str`, "authors"): init of dw1, qkw, dd from a config: "authors" (their standard deviations:
            composition starts near the identity) or "normal" (`initializer_range`).
    """

    model_type = "dcformer"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]
    attribute_map = {"sliding_window": "window_size", "rms_norm_eps": "layer_norm_eps"}
    base_model_pp_plan = {"embed_tokens": (["input_ids"], ["inputs_embeds"]),
                          "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
                          "norm": (["hidden_states"], ["hidden_states"])}

    vocab_size: int = 50432
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    use_gated_mlp: bool = False
    norm_type: str = "layernorm"
    layer_norm_eps: float = 1e-5
    use_parallel_residual: bool = True
    attention_bias: bool = True
    attention_output_bias: bool | None = None
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
        if isinstance(self.dcmha_implementation, str):
            self.dcmha_implementation = current_name(self.dcmha_implementation)  # an old name, with a FutureWarning
        if kwargs.get("attn_implementation") is not None:  # given to the config itself: checked at once
            given = self.dcmha_implementation if self.dcmha_implementation != "auto" else None  # both given: agree
            check_attn_implementation(kwargs["attn_implementation"], given)
        if "rotary_pct" in kwargs:  # Pythia's name for the rotary fraction, accepted on the way in
            kwargs.setdefault("partial_rotary_factor", kwargs.pop("rotary_pct"))
        if self.rope_parameters is None and "partial_rotary_factor" not in kwargs:
            kwargs["partial_rotary_factor"] = 0.25
        self.validate_sizes()
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.dynamic_hidden_size is None:
            self.dynamic_hidden_size = 4 * (self.num_attention_heads // self.num_head_groups)
        if self.layer_types is None:  # local where window_type says, if there is a window (validate_sizes checked)
            local = parse_window_type(self.window_type, self.num_hidden_layers)
            self.layer_types = ["sliding_attention" if f and self.window_size else "full_attention" for f in local]
        super().__post_init__(**kwargs)
        self.validate_dcmha()

    # The strict dataclass's validators (`validate_*`): run when the config is built, and by `config.validate()`
    # (which `save_pretrained` calls), so a value changed after construction is checked before it is written. Each
    # is a table of (check, error) run in order, so a check may rely on the ones before it.
    def validate_sizes(self):
        known = implementation_names()  # the DCMHA registry's names, built-in and registered
        window, heads, groups = self.window_size, self.num_attention_heads, self.num_head_groups
        raise_first([
            *((lambda name=name: is_positive_int(getattr(self, name)),
               f"{name} must be a positive integer, got {getattr(self, name)!r}") for name in POSITIVE_INTS),
            (lambda: self.dynamic_hidden_size is None or self.dynamic_hidden_size >= 1,
             f"dynamic_hidden_size must be a positive integer, got {self.dynamic_hidden_size!r}"),
            *((lambda name=name: getattr(self, name) is None or is_positive_int(getattr(self, name)),
               f"{name} must be a positive integer or None, got {getattr(self, name)!r}")
              for name in ("num_key_value_heads", "head_dim")),
            (lambda: self.head_dim is not None or self.hidden_size % heads == 0,
             f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads ({heads}), or head_dim must "
             "be given"),
            (lambda: self.num_key_value_heads is None or heads % self.num_key_value_heads == 0,
             f"num_key_value_heads ({self.num_key_value_heads}) must divide num_attention_heads ({heads}): each key/"
             "value head serves the same number of query heads"),
            (lambda: heads % groups == 0, f"num_head_groups ({groups}) must divide num_attention_heads ({heads})"),
            (lambda: self.norm_type in NORM_TYPES, f"norm_type must be one of {NORM_TYPES}, got {self.norm_type!r}"),
            *((lambda name=name: positive_number(getattr(self, name)),
               f"{name} must be a positive finite number, got {getattr(self, name)!r}")
              for name in ("layer_norm_eps", "qk_norm_eps")),
            (lambda: self.hidden_act in ACT2FN, f"hidden_act={self.hidden_act!r} is not an activation transformers "
             f"knows; use one of {', '.join(sorted(ACT2FN))}"),
            (lambda: self.window_type is None or window is not None,
             f"window_type={self.window_type!r} is given without window_size: the pattern says which layers are "
             "local, window_size how many keys they see; set window_size, or window_type=None for global layers"),
            (lambda: window is None or (isinstance(window, int) and window >= 1),
             f"window_size must be a positive integer or None, got {window!r}"),
            (lambda: window is None or window <= self.max_position_embeddings,
             f"window_size ({window}) is larger than max_position_embeddings ({self.max_position_embeddings}): a "
             "local layer would be global; use window_size=None"),
            (lambda: parse_window_type(self.window_type, 1), ""),  # the pattern is valid even when no layer is local
            (lambda: self.dcmha_implementation in known or self.dcmha_implementation in RENAMED_IMPLEMENTATIONS,
             f"dcmha_implementation must be one of {known}, got {self.dcmha_implementation!r}"),
        ])

    def validate_dcmha(self):
        factor = self.rope_parameters.get("partial_rotary_factor", 1.0)
        bad_types = [t for t in self.layer_types if t not in LAYER_TYPES]
        raise_first([
            (lambda: len(self.layer_types) == self.num_hidden_layers, f"layer_types has {len(self.layer_types)} "
             f"entries but num_hidden_layers is {self.num_hidden_layers}"),
            (lambda: not bad_types, f"layer_types entries must be one of {LAYER_TYPES}, got {(bad_types or [0])[0]!r}"),
            (lambda: "sliding_attention" not in self.layer_types or self.window_size is not None,
             "layer_types has sliding_attention layers but window_size is None"),
            (lambda: self.rope_parameters.get("rope_type") in ROPE_TYPES,
             f"rope_parameters has rope_type={self.rope_parameters.get('rope_type')!r}; use one of {ROPE_TYPES}"),
            (lambda: positive_number(self.rope_parameters.get("rope_theta")),
             f"rope_theta must be a positive finite number, got {self.rope_parameters.get('rope_theta')!r}"),
            (lambda: 0.0 <= factor <= 1.0, f"partial_rotary_factor must be in [0, 1], got {factor!r}"),
            (lambda: int(self.head_dim * factor) % 2 == 0, f"partial_rotary_factor ({factor}) times head_dim "
             f"({self.head_dim}) must give an even number of rotary dimensions"),
            (lambda: self.dynamic_init in DYNAMIC_INITS,
             f"dynamic_init must be one of {DYNAMIC_INITS}, got {self.dynamic_init!r}"),
        ])

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """Also accepts the authors' released configs (keys `dim`, `n_layer`, `n_head`), translated to ours."""
        if is_released_config(config_dict):
            config_dict = released_format().translate_released_config(config_dict)
        if kwargs.get("attn_implementation") is not None:  # a load's kwargs: transformers' name for ours, checked here
            given = kwargs.pop("attn_implementation")
            kwargs["dcmha_implementation"] = check_attn_implementation(given, kwargs.get("dcmha_implementation"))
        return super().from_dict(config_dict, **kwargs)

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs) -> tuple[dict, dict]:
        """transformers' reading of config.json, refusing a file without `model_type` (a released config excepted):
        the Auto classes could not tell such a folder from remote code, and another model's config would load as
        DCFormer's defaults. A released config without the package to read it is refused naming the file."""
        config_dict, unused = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        name, subfolder = str(pretrained_model_name_or_path), kwargs.get("subfolder") or ""
        where = os.path.join(name, subfolder, "config.json") if os.path.isdir(name) else f"config.json of {name!r}"
        if config_dict and is_released_config(config_dict):
            released_format(where)
        elif config_dict and "model_type" not in config_dict:
            raise ValueError(f"{where} has no \"model_type\": a DCFormer config says \"model_type\": \"dcformer\"; add "
                             "that line (without it transformers' Auto classes cannot tell the model and ask to run "
                             "remote code)")
        return config_dict, unused

    @property
    def key_value_groups(self) -> int:
        """Query heads per key/value head (1: plain multi-head attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def output_bias(self) -> bool:
        """Whether o_proj has a bias: `attention_output_bias`, or where it is None `attention_bias`."""
        return self.attention_bias if self.attention_output_bias is None else self.attention_output_bias

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

    # `attn_implementation` is a second name for `dcmha_implementation`, and `_attn_implementation` reads it. As in
    # transformers, setting it to one of transformers' own functions is kept as a request (its common tests do it on
    # every config), and building a model from the config refuses it (`_check_and_adjust_attn_implementation`).
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

    # Every DCMHA implementation returns the probabilities: output_attentions needs no particular implementation.
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
        """A preset of the installed package (`modeling_dcformer.configuration`, not remote code), `kwargs` overriding
        its values: `DCFormerConfig.from_preset("dcformer-tiny", window_size=None)`."""
        if PACKAGE.presets is None:
            raise ValueError(f"the preset {name!r} comes with the modeling_dcformer package (pip install "
                             "modeling-dcformer); without it, build the config from its values")
        return cls.from_dict({**json.loads(PACKAGE.presets.preset_file(name).read_text()), **kwargs})


__all__ = ["PACKAGE", "DCFormerConfig", "InstalledPackage", "parse_window_type"]
