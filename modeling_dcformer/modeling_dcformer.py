"""DCFormer: a causal LM whose attention is DCMHA (Dynamically Composable Multi-Head Attention).

Xiao et al., ICML 2024; the maths: docs/spec.md. DCMHA backends behind `dcmha.py`, the cache in `cache_dcformer.py`;
this file and its relative imports are a save's remote code. One attention layer (`DCFormerAttention`):
    qkv_proj            fused [q; k; v] projection, all queries then all keys then all values
    q_norm, k_norm      optional per-head RMSNorm (qk-norm)
    dyn_w_proj          the composition weights' generator: dw1 [D, G, C, K], qkw [G, C, K, 2I, M], dd [D, G, C*M]
    o_proj              output projection
"""

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import PreTrainedModel
from transformers.utils import logging

from .cache_dcformer import DCFormerCache, check_cache, check_cache_implementation
from .checkpoint_checks import check_dtypes, check_same_save, describe_mismatch
from .configuration_dcformer import PACKAGE, DCFormerConfig, check_attn_implementation
from .dcmha import DCMHAInputs, dcmha_attention, project_dynamic_weights, token_positions

logger = logging.get_logger(__name__)

# transformers 5.24 renamed `past_key_values` to `cache` (arguments, `generate()`'s model kwargs, output fields); the
# model follows the installed version's name and accepts both.
CACHE_NAME = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def cache_argument(cache: Cache | None, past_key_values: Cache | None) -> Cache | None:
    if cache is not None and past_key_values is not None:
        raise ValueError("pass the cache as `cache` or as `past_key_values`, not both")
    return cache if cache is not None else past_key_values


DW_RMS_EPS = 1e-6  # eps of the RMS normalisation of the dynamic w1 factors (spec, step 5)


def as_float(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in fp32, cast only where it is not (a cast is a dispatched op even when it has nothing to do)."""
    return tensor if tensor.dtype == torch.float32 else tensor.float()


# dtypes whose layer_norm ATen computes in fp32 (half precision as its accumulation type, rounding the output once),
# on the CPU and on CUDA alike: no casts around it (each is a dispatched op)
FP32_NORM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class DCFormerRMSNorm(nn.Module):
    """RMSNorm with a learned scale, computed in fp32."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        return (self.weight.float() * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)


class DCFormerLayerNorm(nn.LayerNorm):
    """LayerNorm computed in fp32 whatever the parameter dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype in FP32_NORM_DTYPES:
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        weight, bias = self.weight.float(), self.bias.float()  # always there: built with elementwise_affine and bias
        return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps).to(x.dtype)


def make_norm(config: DCFormerConfig) -> nn.Module:
    if config.norm_type == "rmsnorm":
        return DCFormerRMSNorm(config.hidden_size, eps=config.layer_norm_eps)
    return DCFormerLayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class DCFormerRotaryEmbedding(nn.Module):
    """Rotary embedding over the first `partial_rotary_factor * head_dim` dims (GPT-NeoX "rotate half")."""

    def __init__(self, config: DCFormerConfig):
        super().__init__()
        self.config = config
        self.max_seq_len_cached = self.original_max_seq_len = config.max_position_embeddings
        self.rope_type = config.rope_parameters["rope_type"]
        default = self.rope_type == "default"
        rope_init_fn = self.compute_default_rope_parameters if default else ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = rope_init_fn(config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(config: DCFormerConfig, device=None, **kwargs) -> tuple[torch.Tensor, float]:
        base = config.rope_parameters["rope_theta"]
        dim = int(config.head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
        return 1.0 / (base**exponents), 1.0

    @torch.no_grad()
    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq  # no casts where there is nothing to cast: each is a dispatched op
        if inv_freq.device != x.device or inv_freq.dtype != torch.float32:
            inv_freq = inv_freq.to(device=x.device, dtype=torch.float)
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling == 1.0:
            return cos, sin  # fp32, [B, T, rot]
        return cos * self.attention_scaling, sin * self.attention_scaling


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin [..., rot] with its first half negated: "rotate half" (x1, x2) -> (-x2, x1) times sin is then the swapped
    halves (x2, x1) times it (`apply_rotary`). `DCFormerModel` makes it once per forward pass, for every layer."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rotary(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 sin_signed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """qk: the queries and keys [2, B, N, T, Dh] (a view); cos, sin: [B, T, rot] (fp32), and `signed_sin(sin)` where
    the caller has it. Rotates the first `rot` dims of both at once (`rotate`); returns query and key [B, N, T, Dh]
    in qk's dtype, each contiguous, the two halves of one new tensor (a cache copies the keys it keeps:
    `DCFormerCacheLayer._append`)."""
    query_key = rotate(qk, cos, sin, sin_signed)
    return query_key[0], query_key[1]


def rotate(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           sin_signed: torch.Tensor | None = None) -> torch.Tensor:
    """The first `rot` dims of x [..., B, H, T, Dh] (a view) rotated by cos, sin [B, T, rot] (fp32), in fp32 (half
    precision is promoted by the products themselves); a new tensor in x's dtype, contiguous (x itself where `rot`
    is 0)."""
    rot = cos.shape[-1]
    if rot == 0:
        return qk
    cos, sin = cos.unsqueeze(1), (signed_sin(sin) if sin_signed is None else sin_signed).unsqueeze(1)
    x_rot, x_pass = qk[..., :rot], qk[..., rot:]
    # x cos + rotate_half(x) sin, rotate_half(x) sin = (x2, x1) * signed sin: the halves swapped by a roll
    x_rot = torch.addcmul(x_rot * cos, x_rot.roll(rot // 2, dims=-1), sin)
    if x_rot.dtype != qk.dtype and torch.is_grad_enabled() and qk.requires_grad:  # out= records no gradient
        x_rot = x_rot.to(qk.dtype)
    if x_rot.dtype == qk.dtype:
        query_key = torch.cat((x_rot, x_pass), dim=-1)
    else:  # the concatenation casts to qk's dtype
        query_key = torch.cat((x_rot, x_pass), dim=-1, out=qk.new_empty(qk.shape))
    return query_key


class DCFormerMLP(nn.Module):
    """`down(act(up x))`, or SwiGLU-style `down(act(gate x) * up x)` when `use_gated_mlp`."""

    def __init__(self, config: DCFormerConfig):
        super().__init__()
        self.use_gated_mlp = config.use_gated_mlp
        if self.use_gated_mlp:
            self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_gated_mlp:
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(self.act_fn(self.up_proj(x)))


class DynamicWeightProjection(nn.Module):
    """Generates the composition weights of every position from the attention input x (spec, step 5).

    Parameters keep the released names and shapes: dw1 [D, G, C, K], qkw [G, C, K, 2I, M], dd [D, G, C*M].
    `forward` returns the terms of every slot packed as [B, T, G, C, 2I+1, M]: rows 0..I-1 are w1
    (RMS-normalised over M), rows I..2I-1 are w2, and row 2I is the diagonal (tanh).
    """

    def __init__(self, config: DCFormerConfig):
        super().__init__()
        D, G, M = config.hidden_size, config.num_head_groups, config.heads_per_group
        C, K, I = config.num_composition_slots, config.dynamic_hidden_size, config.dynamic_rank
        self.num_groups, self.num_slots, self.rank, self.heads_per_group = G, C, I, M
        self.dw1 = nn.Parameter(torch.empty(D, G, C, K))
        self.qkw = nn.Parameter(torch.empty(G, C, K, 2 * I, M))
        self.dd = nn.Parameter(torch.empty(D, G, C * M))

    @staticmethod
    def init_stds(config: DCFormerConfig) -> dict[str, float]:
        """Standard deviations of the normal init of dw1, qkw, dd for `config.dynamic_init` (see the config)."""
        if config.dynamic_init == "normal":
            std = config.initializer_range
            return {"dw1": std, "qkw": std, "dd": std}
        D, M = config.hidden_size, config.heads_per_group
        K, I = config.dynamic_hidden_size, config.dynamic_rank
        return {"dw1": math.sqrt(2 / (D + K)), "qkw": math.sqrt(1 / K) * 2 / (M + I) * 0.01,
                "dd": math.sqrt(2 / (D + M)) * 0.005}

    def input_products(self, x: torch.Tensor, kept: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [BT, D] times dw1 and dd: ([BT, G*C*K], [BT, G*C*M]). Half precision: one GEMM with dw1 and dd as one
        contiguous nn.Linear-layout weight (CPU's half-precision GEMM with the parameters' [D, N] layout is 20x
        slower: docs/performance.md), copied per forward, or kept in `kept` (the cache's, for one generation) where
        no gradient is recorded; float32: two GEMMs on the parameters as they are. Nothing is kept on the module:
        torch's fused AdamW updates parameters without bumping their version counters, so no key could tell that
        a copy kept across forwards is stale."""
        D = self.dw1.shape[0]
        dw1, dd = self.dw1.view(D, -1), self.dd.view(D, -1)
        if x.dtype == torch.float32:
            return x @ as_float(dw1), x @ as_float(dd)
        if torch.is_grad_enabled() and (self.dw1.requires_grad or self.dd.requires_grad):
            kept = None  # recorded for the backward pass: built from the parameters
        weight = kept.get("weight") if kept is not None else None
        if weight is None or weight.dtype != x.dtype or weight.device != x.device:
            weight = torch.cat((dw1.t(), dd.t())).to(x.dtype)  # one copy, written in the [N, D] layout
            if kept is not None:
                kept["weight"] = weight
        return F.linear(x, weight).split((dw1.shape[1], dd.shape[1]), dim=1)

    def forward(self, x: torch.Tensor, kept: dict | None = None, implementation: str = "eager") -> torch.Tensor:
        """The factors [B, T, G, C, 2I+1, M] of x [B, T, D]; a backend's own projection where it has one for this call
        (`dcmha.project_dynamic_weights`)."""
        B, T, D = x.shape
        G, C, I, M = self.num_groups, self.num_slots, self.rank, self.heads_per_group
        dw1, qkw, dd = self.dw1, self.qkw, self.dd
        if (terms := project_dynamic_weights(implementation, x, dw1, qkw, dd, I, DW_RMS_EPS)) is not None:
            return terms.view(B, T, G, C, -1, M)
        h, diag = self.input_products(x.reshape(B * T, D), kept)
        # bmm for the per-slot second layer (einsum's dispatch costs more than the products at a decode step)
        h = F.gelu(h)  # [BT, GCK]
        qkw = qkw if qkw.dtype == x.dtype else qkw.to(x.dtype)
        w = torch.bmm(h.view(B * T, G * C, -1).transpose(0, 1), qkw.view(G * C, -1, 2 * I * M))
        w = as_float(w.view(G, C, B, T, 2 * I, M).permute(2, 3, 0, 1, 4, 5))  # [B, T, G, C, 2I, M], a view
        w1 = F.rms_norm(w[..., :I, :], (M,), eps=DW_RMS_EPS)  # w1 / sqrt(mean over M of w1^2 + eps)
        diag = torch.tanh(as_float(diag))
        return torch.cat((w1, w[..., I:, :], diag.view(B, T, G, C, 1, M)), dim=4)


class DCFormerAttention(nn.Module):
    """Dynamically Composable Multi-Head Attention (spec, "One DCMHA layer")."""

    def __init__(self, config: DCFormerConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.num_key_value_heads = config.num_key_value_heads
        self.window_size = config.window_size if config.layer_types[layer_idx] == "sliding_attention" else None
        # the structure, read once (a config attribute costs microseconds in a decode step); the rest at each call
        self.use_qk_norm, self.use_dcmha, self.query_wise = config.use_qk_norm, config.use_dcmha, config.query_wise
        self.rank, self.num_groups = config.dynamic_rank, config.num_head_groups
        N, Nkv, Dh = self.num_heads, self.num_key_value_heads, self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, (N + 2 * Nkv) * Dh, bias=config.attention_bias)
        self.o_proj = nn.Linear(N * Dh, config.hidden_size, bias=config.output_bias)
        if config.use_qk_norm:
            self.q_norm = DCFormerRMSNorm(self.head_dim, eps=config.qk_norm_eps)
            self.k_norm = DCFormerRMSNorm(self.head_dim, eps=config.qk_norm_eps)
        if config.use_dcmha:
            self.dyn_w_proj = DynamicWeightProjection(config)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, ...],
                query_start: int = 0, padding_mask: torch.Tensor | None = None, cache: DCFormerCache | None = None,
                output_attentions: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T, _ = hidden_states.shape
        N, Nkv, Dh = self.num_heads, self.num_key_value_heads, self.head_dim
        if N == Nkv:
            qkv = self.qkv_proj(hidden_states).view(B, T, 3, N, Dh).permute(2, 0, 3, 1, 4)
            qk, value = qkv.split((2, 1))  # [2, B, N, T, Dh], [1, B, N, T, Dh] (split: one gradient buffer, not two)
            if self.use_qk_norm:
                qk = torch.stack((self.q_norm(qk[0]), self.k_norm(qk[1])))
            # the values copied out of the q/k/v projection: a view would keep all three alive for the backward pass
            query, key, value = *apply_rotary(qk, *position_embeddings), value[0].contiguous()
        else:  # grouped-query attention: Nkv key/value heads, each rotated and normed once, never copied per query head
            query, key, value = (x.view(B, T, -1, Dh).transpose(1, 2)
                                 for x in self.qkv_proj(hidden_states).split((N * Dh, Nkv * Dh, Nkv * Dh), dim=-1))
            if self.use_qk_norm:
                query, key = self.q_norm(query), self.k_norm(key)
            query, key = rotate(query, *position_embeddings), rotate(key, *position_embeddings)
            query, key, value = query.contiguous(), key.contiguous(), value.contiguous()  # (no-ops where rotated)

        query_terms = key_terms = None
        implementation = self.config.dcmha_implementation
        if self.use_dcmha:
            kept = None if cache is None else cache.projection_weights.setdefault(self.layer_idx, {})
            terms = self.dyn_w_proj(hidden_states, kept, implementation)  # [B, T, G, C, 2I+1, M]
            # slots (pre-query, post-query) if query-wise, else (pre-query, pre-key, post-query, post-key)
            query_terms, key_terms = (terms, None) if self.query_wise else (terms[:, :, :, 0::2], terms[:, :, :, 1::2])

        key_start = query_start
        if cache is not None:
            key, value, key_terms, key_start = cache.update_dcmha(key, value, key_terms, self.layer_idx, query_start)
        key_padding_mask = None if padding_mask is None else padding_mask[:, key_start : key_start + key.shape[2]]
        inputs = DCMHAInputs(query=query, key=key, value=value, query_terms=query_terms, key_terms=key_terms,
                             query_start=query_start, key_start=key_start, key_padding_mask=key_padding_mask,
                             window_size=self.window_size, rank=self.rank, num_groups=self.num_groups,
                             chunk_size=self.config.attention_chunk_size)
        recompute = self.training and torch.is_grad_enabled() and self.config.attention_recompute
        out, probs = dcmha_attention(inputs, implementation, output_attentions=output_attentions, recompute=recompute)
        return self.o_proj(out.reshape(B, T, N * Dh)), probs


class DCFormerDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: DCFormerConfig, layer_idx: int):
        super().__init__()
        self.use_parallel_residual = config.use_parallel_residual
        self.input_layernorm = make_norm(config)
        self.post_attention_layernorm = make_norm(config)
        self.self_attn = DCFormerAttention(config, layer_idx)
        self.mlp = DCFormerMLP(config)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, ...],
                query_start: int = 0, padding_mask: torch.Tensor | None = None, cache: DCFormerCache | None = None,
                output_attentions: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        attn_output, probs = self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings=position_embeddings, query_start=query_start,
            padding_mask=padding_mask, cache=cache, output_attentions=output_attentions,
        )
        if self.use_parallel_residual:
            hidden_states = hidden_states + attn_output + self.mlp(self.post_attention_layernorm(hidden_states))
        else:
            hidden_states = hidden_states + attn_output
            hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states, probs


class DCFormerPreTrainedModel(PreTrainedModel):
    config_class = DCFormerConfig
    config: DCFormerConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DCFormerDecoderLayer"]
    _skip_keys_device_placement = ["cache", "past_key_values"]
    # no flash/SDPA/flex kernel can compose heads: attn_implementation names a DCMHA implementation instead
    _supports_flash_attn = _supports_sdpa = _supports_flex_attn = _supports_attention_backend = False
    _can_compile_fullgraph = True  # torch.compile(fullgraph=True) and torch.export trace it (tests/test_export.py)

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        return True  # the DCMHA implementation is read from the config at every call

    def _check_and_adjust_attn_implementation(self, attn_implementation: str | dict | None, is_init_check: bool = False,
                                              allow_all_kernels: bool = False) -> str:
        """transformers' check at init: a DCMHA implementation (None keeps the config's); transformers' own
        functions are refused here, when a model is built (a config only records the request)."""
        if attn_implementation is not None:
            check_attn_implementation(attn_implementation if not isinstance(attn_implementation, dict) else
                                      attn_implementation.get("", self.config.dcmha_implementation))
        self.config._attn_implementation = attn_implementation  # stored as dcmha_implementation
        return self.config._attn_implementation

    def set_attn_implementation(self, attn_implementation: str | dict, allow_all_kernels: bool = False):
        """Sets `config.dcmha_implementation` ("auto", "eager", "compiled", "cpu", "triton" or a registered
        backend); transformers' own functions ("sdpa", ...) cannot compose heads: a ValueError says so."""
        self._check_and_adjust_attn_implementation(attn_implementation)

    def __init__(self, config: DCFormerConfig, *inputs, **kwargs):
        super().__init__(config, *inputs, **kwargs)
        if PACKAGE.released is not None:  # the released names, for the body loaded (installed package only)
            PACKAGE.released.register_released_layout(config.model_type, config.use_gated_mlp)
            self._keys_to_ignore_on_load_unexpected = PACKAGE.released.IGNORED  # its derived tensors: never used
        self.model_tags = ["dcformer", "dcmha"]  # this model's Hub tags (`add_model_tags` adds to them)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """`PreTrainedModel.from_pretrained`, refusing a checkpoint that does not match its config (transformers
        would initialise missing tensors randomly, drop unused ones, cast integer ones, and only log it) with an error
        naming the config field (`checkpoint_checks.py`; `output_loading_info=True` reports instead). With the package
        installed, `PACKAGE.loading` reads a local folder under a shared lock (docs/implementations.md)."""
        source, want_info = pretrained_model_name_or_path, kwargs.get("output_loading_info", False)
        kwargs["output_loading_info"] = True  # the missing and unused tensors, checked below
        load = super().from_pretrained
        if PACKAGE.loading is not None:  # the reader lock and the package's diagnoses
            load = partial(PACKAGE.loading.from_pretrained, load)
        model, info = load(source, *args, **kwargs)
        problem = None if want_info else describe_mismatch(model.config, source, unexpected=info["unexpected_keys"],
                                                           missing=info["missing_keys"])
        if problem:
            raise ValueError(problem)
        return (model, info) if want_info else model

    @classmethod  # a staticmethod in transformers 5.24, a classmethod in 5.0: `super()` calls either
    def _load_pretrained_model(cls, model, state_dict, checkpoint_files, load_config, *args, **kwargs):
        """transformers' reading of the weight files it resolved, after refusing weight files outside a local folder
        and integer tensors where floats are meant (`check_dtypes`: it would cast them without a word; a quantizer's
        integer weights are meant); before and after it, a config and weights from two saves of a local folder
        (`check_same_save`: the folder saved again during a load without the package's reader lock)."""
        quantized = load_config.is_quantized or bool(getattr(model.config, "quantization_config", None))
        check_dtypes(load_config.pretrained_model_name_or_path, checkpoint_files or [], quantized=quantized)
        check_same_save(model.config, load_config)
        loaded = super()._load_pretrained_model(model, state_dict, checkpoint_files, load_config, *args, **kwargs)
        check_same_save(model.config, load_config)
        return loaded

    @staticmethod
    def _finalize_model_loading(model, load_config, loading_info):
        """transformers' last loading step: its error for tensors of the wrong shape ("look at the above report")
        becomes one naming each tensor, both shapes and the config field responsible."""
        try:
            return PreTrainedModel._finalize_model_loading(model, load_config, loading_info)
        except RuntimeError:
            if load_config.ignore_mismatched_sizes or not loading_info.mismatched_keys:
                raise
            problem = describe_mismatch(model.config, load_config.pretrained_model_name_or_path,
                                        unexpected=loading_info.unexpected_keys, missing=loading_info.missing_keys,
                                        mismatched=loading_info.mismatched_keys)
            if problem is None:
                raise
            raise ValueError(problem) from None

    def save_pretrained(self, save_directory, *args, remote_code: bool = True, model_card: bool | dict = True,
                        **kwargs):
        """`PreTrainedModel.save_pretrained` in our layout. With the package installed (`PACKAGE.publishing`,
        docs/hub.md): written beside and swapped in whole, with the remote code (`remote_code`) and a model card
        (`model_card`: True, False or a dict of card options); as remote code without it: transformers' own."""
        if PACKAGE.publishing is None:
            return super().save_pretrained(save_directory, *args, **kwargs)
        return PACKAGE.publishing.save_pretrained(self, save_directory, *args, remote_code=remote_code,
                                                  model_card=model_card, **kwargs)

    def push_to_hub(self, repo_id: str, **kwargs):
        """transformers' `push_to_hub`; with the package installed also `license`, `base_model`, `eval_results`,
        `remote_code`, `overwrite_model_card`, DCFormer's card, and one `HubUploadError` on failure (docs/hub.md)."""
        if PACKAGE.publishing is None:
            return super().push_to_hub(repo_id, **kwargs)
        return PACKAGE.publishing.push_to_hub(self, repo_id, **kwargs)

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, DynamicWeightProjection):
            for name, std in module.init_stds(self.config).items():
                init.normal_(getattr(module, name), mean=0.0, std=std)


def check_token_ids(input_ids: torch.Tensor, vocab_size: int) -> None:
    """One clear error for a token id outside the embedding table (the embedding would say "index out of range in
    self", or on CUDA fail asynchronously). Two reductions read at once: cheap next to a forward pass; skipped under
    torch.compile and torch.export, whose graphs cannot branch on values."""
    if input_ids.numel() == 0:
        return
    low, high = torch.stack(torch.aminmax(input_ids)).tolist()
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"input_ids contains the token id {bad}, outside the model's vocabulary of {vocab_size} "
                         f"tokens (valid ids: 0..{vocab_size - 1}); was the text encoded with another model's "
                         "tokenizer?")


def keys_padding_mask(attention_mask: torch.Tensor, shape: tuple[int, int], past_length, static_length: int | None,
                      device: torch.device) -> torch.Tensor | None:
    """The keys' padding mask (bool, True for real tokens) from a 2D `attention_mask` [batch, past + new tokens]; with
    a static cache of `static_length` tokens also [batch, static_length] (`create_masks_for_generate`), and in a
    traced call, where the cache's length is a tensor, any width up to it, padded with ones to the whole cache (the
    positions after the mask come after every query, which never sees them). None where nothing is padded, but only
    when running eagerly: under torch.compile and torch.export a branch on its values cannot be traced, and the mask
    is applied."""
    (B, T), width = shape, attention_mask.shape[-1]
    traced_static = isinstance(past_length, torch.Tensor)
    if traced_static:
        valid_width, here = width <= static_length, f"[{B}, at most {static_length}]"
    else:
        valid_width, here = width in (past_length + T, static_length), f"[{B}, {past_length} + {T}]"
    if attention_mask.dim() != 2 or attention_mask.shape[0] != B or not valid_width:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; it must be a 2D padding mask "
                         f"[batch, past + new tokens], here {here}")
    mask = attention_mask.to(device=device, dtype=torch.bool)
    if not torch.compiler.is_compiling() and bool(mask.all()):
        return None  # no masked_fill per chunk
    if not traced_static or width == static_length:  # (an eager call attends to the filled part only)
        return mask
    return F.pad(mask, (0, static_length - width), value=True)


def default_position_ids(attention_mask: torch.Tensor | None, shape: tuple[int, int], past_length,
                         device: torch.device) -> torch.Tensor:
    """The new tokens' positions [B, T]: with a padding mask, real tokens are numbered 0, 1, ... in each row whatever
    the padding; `past_length` an int or (a traced static cache) a tensor."""
    B, T = shape
    new = token_positions(past_length, 0, T, device)
    if attention_mask is None:
        return new.unsqueeze(0).expand(B, T)
    positions = (attention_mask.to(device).long().cumsum(-1) - 1).clamp(min=0)
    if isinstance(past_length, int):
        return positions[:, past_length : past_length + T]
    return positions.index_select(1, new)


class DCFormerModel(DCFormerPreTrainedModel):
    def __init__(self, config: DCFormerConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DCFormerDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = make_norm(config)
        self.rotary_emb = DCFormerRotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()

    def forward(
        self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None, cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None, use_cache: bool | None = None,
        output_attentions: bool | None = None, output_hidden_states: bool | None = None,
        return_dict: bool | None = None, past_key_values: Cache | None = None, **kwargs,
    ) -> BaseModelOutputWithPast | tuple:
        """`cache` is transformers' name for the cache from 5.24 on; `past_key_values`, the earlier one, is accepted."""
        cache = cache_argument(cache, past_key_values)
        output_attentions = output_attentions if output_attentions is not None else self.config.output_attentions
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if self.gradient_checkpointing and self.training and use_cache:
            logger.warning_once("`use_cache=True` is incompatible with gradient checkpointing; using use_cache=False.")
            use_cache = False
        if inputs_embeds is None:
            if not torch.compiler.is_compiling():
                check_token_ids(input_ids, self.embed_tokens.num_embeddings)
            inputs_embeds = self.embed_tokens(input_ids)
        (B, T), device = inputs_embeds.shape[:2], inputs_embeds.device

        cache = check_cache(cache)  # a DCFormerCache, or None for an empty DynamicCache; refuses any other cache
        if use_cache and cache is None:
            cache = DCFormerCache(self.config)
        past_length = cache.get_seq_length() if cache is not None else 0
        if isinstance(past_length, torch.Tensor):  # a static cache's length, which its layers advance in place
            # read once per eager call (chunks, masks and kernels take ints); a traced call keeps a tensor
            past_length = past_length.clone() if torch.compiler.is_compiling() else int(past_length)
        if cache is not None and isinstance(past_length, int):
            cache.check_room(past_length, T)
        static_length = None if cache is None else cache.max_cache_len
        padding_mask = None
        if attention_mask is not None:
            padding_mask = keys_padding_mask(attention_mask, (B, T), past_length, static_length, device)
        if position_ids is None:
            position_ids = default_position_ids(attention_mask, (B, T), past_length, device)

        cos, sin = self.rotary_emb(inputs_embeds, position_ids)
        hidden_states, position_embeddings = inputs_embeds, (cos, sin, signed_sin(sin))  # `apply_rotary`'s
        all_hidden_states, all_attentions = () if output_hidden_states else None, () if output_attentions else None
        for layer in self.layers:
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
            hidden_states, probs = layer(hidden_states, position_embeddings=position_embeddings,
                                         query_start=past_length, padding_mask=padding_mask, cache=cache,
                                         output_attentions=output_attentions)
            if output_attentions:
                all_attentions += (probs,)
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden_states += (hidden_states,)

        output = BaseModelOutputWithPast(last_hidden_state=hidden_states, **{CACHE_NAME: cache if use_cache else None},
                                         hidden_states=all_hidden_states, attentions=all_attentions)
        return output if return_dict else output.to_tuple()


class DCFormerForCausalLM(DCFormerPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: DCFormerConfig):
        super().__init__(config)
        self.model = DCFormerModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # a DynamicCache cannot hold the keys' composition terms

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size: int,
                                      max_cache_length: int, *args, **kwargs):
        """`generate()` starts from a `DCFormerCache` (keys, values and the keys' composition factors): growing, or with
        `cache_implementation="static"` in buffers of `max_cache_len` (else the generation's max length) tokens."""
        implementation = generation_config.cache_implementation
        check_cache_implementation(implementation)
        if model_kwargs.get(CACHE_NAME) is not None and check_cache(model_kwargs[CACHE_NAME]) is None:
            model_kwargs[CACHE_NAME] = None  # an empty DynamicCache: built below as ours
        if model_kwargs.get(CACHE_NAME) is not None:
            if implementation is not None:
                raise ValueError(f"pass either cache_implementation or {CACHE_NAME} to generate(), not both")
            model_kwargs[CACHE_NAME]._is_user_defined = True  # as transformers marks a cache it was given
            return
        if generation_config.use_cache is False:
            return
        if implementation == "static":
            # prompt lookup checks up to prompt_lookup_num_tokens candidates, the last ones past the generation's end
            overshoot = (generation_config.prompt_lookup_num_tokens or 1) - 1
            length = max(max_cache_length + overshoot, generation_config.max_cache_len or 0)
            model_kwargs[CACHE_NAME] = DCFormerCache(self.config, max_cache_len=length)
        else:
            model_kwargs[CACHE_NAME] = DCFormerCache(self.config)
        if generation_config.is_assistant:  # as transformers does: the main model rolls the assistant's cache back
            model_kwargs[CACHE_NAME].activate_past_recording()

    def _prepare_generation_config(self, generation_config, **kwargs):
        """transformers' own, after refusing a `cache_implementation` DCFormer does not support (given to `generate()`
        or in its generation config): transformers would turn "hybrid" into its default without a word."""
        check_cache_implementation(kwargs.get("cache_implementation"))
        check_cache_implementation(getattr(generation_config, "cache_implementation", None))
        return super()._prepare_generation_config(generation_config, **kwargs)

    def create_masks_for_generate(self, config=None, inputs_embeds=None, attention_mask=None, cache=None, **kwargs):
        """What `generate()` passes the model as its mask when the cache is compileable (DCFormer's static one):
        transformers would build a 4D mask for its own attention functions; DCFormer takes the 2D padding mask,
        widened with ones to the static cache's length, so that every decode step has the same shapes (the
        positions after a step's tokens come after its queries, which never see them)."""
        length = cache.max_cache_len if isinstance(cache, DCFormerCache) else None
        if attention_mask is None or attention_mask.dim() != 2 or length is None or attention_mask.shape[-1] >= length:
            return attention_mask
        return F.pad(attention_mask, (0, length - attention_mask.shape[-1]), value=1)

    def _prepare_model_inputs(self, *args, **kwargs):
        """transformers' own, then a clear error for an empty prompt (`generate()` would fail later with an
        IndexError): there is no position to predict the next token from."""
        inputs, input_name, model_kwargs = super()._prepare_model_inputs(*args, **kwargs)
        empty = inputs is not None and inputs.dim() >= 2 and inputs.shape[1] == 0
        if input_name in ("input_ids", "inputs_embeds") and empty:
            bos = self.generation_config.bos_token_id
            hint = f" (e.g. the BOS token, id {bos})" if bos is not None else ""
            raise ValueError(f"generate() got an empty prompt: {input_name} of shape {tuple(inputs.shape)}; give at "
                             f"least one token per row{hint}, or no {input_name} at all to start from the BOS token")
        return inputs, input_name, model_kwargs

    def forward(
        self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None, cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None, labels: torch.LongTensor | None = None,
        use_cache: bool | None = None, output_attentions: bool | None = None,
        output_hidden_states: bool | None = None, return_dict: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0, past_key_values: Cache | None = None, **kwargs,
    ) -> CausalLMOutputWithPast | tuple:
        """`cache` is transformers' name for the cache from 5.24 on; `past_key_values`, the earlier one, is accepted."""
        cache = cache_argument(cache, past_key_values)
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                             inputs_embeds=inputs_embeds, use_cache=use_cache, output_attentions=output_attentions,
                             output_hidden_states=output_hidden_states, return_dict=True)
        hidden_states = outputs.last_hidden_state
        slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, slice_indices, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        output = CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_NAME: getattr(outputs, CACHE_NAME)},
                                        hidden_states=outputs.hidden_states, attentions=outputs.attentions)
        return output if return_dict else output.to_tuple()


__all__ = ["DCFormerForCausalLM", "DCFormerModel", "DCFormerPreTrainedModel"]
