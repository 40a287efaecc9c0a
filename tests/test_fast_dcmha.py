"""The DCMHA implementations (`DCFormerConfig.dcmha_implementation`): each one against the oracle.

- `compose_pointwise` (the form torch.compile fuses) against `oracle_compose`, in eager mode: every option.
- the "compiled" dispatch (dynamic chunk/key lengths, padding, windows, caches, recompute in the backward
  pass) through torch.compile with the cheap `aot_eager` backend: every option, forward and backward;
- one whole model through Inductor itself (the generated C++ kernels), forward and backward;
- the "auto" rule: eager below the size threshold or where Inductor cannot generate code.
"""

import os

import pytest
import torch

import modeling_dcformer.modeling_dcformer as mdl
from modeling_dcformer import DCFormerConfig, DCFormerForCausalLM
from oracle import oracle_causal_lm, oracle_compose
from test_oracle import VOCAB, as_double, assert_close, build_model, make_config


pytestmark = pytest.mark.usefixtures("one_thread_each_test")


@pytest.fixture
def aot_eager_compile(monkeypatch):
    """The "compiled" implementation through torch.compile's `aot_eager` backend: the same tracing, dynamic
    shapes and autograd as with Inductor, without generating C++ (seconds instead of a minute)."""
    torch._dynamo.reset()
    monkeypatch.setattr(mdl, "COMPILE_BACKEND", "aot_eager")
    monkeypatch.setattr(mdl, "_compiled_stages", {})
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("key_wise", [True, False])
def test_compose_pointwise_matches_oracle(key_wise, groups):
    B, N, T, S, I = 2, 4, 5, 7, 2
    M = N // groups
    gen = torch.Generator().manual_seed(0)
    A = torch.randn(B, N, T, S, generator=gen, dtype=torch.float64)
    qt = torch.randn(B, T, groups, 2 * I + 1, M, generator=gen, dtype=torch.float64)
    kt = torch.randn(B, S, groups, 2 * I + 1, M, generator=gen, dtype=torch.float64) if key_wise else None
    out = mdl.compose_pointwise(A.view(B, groups, M, T, S), qt, kt, I).view(B, N, T, S)
    key_args = (kt[..., :I, :], kt[..., I : 2 * I, :], kt[..., 2 * I, :]) if key_wise else ()
    ref = oracle_compose(A, qt[..., :I, :], qt[..., I : 2 * I, :], qt[..., 2 * I, :], *key_args)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    # and the eager `compose` gives the same numbers
    torch.testing.assert_close(mdl.compose(A.view(B, groups, M, T, S), qt, kt, I).view(B, N, T, S), ref)


def padded_batch():
    gen = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, VOCAB, (2, 13), generator=gen)
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    mask[1, -3:] = 0  # right padding
    return input_ids, mask


def loss_and_grads(model, input_ids, mask):
    model.zero_grad()
    out = model(input_ids, attention_mask=mask, use_cache=False)
    weights = torch.linspace(-1, 1, out.logits.numel()).view_as(out.logits)
    loss = (out.logits * weights * mask[..., None]).mean()  # a mean, as in test_oracle's backward tests
    loss.backward()
    return out.logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "options",
    [
        dict(query_wise=False, num_head_groups=1, dynamic_rank=2, attention_chunk_size=4),
        dict(query_wise=True, num_head_groups=2, dynamic_rank=1, attention_chunk_size=512),
        dict(query_wise=False, num_head_groups=2, dynamic_rank=2, attention_chunk_size=5, train=True),
    ],
    ids=["chunk4", "querywise-groups2", "train-recompute"],
)
def test_compiled_dispatch_matches_eager_and_oracle(options, aot_eager_compile):
    options = dict(options)
    train = options.pop("train", False)
    config = make_config(use_qk_norm=True, window_size=4, dcmha_implementation="eager", **options)
    model = build_model(config).train(train)
    input_ids, mask = padded_batch()
    eager_logits, eager_grads = loss_and_grads(model, input_ids, mask)
    model.config.dcmha_implementation = "compiled"
    logits, grads = loss_and_grads(model, input_ids, mask)
    real = mask.bool()
    assert_close(logits[real], eager_logits[real])
    for name, grad in grads.items():
        assert_close(grad, eager_grads[name])
    assert_rows_match_oracle(model, logits, input_ids, mask)


def assert_rows_match_oracle(model, logits, input_ids, mask):
    """The logits of each row's real tokens against the oracle run on that row alone, without padding."""
    state = as_double(model.state_dict())
    real = mask.bool()
    for row in range(input_ids.shape[0]):
        ids = input_ids[row, real[row]][None]
        assert_close(logits[row, real[row]], oracle_causal_lm(state, model.config, ids)[0])


def assert_decoding_matches_full_forward(model):
    """Prefill of 6 tokens, then one token at a time through the cache (a local layer's cache keeps only its
    window): the logits of the full forward pass."""
    input_ids, _ = padded_batch()
    with torch.no_grad():
        full = model(input_ids, use_cache=False).logits
        out = model(input_ids[:, :6], use_cache=True)
        cache, steps = out.past_key_values, [out.logits]
        for t in range(6, input_ids.shape[1]):
            out = model(input_ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits)
    assert_close(torch.cat(steps, dim=1), full, atol=1e-4, rtol=1e-4)


def test_compiled_dispatch_decodes_like_full_forward(aot_eager_compile):
    config = make_config(use_qk_norm=True, window_size=4, attention_chunk_size=3, dcmha_implementation="compiled")
    assert_decoding_matches_full_forward(build_model(config))


@pytest.mark.skipif(
    os.environ.get("DCFORMER_SKIP_INDUCTOR") == "1",
    reason="DCFORMER_SKIP_INDUCTOR=1: skips the minute Inductor spends building C++ kernels with gcc",
)
def test_inductor_model_forward_backward_matches_oracle():
    """The generated kernels themselves: a training step of a whole model (local and global layers, padding,
    chunks recomputed in the backward pass) with "compiled" against "eager" and the oracle."""
    if not mdl.compile_supported(torch.device("cpu")):
        pytest.skip("no C++ compiler for Inductor")
    torch._dynamo.reset()
    mdl._compiled_stages.clear()
    config = make_config(use_qk_norm=True, window_size=4, num_hidden_layers=2, attention_chunk_size=8)
    model = build_model(config).train()
    input_ids, mask = padded_batch()
    model.config.dcmha_implementation = "eager"
    eager_logits, eager_grads = loss_and_grads(model, input_ids, mask)
    model.config.dcmha_implementation = "compiled"
    try:
        logits, grads = loss_and_grads(model, input_ids, mask)
    finally:
        mdl._compiled_stages.clear()
        torch._dynamo.reset()
    real = mask.bool()
    assert_close(logits[real], eager_logits[real])
    for name, grad in grads.items():
        assert_close(grad, eager_grads[name])
    state = as_double(model.state_dict())
    ids = input_ids[1, real[1]][None]
    assert_close(logits[1, real[1]], oracle_causal_lm(state, config, ids)[0])


def test_auto_picks_by_size_and_device(monkeypatch):
    cpu = torch.device("cpu")
    small, big = mdl.AUTO_COMPILE_MIN_SCORES - 1, mdl.AUTO_COMPILE_MIN_SCORES
    monkeypatch.setattr(mdl, "compile_supported", lambda device: True)
    assert mdl.resolve_dcmha_implementation("auto", cpu, small) == "eager"
    assert mdl.resolve_dcmha_implementation("auto", cpu, big) == "compiled"
    assert mdl.resolve_dcmha_implementation("eager", cpu, big) == "eager"
    assert mdl.resolve_dcmha_implementation("compiled", cpu, small) == "compiled"
    monkeypatch.setattr(mdl, "compile_supported", lambda device: False)
    assert mdl.resolve_dcmha_implementation("auto", cpu, big) == "eager"
    assert not mdl.compile_supported(torch.device("meta"))


def test_auto_sends_big_calls_to_the_compiled_path(monkeypatch):
    """With "auto", an attention call whose scores reach the threshold runs compiled chunks, a small one does not
    (without the CPU kernel, which "auto" prefers where no gradient is needed: tests/test_cpu_kernel.py)."""
    calls = []
    monkeypatch.setattr(mdl, "kernel_buildable", lambda: False)

    def fake_compiled(*args, **kwargs):
        calls.append(args[0].shape)
        return mdl.attend_chunk_staged(*args, **kwargs)

    monkeypatch.setattr(mdl, "compiled_attend_chunk", fake_compiled)
    monkeypatch.setattr(mdl, "compile_supported", lambda device: True)
    monkeypatch.setattr(mdl, "AUTO_COMPILE_MIN_SCORES", 4 * 16 * 16)  # heads x queries x keys
    model = build_model(make_config(num_hidden_layers=1, dcmha_implementation="auto"))
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(ids[:, :8])
        assert calls == []
        logits = model(ids).logits
        assert len(calls) == 1
        model.config.dcmha_implementation = "eager"
        assert_close(logits, model(ids).logits)  # the staged chunk (run eagerly here) gives the same numbers


def test_bad_implementation_is_a_clear_error():
    with pytest.raises(ValueError, match="dcmha_implementation"):
        DCFormerConfig(hidden_size=32, num_attention_heads=4, dcmha_implementation="flash")


def test_implementation_survives_save_and_load(tmp_path):
    config = make_config(dcmha_implementation="eager")
    DCFormerForCausalLM(config).save_pretrained(tmp_path)
    assert DCFormerConfig.from_pretrained(tmp_path).dcmha_implementation == "eager"


def test_auto_falls_back_to_eager_when_compilation_fails(monkeypatch):
    """"auto" on a machine where torch.compile cannot build kernels: a warning, then eager (same numbers);
    an explicit "compiled" reports the failure."""

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler worked")

    monkeypatch.setattr(mdl, "compiled_attend_chunk", broken)
    monkeypatch.setattr(mdl, "kernel_buildable", lambda: False)  # no CPU kernel either
    monkeypatch.setattr(mdl, "compile_supported", lambda device: True)
    monkeypatch.setattr(mdl, "AUTO_COMPILE_MIN_SCORES", 1)
    monkeypatch.setattr(mdl, "_compile_failed", False)
    assert_auto_does_without("compiled", "_compile_failed", "no C\\+\\+ compiler", length=9)
    assert mdl.resolve_dcmha_implementation("auto", torch.device("cpu"), 10**9) == "eager"


def assert_auto_does_without(implementation: str, failed_flag: str, error: str, length: int):
    """An implementation that cannot be built: "auto" gives the eager logits and remembers the failure in
    `modeling_dcformer.<failed_flag>`; asking for `implementation` itself raises the build's error."""
    model = build_model(make_config(num_hidden_layers=1, dcmha_implementation="eager"))
    ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits
        model.config.dcmha_implementation = "auto"
        assert_close(model(ids).logits, expected)
        assert getattr(mdl, failed_flag)
        model.config.dcmha_implementation = implementation
        with pytest.raises(RuntimeError, match=error):
            model(ids)


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("key_wise", [True, False])
def test_compose_one_query_matches_oracle(key_wise, groups):
    """The decode-step form (one query: the query-wise terms folded into an M x M matrix)."""
    B, N, S, I = 2, 4, 7, 2
    M = N // groups
    gen = torch.Generator().manual_seed(1)
    A = torch.randn(B, N, 1, S, generator=gen, dtype=torch.float64)
    qt = torch.randn(B, 1, groups, 2 * I + 1, M, generator=gen, dtype=torch.float64)
    kt = torch.randn(B, S, groups, 2 * I + 1, M, generator=gen, dtype=torch.float64) if key_wise else None
    out = mdl.compose_one_query(A.view(B, groups, M, 1, S), qt, kt, I).view(B, N, 1, S)
    key_args = (kt[..., :I, :], kt[..., I : 2 * I, :], kt[..., 2 * I, :]) if key_wise else ()
    ref = oracle_compose(A, qt[..., :I, :], qt[..., I : 2 * I, :], qt[..., 2 * I, :], *key_args)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("key_wise", [True, False])
def test_staged_chunk_equals_attend_chunk(key_wise, window):
    """`attend_chunk_staged` (what "compiled" compiles: stages, time-last terms, the mask computed from positions)
    gives `attend_chunk`'s numbers in eager mode, rows with no visible key (padding) included, and its
    probabilities; without padding, masked keys get exactly 0."""
    B, N, c, s, Dh, G, I = 2, 4, 3, 6, 8, 2, 2
    M = N // G
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, N, n, Dh, generator=gen, dtype=torch.float32) for n in (c, s, s))
    qt = torch.randn(B, c, G, 2, 2 * I + 1, M, generator=gen, dtype=torch.float32)
    kt = torch.randn(B, s, G, 2, 2 * I + 1, M, generator=gen, dtype=torch.float32) if key_wise else None
    q_pos, k_pos = torch.arange(3, 3 + c), torch.arange(s)  # queries at positions 3..5, keys at 0..5
    # the mask written out by hand: causal, within the window, real keys only
    allowed = torch.zeros(B, 1, c, s, dtype=torch.bool)
    for t in range(c):
        for j in range(s):
            allowed[:, 0, t, j] = j <= 3 + t and (window is None or j > 3 + t - window)
    pad = torch.ones(B, s, dtype=torch.bool)
    pad[1, :5] = False  # left padding: batch 1's first query (position 3) sees no real key
    time_last = lambda terms: None if terms is None else terms.permute(0, 2, 3, 4, 5, 1).contiguous()  # noqa: E731
    for key_padding_mask in (pad, None):
        mask = allowed & key_padding_mask[:, None, None, :] if key_padding_mask is not None else allowed
        out, probs = mdl.attend_chunk(q, k, v, qt, kt, mask, I, G)
        out2, probs2 = mdl.attend_chunk_staged(
            q, k, v, time_last(qt), time_last(kt), q_pos, k_pos, key_padding_mask, window, I, G
        )
        torch.testing.assert_close(out2, out, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(probs2, probs, rtol=1e-6, atol=1e-6)
        assert torch.isfinite(out2).all()
        assert (probs2[~mask.expand_as(probs2)] == 0).all()
        if key_padding_mask is not None:
            assert (out2[1, 0] == 0).all() and (probs2[1, :, 0] == 0).all()  # the query that sees nothing


def test_compiled_stages_do_not_recompile_for_new_lengths(aot_eager_compile):
    """The stages are compiled for dynamic batch and lengths: a longer sequence, a different batch size or new
    chunk and key lengths reuse the graphs (a dim marked dynamic by a negative index was once silently ignored,
    and every key length compiled a graph of its own)."""
    from torch._dynamo.utils import counters

    G, M, I, Dh = 1, 4, 2, 8
    N = G * M

    def run(B, T):
        gen = torch.Generator().manual_seed(T)
        q, k, v = (torch.randn(B, N, T, Dh, generator=gen) for _ in range(3))
        terms = torch.randn(B, T, G, 4, 2 * I + 1, M, generator=gen)
        with torch.no_grad():
            out, _ = mdl.dcmha_attention(
                q, k, v, terms[:, :, :, 0::2], terms[:, :, :, 1::2], 0, 0, None, None, I, G, 8,
                implementation="compiled",
            )
            ref, _ = mdl.dcmha_attention(
                q, k, v, terms[:, :, :, 0::2], terms[:, :, :, 1::2], 0, 0, None, None, I, G, 8,
                implementation="eager",
            )
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)

    run(2, 24)  # chunks of 8 queries against 8, 16 and 24 keys
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    run(2, 40)
    run(3, 36)
    assert counters["stats"]["unique_graphs"] == graphs
