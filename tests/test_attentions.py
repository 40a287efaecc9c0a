"""The attentions a forward pass returns, and transformers' `attn_implementation`.

- output_attentions: the composed probabilities returned are the tensors the output is computed from, as in
  transformers' eager attention: their gradient exists, equals the float64 oracle's dLoss/dP on every key a query
  sees, and their values are the oracle's (each row alone, padding on both sides, a local and a global layer,
  several chunks). A backend that cannot return them ("triton") leaves such calls to "eager", saying so once.
- attn_implementation: for DCFormer a second name of `dcmha_implementation`, the same through the config,
  `from_config`, `from_pretrained` and `set_attn_implementation`, and `config._attn_implementation` says what runs;
  transformers' attention functions (sdpa, flash, flex) are an error that names `dcmha_implementation`.
"""

import logging

import pytest
import torch

from helpers import (
    WINDOW,
    as_double,
    assert_close,
    build_model,
    layer_window,
    make_config,
    padded_batch,
)
from modeling_dcformer import DCFormerConfig, DCFormerForCausalLM
from modeling_dcformer.kernels import dcmha_triton
from modeling_dcformer.dcmha import DCMHA_BACKENDS, DCMHAInterface
from oracle import oracle_dcmha_layer, oracle_visible
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.usefixtures("one_thread_per_module", "aot_eager_compile")

TRANSFORMERS_ATTENTION = ["sdpa", "flash_attention_2", "flex_attention"]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # Triton: on a GPU, else in its interpreter (conftest.py)


def attention_config(**overrides) -> DCFormerConfig:
    """Layer 0 local (window 4), layer 1 global; chunks of 4 queries; qk-norm; two head groups."""
    settings = dict(
        num_hidden_layers=2, window_size=WINDOW, attention_chunk_size=4, use_qk_norm=True, num_head_groups=2
    )
    return make_config(**{**settings, **overrides})


def attention_inputs(model) -> dict[int, torch.Tensor]:
    """Runs the model on the padded batch and returns each layer's attention input (after the input norm)."""
    inputs = {}
    handles = [
        layer.self_attn.register_forward_hook(
            lambda module, args, kwargs, output, idx=idx: inputs.__setitem__(idx, args[0].detach()), with_kwargs=True
        )
        for idx, layer in enumerate(model.model.layers)
    ]
    input_ids, mask = padded_batch()
    try:
        with torch.no_grad():
            model(input_ids, attention_mask=mask, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return inputs


# ----------------------------------------------------------------------------------------------------------------
# Item 1: the attentions returned are the ones used
# ----------------------------------------------------------------------------------------------------------------
def test_returned_attentions_are_the_ones_used_and_match_the_oracle():
    """A training forward pass with padding on both sides: every layer's attentions get a gradient from the output
    (a.retain_grad(); loss.backward()), and each row's real block equals the oracle's probabilities of that row alone
    given the layer's input. ("auto" runs "eager" here: gradients, and too few scores to compile.)"""
    model = build_model(attention_config()).train()
    input_ids, mask = padded_batch()
    out = model(input_ids, attention_mask=mask, output_attentions=True, use_cache=False)
    for attentions in out.attentions:
        attentions.retain_grad()
    weights = torch.linspace(-1, 1, out.logits.numel()).view_as(out.logits)
    (out.logits * weights * mask[..., None]).sum().backward()
    for attentions in out.attentions:
        assert attentions.grad is not None
        assert attentions.grad.abs().max() > 1e-3

    inputs = attention_inputs(model)
    real = mask.bool()
    for idx, attentions in enumerate(out.attentions):
        params = as_double(model.model.layers[idx].self_attn.state_dict())
        window = layer_window(model.config, idx)
        for row in range(input_ids.shape[0]):
            x = inputs[idx][row, real[row]][None].double()
            _, probs = oracle_dcmha_layer(x, params, model.config, window, return_probs=True)
            ours = attentions[row][:, real[row]][:, :, real[row]]
            assert_close(ours, probs[0])


@pytest.mark.parametrize("implementation", ["eager", pytest.param("compiled", marks=pytest.mark.expensive)])
def test_gradient_of_the_returned_attentions_matches_the_oracle(implementation):
    """One attention layer called directly: dLoss/dP of the returned probabilities P against the oracle's (float64,
    autograd through its own einsum P v) on every key a query sees, local and global layer ("compiled": the same
    chunks with compiled stages, with `pytest -m expensive`: its Inductor compilation takes minutes in the suite;
    the default run has "compiled"'s probabilities and gradients in tests/test_dcmha_backends.py)."""
    model = build_model(attention_config(dcmha_implementation=implementation)).train()
    B, T = 2, 11
    x = torch.randn(B, T, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    weights = torch.randn(B, T, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    for idx in (0, 1):
        attention = model.model.layers[idx].self_attn
        position_embeddings = model.model.rotary_emb(x, torch.arange(T).unsqueeze(0).expand(B, T))
        out, probs = attention(x, position_embeddings=position_embeddings, output_attentions=True)
        probs.retain_grad()
        (out * weights).sum().backward()

        window = layer_window(model.config, idx)
        x_ref = x.double().requires_grad_()
        params = as_double(attention.state_dict())
        out_ref, probs_ref = oracle_dcmha_layer(x_ref, params, model.config, window, return_probs=True)
        probs_ref.retain_grad()
        (out_ref * weights.double()).sum().backward()

        assert_close(probs, probs_ref)
        visible = oracle_visible(T, window).expand_as(probs)
        assert_close(probs.grad[visible], probs_ref.grad[visible], atol=1e-4, rtol=1e-4)
        assert probs_ref.grad[visible].abs().max() > 1e-2  # the comparison is not between zeros


@pytest.mark.skipif(not dcmha_triton.available(DEVICE), reason="the Triton kernels cannot run here")
def test_triton_leaves_output_attentions_to_eager_and_says_so_once(caplog):
    """"triton" cannot return the probabilities: a call with output_attentions=True runs "eager" (the same
    attentions, carrying the gradient), with one warning for any number of calls."""
    model = build_model(attention_config(dcmha_implementation="eager")).to(DEVICE).train()
    input_ids, mask = (x.to(DEVICE) for x in padded_batch())
    expected = model(input_ids, attention_mask=mask, output_attentions=True, use_cache=False).attentions
    model.config.dcmha_implementation = "triton"
    logging.Logger.warning_once.cache_clear()  # transformers' once-only warnings, process-wide
    with caplog.at_level(logging.WARNING, logger="modeling_dcformer"):
        for _ in range(2):
            out = model(input_ids, attention_mask=mask, output_attentions=True, use_cache=False)
    warnings = [r for r in caplog.records if "triton" in r.getMessage() and "output_attentions" in r.getMessage()]
    assert len(warnings) == 1 and '"eager"' in warnings[0].getMessage()
    for ours, theirs in zip(out.attentions, expected):
        assert_close(ours, theirs)
        ours.retain_grad()
    out.logits.sum().backward()
    assert all(a.grad is not None and a.grad.abs().max() > 0 for a in out.attentions)


# ----------------------------------------------------------------------------------------------------------------
# Item 4: attn_implementation
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture
def spy_backend(monkeypatch):
    """A registered DCMHA backend "spy" that counts its calls and computes with "eager"."""
    calls = []

    def spy(inputs, *, output_attentions=False, recompute=False):
        calls.append(inputs.shapes)
        return DCMHA_BACKENDS["eager"](inputs, output_attentions=output_attentions, recompute=recompute)

    monkeypatch.setitem(DCMHAInterface._global_mapping, "placeholder", None)  # restores the mapping afterwards
    DCMHAInterface.register("spy", spy)
    yield calls
    DCMHAInterface._global_mapping.pop("spy", None)


def test_attn_implementation_chooses_the_dcmha_implementation_by_every_route(tmp_path, spy_backend):
    config = attention_config()
    assert config._attn_implementation == config.dcmha_implementation == "auto"
    model = build_model(config)
    model.save_pretrained(tmp_path, model_card=False)
    ids, mask = padded_batch()

    def uses(model, name):
        assert model.config.dcmha_implementation == name
        assert model.config._attn_implementation == name  # says what runs
        if name == "spy":
            before = len(spy_backend)
            with torch.no_grad():
                model(ids, attention_mask=mask)
            assert len(spy_backend) == before + model.config.num_hidden_layers

    for name in ("eager", "cpu", "spy"):
        uses(DCFormerForCausalLM(attention_config(attn_implementation=name)), name)
        uses(AutoModelForCausalLM.from_config(attention_config(), attn_implementation=name), name)
        uses(AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=name), name)
        model.set_attn_implementation(name)
        uses(model, name)
    model.set_attn_implementation({"": "compiled"})  # transformers' dict form
    uses(model, "compiled")
    uses(AutoModelForCausalLM.from_pretrained(tmp_path), "auto")  # not given: the saved config's
    agree, disagree = dict(attn_implementation="eager", dcmha_implementation="eager"), dict(dcmha_implementation="cpu")
    uses(AutoModelForCausalLM.from_pretrained(tmp_path, **agree), "eager")
    with pytest.raises(ValueError, match="attn_implementation='eager' and dcmha_implementation='cpu' disagree"):
        AutoModelForCausalLM.from_pretrained(tmp_path, **{**agree, **disagree})
    with pytest.raises(ValueError, match="attn_implementation='eager' and dcmha_implementation='cpu' disagree"):
        attention_config(**{**agree, **disagree})

    # output_attentions is accepted with every implementation ("compiled" here); the attentions each one returns are
    # checked in test_dcmha_backends.py::test_probabilities_match_eager (a forward here would trace "compiled" again)
    model.config.output_attentions = True
    model.config.validate()


@pytest.mark.parametrize("name", TRANSFORMERS_ATTENTION)
def test_transformers_attention_functions_are_a_clear_error_by_every_route(tmp_path, name):
    model = build_model(attention_config(dcmha_implementation="eager"))
    model.save_pretrained(tmp_path, model_card=False)
    message = f"attn_implementation='{name}' cannot compute DCFormer's attention.*dcmha_implementation"
    with pytest.raises(ValueError, match=message):
        attention_config(attn_implementation=name)
    with pytest.raises(ValueError, match=message):
        AutoModelForCausalLM.from_config(attention_config(), attn_implementation=name)
    with pytest.raises(ValueError, match=message):
        AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=name)
    with pytest.raises(ValueError, match=message):
        model.set_attn_implementation(name)
    assert model.config._attn_implementation == model.config.dcmha_implementation == "eager"  # unchanged
