"""`DynamicWeightProjection` computes x's two products (with dw1 and dd) from the parameters as they are in float32
and, in half precision, as one GEMM against a fused, transposed copy of the two weights made per call (oneDNN's fast
layout: docs/performance.md). These tests prove that the outputs follow every change of the parameters (in-place
updates, torch's fused AdamW, which does not bump version counters, a load, a cast) and that training gets the
gradients of dw1 and dd. The numbers are checked against the spec's einsum form."""

import pytest
import torch
import torch.nn.functional as F

from helpers import build_model, make_config
from modeling_dcformer.modeling_dcformer import DW_RMS_EPS


def spec_terms(proj, x):
    """The packed terms [B, T, G, C, 2I+1, M] from the spec (step 5), with einsum, in float64."""
    x = x.double()
    dw1, qkw, dd = proj.dw1.double(), proj.qkw.double(), proj.dd.double()
    I, M, C = proj.rank, proj.heads_per_group, proj.num_slots
    h = F.gelu(torch.einsum("btd,dgck->btgck", x, dw1))
    w = torch.einsum("btgck,gckim->btgcim", h, qkw)
    w1, w2 = w[..., :I, :], w[..., I:, :]
    w1 = w1 * torch.rsqrt(w1.pow(2).mean(-1, keepdim=True) + DW_RMS_EPS)
    diag = torch.tanh(torch.einsum("btd,dgn->btgn", x, dd)).unflatten(-1, (C, M)).unsqueeze(-2)
    return torch.cat((w1, w2, diag), dim=-2)


@pytest.fixture
def proj():
    return build_model(make_config(num_hidden_layers=1, num_head_groups=2)).model.layers[0].self_attn.dyn_w_proj


def test_the_fused_product_matches_the_spec_and_follows_in_place_updates(proj):
    x = torch.randn(2, 5, proj.dw1.shape[0], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(proj(x).double(), spec_terms(proj, x), atol=1e-5, rtol=1e-5)
        proj.dw1.mul_(-1.5)  # an optimizer step or load_state_dict: in place
        proj.dd.add_(0.3)
        torch.testing.assert_close(proj(x).double(), spec_terms(proj, x), atol=1e-5, rtol=1e-5)
    with torch.inference_mode():
        torch.testing.assert_close(proj(x).double(), spec_terms(proj, x), atol=1e-5, rtol=1e-5)
        proj.dd.zero_()
        torch.testing.assert_close(proj(x).double(), spec_terms(proj, x), atol=1e-5, rtol=1e-5)
    proj.load_state_dict({k: torch.randn_like(v) for k, v in proj.state_dict().items()})
    with torch.no_grad():
        torch.testing.assert_close(proj(x).double(), spec_terms(proj, x), atol=1e-5, rtol=1e-5)
    proj.dw1.data = proj.dw1.data * 2  # a new tensor in place of the old one
    with torch.no_grad():
        torch.testing.assert_close(proj(x).double(), spec_terms(proj, x), atol=1e-5, rtol=1e-5)


def test_half_precision_and_casts(proj):
    x = torch.randn(1, 3, proj.dw1.shape[0], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        proj(x)
        proj.to(torch.bfloat16)
        out = proj(x.bfloat16())
        with torch.inference_mode():
            again = proj(x.bfloat16())
    assert out.dtype == torch.float32  # the terms are fp32 whatever the model dtype
    torch.testing.assert_close(out.double(), spec_terms(proj, x.bfloat16()), atol=0.1, rtol=0.1)  # bf16 rounding
    assert torch.equal(again, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("optimizer", ["fused", "foreach"])
def test_outputs_follow_optimizer_steps_between_inference_calls(proj, dtype, optimizer):
    """Training with evaluations in between (the Trainer: its default optimizer is torch's fused AdamW, which
    updates the parameters in place without bumping their version counters): every no-grad call after a step
    computes with the updated dw1 and dd. A copy kept across calls made every evaluation use the weights of the
    first one (found in the study of docs/evidence.md: DCFormer's validation loss lagged its training loss)."""
    proj.to(dtype)
    x = torch.randn(2, 4, proj.dw1.shape[0], generator=torch.Generator().manual_seed(4)).to(dtype)
    opt = torch.optim.AdamW(proj.parameters(), lr=0.5, **{optimizer: True})
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.1, rtol=0.1)
    for _ in range(2):
        with torch.no_grad():
            before = proj(x)
            torch.testing.assert_close(before.double(), spec_terms(proj, x), **tol)
        proj(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            after = proj(x)
        torch.testing.assert_close(after.double(), spec_terms(proj, x), **tol)
        assert not torch.allclose(after, before)  # the step changed the terms, and the call saw it


def test_training_gets_the_gradients_of_dw1_and_dd(proj):
    x = torch.randn(2, 4, proj.dw1.shape[0], generator=torch.Generator().manual_seed(2), requires_grad=True)
    with torch.no_grad():
        proj(x)  # an inference call first: training must not depend on it
    proj(x).pow(2).sum().backward()
    grads = {n: p.grad.clone() for n, p in proj.named_parameters()} | {"x": x.grad.clone()}
    proj.zero_grad()
    x.grad = None
    xd = x.detach().double().requires_grad_()
    ref = {n: p.detach().double().requires_grad_() for n, p in proj.named_parameters()}
    spec = spec_terms(type("P", (), dict(dw1=ref["dw1"], qkw=ref["qkw"], dd=ref["dd"], rank=proj.rank,
                                         heads_per_group=proj.heads_per_group, num_slots=proj.num_slots)), xd)
    spec.pow(2).sum().backward()
    for name in ("dw1", "qkw", "dd"):
        torch.testing.assert_close(grads[name].double(), ref[name].grad, atol=1e-4, rtol=1e-4, msg=name)
    torch.testing.assert_close(grads["x"].double(), xd.grad, atol=1e-4, rtol=1e-4)


def test_frozen_weights_with_a_trainable_input_after_an_inference_call(proj):
    """After an inference_mode call, a call with grad enabled (frozen projection, an input that needs a gradient,
    as in adapter training) can backpropagate to the input."""
    x = torch.randn(1, 3, proj.dw1.shape[0], generator=torch.Generator().manual_seed(3))
    proj.requires_grad_(False)
    with torch.inference_mode():
        proj(x)
    x.requires_grad_(True)
    proj(x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_a_generations_kept_copy_is_reused_and_never_trains(proj):
    """`kept` (the cache's dict for one generation): half precision without gradients makes the fused weight once
    and reuses it; with gradients recorded it is ignored, so a kept copy can never stand in for the parameters."""
    proj.to(torch.bfloat16)
    x = torch.randn(1, 3, proj.dw1.shape[0], generator=torch.Generator().manual_seed(5)).bfloat16()
    kept = {}
    with torch.no_grad():
        first = proj(x, kept)
        weight = kept["weight"]
        assert torch.equal(proj(x, kept), first) and kept["weight"] is weight  # reused, not rebuilt
    torch.testing.assert_close(first.double(), spec_terms(proj, x), atol=0.1, rtol=0.1)
    kept["weight"] = torch.zeros_like(weight)  # a wrong kept copy: training must not see it
    out = proj(x, kept)
    torch.testing.assert_close(out.double(), spec_terms(proj, x), atol=0.1, rtol=0.1)
    out.sum().backward()
    assert proj.dw1.grad is not None and proj.dw1.grad.abs().sum() > 0


def test_the_kept_copy_is_made_and_reused_under_torch_compile():
    """Compiled decoding (`torch.compile(model.forward)` with a static cache) keeps the generation's fused copy too:
    the compiled prefill stores it in the cache, the compiled decode step reads it instead of copying the weights
    again (at the 6.9B layer shape in bf16 the copy costs 8 ms a layer and token, the product with it 0.6 ms).
    Dynamo's graph capture alone ("eager" backend) is under test: the dict's side effect and the guard on it."""
    from modeling_dcformer.cache_dcformer import DCFormerCache

    torch._dynamo.reset()
    model = build_model(make_config(num_hidden_layers=1)).eval().to(torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(6))
    compiled = torch.compile(model.forward, backend="eager")
    with torch.no_grad():
        eager_cache = DCFormerCache(model.config, max_cache_len=8)
        model(ids[:, :4], cache=eager_cache, use_cache=True)
        eager = model(ids[:, 4:], cache=eager_cache, use_cache=True).logits
        cache = DCFormerCache(model.config, max_cache_len=8)
        compiled(ids[:, :4], cache=cache, use_cache=True)
        weight = cache.projection_weights[0].get("weight")
        assert weight is not None and weight.dtype == torch.bfloat16  # made by the compiled prefill, kept
        step = compiled(ids[:, 4:], cache=cache, use_cache=True).logits
        assert cache.projection_weights[0]["weight"] is weight  # the decode step read it, made no new one
    assert torch.equal(step, eager)


def test_every_forward_after_a_fused_optimizer_step_sees_the_new_weights():
    """A bf16 model evaluated with its cache on (as the Trainer's evaluation does), a fused AdamW step, then again:
    the second forward equals a fresh copy of the stepped model (each forward's cache is new: nothing kept across)."""
    import copy

    model = build_model(make_config(num_hidden_layers=2)).to(torch.bfloat16)
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(6))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    with torch.no_grad():
        before = model(ids, use_cache=True).logits
    model.train()
    model(ids, labels=ids).loss.backward()
    opt.step()
    model.eval()
    with torch.no_grad():
        after = model(ids, use_cache=True).logits
        fresh = copy.deepcopy(model)(ids, use_cache=True).logits
    assert torch.equal(after, fresh) and not torch.equal(after, before)
