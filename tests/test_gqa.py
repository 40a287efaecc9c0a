"""Grouped-query attention and the other attention shapes of Llama-family models: the config fields
(`num_key_value_heads`, `head_dim`, `attention_output_bias`) with their checks, the parameters they shape, and a
cache that keeps the key/value heads only (the outputs against the oracle: tests/test_oracle.py; every backend:
tests/test_dcmha_backends.py)."""

import pytest
import torch

from helpers import VOCAB, OutputShapes, assert_close, build_model, kv_copies, make_config, padded_batch
from modeling_dcformer import DCFormerConfig, DCFormerForCausalLM


def test_defaults_are_multi_head_attention_with_derived_head_dim():
    config = make_config()
    assert (config.num_key_value_heads, config.head_dim, config.key_value_groups) == (4, 8, 1)
    assert config.attention_output_bias is None and config.output_bias is config.attention_bias
    # a config saved before these fields existed loads as multi-head attention of its own shape
    raw = make_config().to_dict()
    for name in ("num_key_value_heads", "head_dim", "attention_output_bias"):
        raw.pop(name)
    old = DCFormerConfig.from_dict({**raw, "hidden_size": 64})
    assert (old.num_key_value_heads, old.head_dim) == (4, 16)


def test_grouped_shapes_and_round_trip():
    config = make_config(num_key_value_heads=2, head_dim=12, attention_bias=True, attention_output_bias=False)
    assert config.key_value_groups == 2 and not config.output_bias
    attention = DCFormerForCausalLM(config).model.layers[0].self_attn
    assert attention.qkv_proj.weight.shape == ((4 + 2 * 2) * 12, 32) and attention.qkv_proj.bias is not None
    assert attention.o_proj.weight.shape == (32, 4 * 12) and attention.o_proj.bias is None
    again = DCFormerConfig.from_dict(config.to_dict())
    assert (again.num_key_value_heads, again.head_dim, again.attention_output_bias) == (2, 12, False)
    # an output bias of its own, with none on q, k, v
    other = DCFormerForCausalLM(make_config(attention_bias=False, attention_output_bias=True)).model.layers[0]
    assert other.self_attn.qkv_proj.bias is None and other.self_attn.o_proj.bias is not None


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(num_key_value_heads=3), r"^num_key_value_heads \(3\) must divide num_attention_heads \(4\)"),
        (dict(num_key_value_heads=0), r"^num_key_value_heads must be a positive integer or None, got 0$"),
        (dict(head_dim=0), r"^head_dim must be a positive integer or None, got 0$"),
        (dict(head_dim=7, partial_rotary_factor=1.0), r"times head_dim \(7\) must give an even number"),
        (dict(hidden_size=30), r"^hidden_size \(30\) must be divisible by num_attention_heads \(4\), or head_dim"),
    ],
)
def test_bad_attention_shapes_are_one_line_errors(fields, message):
    with pytest.raises(ValueError, match=message) as err:
        make_config(**fields)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "fields",
    [dict(num_key_value_heads=1), dict(num_key_value_heads=4), dict(hidden_size=30, head_dim=8),
     dict(head_dim=16), dict(head_dim=8)],
    ids=["one-kv-head", "kv-heads-equal-heads", "head_dim-where-hidden-does-not-divide", "head_dim-wider",
         "head_dim-as-derived"],
)
def test_the_legitimate_neighbours_pass(fields):
    config = make_config(**fields)
    model = build_model(config)
    input_ids, mask = padded_batch()
    with torch.no_grad():
        assert torch.isfinite(model(input_ids, attention_mask=mask).logits).all()


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_the_cache_keeps_only_the_key_value_heads(static):
    """Decoding through the cache: keys and values of Nkv heads stored (not one copy per query head), and the
    steps' logits equal the full forward pass."""
    config = make_config(num_key_value_heads=2, head_dim=12, use_qk_norm=True, window_size=4, num_head_groups=2)
    model = build_model(config)
    input_ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    extra = dict(cache_implementation="static") if static else {}
    with torch.no_grad():
        full = model(input_ids, use_cache=False).logits
        out = model.generate(input_ids[:, :5], max_new_tokens=4, min_new_tokens=4, do_sample=False,
                             return_dict_in_generate=True, output_logits=True, **extra)
    cache = out.past_key_values
    for layer in cache.layers:
        assert layer.keys.shape[:2] == (2, 2) and layer.keys.shape[-1] == 12
        assert layer.values.shape == layer.keys.shape
    steps = model(out.sequences[:, :-1], use_cache=False).logits[:, 4:]
    assert_close(torch.stack(out.logits, dim=1), steps, atol=1e-4, rtol=1e-4)
    assert_close(model(input_ids[:, :5], use_cache=False).logits, full[:, :5])


@pytest.mark.parametrize("backend", ["eager", "compiled"])
@pytest.mark.usefixtures("aot_eager_compile")
def test_pytorch_backends_never_copy_grouped_kv_heads(backend):
    """The pure-PyTorch backends (what a save carries as remote code), forward and backward over chunks with a
    window and padding, every op's outputs recorded: none holds the keys or values once per query head (the
    kernels: tests/test_dcmha_cpu.py, tests/test_dcmha_triton.py). S (29 keys) is no other size of the call."""
    from modeling_dcformer import dcmha

    B, N, Nkv, G, I, Dh, T, S = 2, 4, 2, 2, 2, 6, 21, 29
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, N, T, Dh, generator=gen, requires_grad=True)
    k, v = (torch.randn(B, Nkv, S, Dh, generator=gen, requires_grad=True) for _ in range(2))
    qt, kt = (torch.randn(B, L, G, 2, 2 * I + 1, N // G, generator=gen, requires_grad=True) for L in (T, S))
    pad = torch.rand(B, S, generator=gen) > 0.2
    with OutputShapes() as recorded:
        inputs = dcmha.DCMHAInputs(q, k, v, qt, kt, S - T, 0, pad, 5, I, G, 8)  # a cached prefix of S - T keys
        out, _ = dcmha.dcmha_attention(inputs, backend)
        out.square().sum().backward()
    assert q.grad is not None and k.grad.shape == (B, Nkv, S, Dh) and kt.grad.abs().sum() > 0
    assert kv_copies(recorded.shapes, B, N, S, Dh) == []
    with OutputShapes() as control:  # the recorder sees a copy per query head where one is made
        k.repeat_interleave(N // Nkv, dim=1)
    assert kv_copies(control.shapes, B, N, S, Dh) == [(B, N, S, Dh)]


@pytest.mark.parametrize("backend", ["eager", "compiled", "cpu", "triton"])
def test_every_backend_refuses_key_value_heads_that_do_not_divide_the_query_heads(backend):
    from modeling_dcformer.dcmha import DCMHA_BACKENDS, DCMHAInputs

    q = torch.randn(1, 4, 3, 8)
    k = v = torch.randn(1, 3, 3, 8)
    terms = torch.randn(1, 3, 1, 2, 5, 4)
    reason = DCMHA_BACKENDS[backend].why_not(DCMHAInputs(q, k, v, terms, terms, 0, 0, None, None, 2, 1, 4))
    if reason is not None and "divides" not in reason:
        pytest.skip(f'"{backend}" cannot run here: {reason}')
    assert reason == ("its keys (1, 3, 3, 8) and values (1, 3, 3, 8) need a number of heads that divides the "
                      "queries' 4 (grouped-query attention), the same for both")
    assert DCMHA_BACKENDS[backend].why_not(DCMHAInputs(q, k[:, :2], v[:, :2], terms, terms, 0, 0, None, None, 2, 1,
                                                       4)) in (None, reason.replace("3, 3", "2, 3"))
