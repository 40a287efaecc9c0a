"""The models of the small DCFormer vs Transformer comparison (`examples/compare_small.py`) and its ablations.

Both models have the Pythia body (LayerNorm, parallel residual, GELU MLP with biases, rotary on 25% of each
head, untied output head) and the same shape; only the attention differs: `GPTNeoXForCausalLM` or
`DCFormerForCausalLM`. `matched_configs` keeps their parameter counts within 2% (widening the Transformer's MLP
if needed). The DCFormer variants of `--ablation`:

* `query-wise`, `static` (full rank): plain `DCFormerConfig` options (`variant_config`);
* `static`: `StaticComposition` replaces the model's `DynamicWeightProjection` with learned constants in the
  same packed layout, so the model's attention consumes them unchanged;
* `pre` / `post`: `freeze_slots` keeps the other composition slots of the model's own
  `DynamicWeightProjection` at zero; which parameter entries feed a slot is read off the module's own forward
  (`slot_masks`), not re-encoded here.

Nothing here is part of a saved model's remote code.
"""

from __future__ import annotations

import copy
import json

import torch
from torch import nn
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
from transformers.utils import logging as hf_logging

from modeling_dcformer.configuration import config_file, preset_names
from modeling_dcformer import DCFormerConfig
from modeling_dcformer.modeling_dcformer import DW_RMS_EPS, DCFormerForCausalLM, DynamicWeightProjection

logger = hf_logging.get_logger(__name__)

MODELS = ("transformer", "dcformer", "static", "pre", "post", "query-wise")
DC_MODELS = MODELS[1:]
LABELS = {
    "transformer": "Transformer (GPT-NeoX)",
    "dcformer": "DCFormer (DCMHA)",
    "static": "DCFormer, static composition only",
    "pre": "DCFormer, pre-softmax composition only",
    "post": "DCFormer, post-softmax composition only",
    "query-wise": "DCFormer, query-wise terms only",
}
SLOT_NAMES = {4: ("pre_q", "pre_k", "post_q", "post_k"), 2: ("pre_q", "post_q")}
FROZEN_SLOTS = {"pre": (2, 3), "post": (0, 1)}  # the slots an ablation keeps at zero
MAX_PARAM_GAP = 0.02
SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


def parse_overrides(text: str, recipe: dict | None = None) -> dict:
    """`--dc-overrides key=value,...` (JSON values) -> a dict of DCFormerConfig options; the shared shape and a
    contradiction of the recipe flags (`recipe`) are refused."""
    overrides = {}
    recipe = recipe or {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        if "=" not in item:
            raise ValueError(f"--dc-overrides: expected key=value, got {item!r}")
        key, value = (s.strip() for s in item.split("=", 1))
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
        if key in SHAPE_KEYS or key in ("vocab_size", "max_position_embeddings"):
            raise ValueError(f"--dc-overrides: {key} is part of the shared shape; use --shape/--hidden/... instead")
        if key not in DCFormerConfig.__dataclass_fields__:
            raise ValueError(f"--dc-overrides: {key!r} is not a DCFormerConfig option")
        if key in recipe and recipe[key] != overrides[key]:
            flag = {"dynamic_init": "--dc-init", "use_qk_norm": "--qk-norm", "window_size": "--window"}.get(key)
            raise ValueError(f"--dc-overrides sets {key}={value} but {flag or '--window-type'} says {recipe[key]!r}")
    return overrides



def resolve_shape(args) -> dict:
    """The shared shape of both models from `args.shape` (a config JSON or a preset name: its sizes only) and the
    flags `args.hidden`, `.layers`, `.heads`, `.intermediate` (which override it); ValueError naming the problem."""
    shape = {"hidden_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4, "intermediate_size": None}
    if args.shape:
        try:
            path = config_file(args.shape)
        except FileNotFoundError:
            path = None
        if path is None:
            raise ValueError(
                f"--shape: {args.shape!r} is neither a config JSON file nor a preset ({', '.join(preset_names())})"
            )
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"--shape: {path} is not valid JSON ({err})") from None
        aliases = {
            "hidden_size": ("hidden_size", "dim"),
            "num_hidden_layers": ("num_hidden_layers", "n_layer"),
            "num_attention_heads": ("num_attention_heads", "n_head"),
            "intermediate_size": ("intermediate_size",),
        }
        for key, names in aliases.items():
            for name in names:
                if data.get(name) is not None:
                    shape[key] = data[name]
                    break
        if data.get("use_gated_mlp") or data.get("norm_type") == "rmsnorm":
            logger.warning(f"--shape {path}: only its sizes are used; both models keep the Pythia body")
    for key, flag in zip(SHAPE_KEYS, ("hidden", "layers", "heads", "intermediate")):
        if getattr(args, flag) is not None:
            shape[key] = getattr(args, flag)
    if shape["intermediate_size"] is None:
        shape["intermediate_size"] = 4 * shape["hidden_size"]
    if shape["hidden_size"] % shape["num_attention_heads"]:
        raise ValueError(f"hidden size {shape['hidden_size']} is not divisible by {shape['num_attention_heads']} heads")
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    if int(head_dim * 0.25) % 2:
        raise ValueError(
            f"head dim {head_dim}: its rotary part (a quarter, {int(head_dim * 0.25)}) must be an even number; "
            "pick hidden/heads divisible by 8"
        )
    return shape


# ----------------------------------------------------------------------------------------------------------------


def make_configs(
    shape: dict,
    vocab_size: int,
    max_positions: int,
    baseline_attn: str,
    dc_overrides: dict | None = None,
    baseline_intermediate: int | None = None,
):
    common = dict(
        vocab_size=vocab_size,
        hidden_size=shape["hidden_size"],
        num_hidden_layers=shape["num_hidden_layers"],
        num_attention_heads=shape["num_attention_heads"],
        max_position_embeddings=max_positions,
        layer_norm_eps=1e-5,
        hidden_act="gelu",
        initializer_range=0.02,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    neox = GPTNeoXConfig(
        **common,
        intermediate_size=baseline_intermediate or shape["intermediate_size"],
        rotary_pct=0.25,
        rotary_emb_base=10000,
        use_parallel_residual=True,
        attention_bias=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    neox._attn_implementation = baseline_attn
    dc_options = dict(
        intermediate_size=shape["intermediate_size"],
        partial_rotary_factor=0.25,
        norm_type="layernorm",
        use_parallel_residual=True,
        use_gated_mlp=False,
        attention_bias=True,
        mlp_bias=True,
        use_dcmha=True,
        use_qk_norm=False,
        window_size=None,
    )
    dc_options.update(dc_overrides or {})  # the overrides replace these defaults (e.g. use_qk_norm=true)
    dc = DCFormerConfig(**common, **dc_options)
    return neox, dc


def count_parameters(model_class, config) -> int:
    with torch.device("meta"):
        model = model_class(config)
    return sum(p.numel() for p in model.parameters())


def matched_configs(
    shape: dict,
    vocab_size: int,
    max_positions: int,
    baseline_attn: str = "sdpa",
    param_match: str = "auto",
    dc_overrides: dict | None = None,
):
    """The two configs and their parameter counts; raises ValueError when they are more than 2% apart."""
    neox, dc = make_configs(shape, vocab_size, max_positions, baseline_attn, dc_overrides)
    n_neox, n_dc = count_parameters(GPTNeoXForCausalLM, neox), count_parameters(DCFormerForCausalLM, dc)
    widened = param_match == "mlp" or (param_match == "auto" and abs(n_dc - n_neox) / n_neox > MAX_PARAM_GAP)
    if widened and n_dc != n_neox:
        # one more MLP unit costs (up weight D + up bias 1 + down weight D) per layer
        per_unit = shape["num_hidden_layers"] * (2 * shape["hidden_size"] + 1)
        width = shape["intermediate_size"] + round((n_dc - n_neox) / per_unit)
        if width < 1:
            raise ValueError(f"cannot match the parameter counts by the MLP width ({n_neox} vs {n_dc})")
        neox, dc = make_configs(
            shape, vocab_size, max_positions, baseline_attn, dc_overrides, baseline_intermediate=width
        )
        n_neox = count_parameters(GPTNeoXForCausalLM, neox)
    gap = (n_dc - n_neox) / n_neox
    info = {
        "transformer_params": n_neox,
        "dcformer_params": n_dc,
        "relative_difference": gap,
        "param_match": param_match,
        "transformer_intermediate_size": neox.intermediate_size,
        "dcformer_intermediate_size": dc.intermediate_size,
        "dcmha_params": n_dc
        - count_parameters(DCFormerForCausalLM, DCFormerConfig(**{**dc.to_dict(), "use_dcmha": False}))
        if dc.use_dcmha
        else 0,
    }
    if abs(gap) > MAX_PARAM_GAP:
        raise ValueError(
            f"parameter counts differ by {gap:+.2%} (> {MAX_PARAM_GAP:.0%}): Transformer {n_neox:,}, "
            f"DCFormer {n_dc:,}. "
            "DCMHA adds ~20*D*N + 64*N^2 parameters a layer, a large share at small hidden/heads ratios; use "
            "--param-match auto/mlp (widens the Transformer's MLP) or a shape with a larger hidden size per head"
        )
    return neox, dc, info


def variant_config(kind: str, dc: DCFormerConfig) -> DCFormerConfig:
    """The config of a DCFormer ablation variant (`kind` in DC_MODELS)."""
    if kind == "query-wise":
        return DCFormerConfig(**{**dc.to_dict(), "query_wise": True})
    if kind == "static":  # full rank: each slot composes with the identity + a learned M x M matrix + a diagonal
        return DCFormerConfig(**{**dc.to_dict(), "dynamic_rank": dc.heads_per_group})
    return dc


class StaticComposition(nn.Module):
    """The ablation `static`: in place of DynamicWeightProjection, the same composition terms
    [B, T, G, C, 2I+1, M] (w1 RMS-normalised, w2, tanh diagonal) as learned constants, equal for every input.
    w2 and the diagonal start at zero (the identity composition) and w1 random, so that both get gradients."""

    def __init__(self, config: DCFormerConfig):
        super().__init__()
        G, C, I, M = config.num_head_groups, config.num_composition_slots, config.dynamic_rank, config.heads_per_group
        self.w1 = nn.Parameter(torch.randn(G, C, I, M))
        self.w2 = nn.Parameter(torch.zeros(G, C, I, M))
        self.dd = nn.Parameter(torch.zeros(G, C, 1, M))

    def forward(self, x: torch.Tensor, kept: dict | None = None, implementation: str = "eager") -> torch.Tensor:
        """The static factors for every position of x (`kept` and `implementation`: the projection's signature)."""
        B, T, _ = x.shape
        w1 = self.w1 * torch.rsqrt(self.w1.pow(2).mean(-1, keepdim=True) + DW_RMS_EPS)
        terms = torch.cat((w1, self.w2, torch.tanh(self.dd)), dim=2).float()  # [G, C, 2I+1, M]
        return terms.expand(B, T, *terms.shape).contiguous()


def slot_masks(module: DynamicWeightProjection, slots: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """For each parameter of `module`, a mask that is 0 on the entries that feed the composition slots `slots`
    and 1 elsewhere. Derived from the module's own forward, not from a copy of its packing: the entries whose
    gradient is non-zero when only those slots of the output [B, T, G, C, 2I+1, M] are summed, on a float64 copy
    with random weights (so that no entry is zero by chance, e.g. the zero composition of a converted Pythia)."""
    probe = copy.deepcopy(module).double()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in probe.parameters():
            param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype))
    x = torch.randn(1, 3, probe.dw1.shape[0], generator=generator, dtype=torch.float64)
    terms = probe(x)
    grads = torch.autograd.grad(terms[:, :, :, list(slots)].sum(), list(probe.parameters()))
    return {name: (grad == 0).to(param.dtype) for (name, param), grad in zip(module.named_parameters(), grads)}


def freeze_slots(model: nn.Module, slots: tuple[int, ...]) -> int:
    """Sets the composition slots `slots` of every layer to zero and keeps them there (their gradients are masked),
    so they add nothing: the ablations `pre` and `post`. Returns the number of parameters frozen."""
    frozen = 0
    for module in model.modules():
        if not isinstance(module, DynamicWeightProjection):
            continue
        for name, mask in slot_masks(module, slots).items():
            param = getattr(module, name)
            with torch.no_grad():
                param.mul_(mask)
            param.register_hook(lambda grad, mask=mask: grad * mask)
            frozen += int((mask == 0).sum())
    return frozen


def build_model(kind: str, config) -> tuple[nn.Module, int]:
    """The model of `kind` (its config from `variant_config`) and its number of trainable parameters."""
    if kind == "transformer":
        model = GPTNeoXForCausalLM(config)
        return model, sum(p.numel() for p in model.parameters())
    model = DCFormerForCausalLM(config)
    frozen = 0
    if kind == "static":
        for layer in model.model.layers:
            layer.self_attn.dyn_w_proj = StaticComposition(config)
    elif kind in FROZEN_SLOTS:
        frozen = freeze_slots(model, FROZEN_SLOTS[kind])
    return model, sum(p.numel() for p in model.parameters()) - frozen


# ----------------------------------------------------------------------------------------------------------------
