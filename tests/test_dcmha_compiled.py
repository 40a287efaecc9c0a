"""What is specific to the "compiled" backend and to the one Compose function (the shared checks of every backend are
in test_dcmha_backends.py):

- `compose` (the Compose maths, written once) against the oracle's `oracle_compose`: query- and key-wise, groups,
  one query (a decode step), precomputed hidden values, and its two formulations (per head and rank, as the compiled
  stages run it; batched over the heads, as "eager" runs chunks of few queries) against each other;
- the compiled stages do not recompile for new lengths or batch sizes;
- `compose_backward` (the written-out gradient of a Compose step) against autograd through the oracle's Compose;
- a whole model through Inductor itself (the generated C++ kernels), forward and backward (marked slow).
"""

import pytest
import torch

from helpers import as_double, assert_close, build_model, loss_and_grads, make_config, padded_batch
from modeling_dcformer import dcmha
from modeling_dcformer.dcmha import DCMHAInputs
from modeling_dcformer.dcmha_base import visible_keys
from modeling_dcformer.dcmha_compiled import COMPILED, compose_backward
from modeling_dcformer.dcmha_eager import compose, compose_hidden, pair_terms
from oracle import oracle_causal_lm, oracle_compose

pytestmark = pytest.mark.usefixtures("one_thread_each_test")


@pytest.mark.parametrize("T", [5, 1], ids=["queries", "one-query"])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("key_wise", [True, False])
def test_compose_matches_oracle(key_wise, groups, T):
    B, N, S, I = 2, 4, 7, 2
    M = N // groups
    gen = torch.Generator().manual_seed(T)
    A = torch.randn(B, N, T, S, generator=gen, dtype=torch.float64)
    qt = torch.randn(B, T, groups, 2 * I + 1, M, generator=gen, dtype=torch.float64)
    kt = torch.randn(B, S, groups, 2 * I + 1, M, generator=gen, dtype=torch.float64) if key_wise else None
    q_last = qt.permute(0, 2, 3, 4, 1)  # time last: [B, G, 2I+1, M, T]
    k_last = None if kt is None else kt.permute(0, 2, 3, 4, 1)
    out = compose(A.view(B, groups, M, T, S), q_last, k_last, I).view(B, N, T, S)
    key_args = (kt[..., :I, :], kt[..., I : 2 * I, :], kt[..., 2 * I, :]) if key_wise else ()
    ref = oracle_compose(A, qt[..., :I, :], qt[..., I : 2 * I, :], qt[..., 2 * I, :], *key_args)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    # the stages' split (hidden values first) gives the same numbers
    hidden = compose_hidden(A.view(B, groups, M, T, S), q_last, k_last, I)
    staged = compose(A.view(B, groups, M, T, S), q_last, k_last, I, hidden=hidden).view(B, N, T, S)
    torch.testing.assert_close(staged, ref, atol=1e-12, rtol=1e-12)
    # and so does the batched formulation, on the factors paired at every (t, s)
    batched = compose(A.view(B, groups, M, T, S), None, None, I, pairs=pair_terms(q_last, k_last, S))
    torch.testing.assert_close(batched.view(B, N, T, S), ref, atol=1e-12, rtol=1e-12)
    assert (out - A).abs().max() > 1e-2  # the composition moves the scores: the test can fail


@pytest.mark.parametrize("key_wise", [True, False])
def test_compose_formulations_agree_in_float32_for_both_slots_at_once(key_wise):
    """What "eager" runs for a chunk of few queries (both slots' factors paired in one `pair_terms` call, each slot
    composed batched over the heads) against the loop over heads and ranks the compiled stages run, in fp32 at a
    DCPythia-6.9B group (32 heads, rank 2), one query and four."""
    B, G, M, S, I = 2, 1, 32, 37, 2
    gen = torch.Generator().manual_seed(5)
    for T in (1, 4):
        A = torch.randn(B, G, M, T, S, generator=gen)
        qt = torch.randn(B, G, 2, 2 * I + 1, M, T, generator=gen) * 0.3  # two slots, time last
        kt = torch.randn(B, G, 2, 2 * I + 1, M, S, generator=gen) * 0.3 if key_wise else None
        sides, diagonal = pair_terms(qt, kt, S)
        for slot in (0, 1):
            loop = compose(A, qt[:, :, slot], None if kt is None else kt[:, :, slot], I)
            batched = compose(A, None, None, I, pairs=(sides[:, :, slot], diagonal[:, :, slot]))
            torch.testing.assert_close(batched, loop, atol=1e-5, rtol=1e-5)
            assert (loop - A).abs().max() > 1e-1  # the composition moves the scores: the test can fail


@pytest.mark.parametrize("fill", [None, -1e30, 0.0], ids=["no-mask", "pre-softmax-mask", "post-softmax-mask"])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("key_wise", [True, False])
def test_compose_backward_matches_oracle_gradients(key_wise, groups, fill):
    """The written-out gradient of one Compose step (scaled, masked with padding and a window where `fill` is given)
    for the scores and both factors, against autograd through `oracle_compose` in float64."""
    B, N, c, s, I, scale = 2, 4, 5, 7, 2, 0.3
    M = N // groups
    gen = torch.Generator().manual_seed(groups)
    raw = torch.randn(B, groups, M, c, s, generator=gen, dtype=torch.float64, requires_grad=True)
    qt = torch.randn(B, c, groups, 2 * I + 1, M, generator=gen, dtype=torch.float64, requires_grad=True)
    kt = torch.randn(B, s, groups, 2 * I + 1, M, generator=gen, dtype=torch.float64, requires_grad=key_wise)
    q_pos, k_pos = torch.arange(2, 2 + c), torch.arange(s)
    pad = torch.tensor([[True] * s, [False] * 2 + [True] * (s - 2)])
    key_args = (kt[..., :I, :], kt[..., I : 2 * I, :], kt[..., 2 * I, :]) if key_wise else ()
    query_args = (qt[..., :I, :], qt[..., I : 2 * I, :], qt[..., 2 * I, :])
    out = oracle_compose(raw.view(B, N, c, s) * scale, *query_args, *key_args)
    if fill is not None:
        out = out.masked_fill(~visible_keys(q_pos, k_pos, 4, pad), fill)
    grad = torch.randn(B, N, c, s, generator=gen, dtype=torch.float64)
    out.backward(grad)
    q_last = qt.detach().permute(0, 2, 3, 4, 1)  # time last: [B, G, 2I+1, M, c]
    k_last = kt.detach().permute(0, 2, 3, 4, 1) if key_wise else None
    got = compose_backward(grad, raw.detach(), q_last, k_last, q_pos, k_pos, pad, 4, scale, fill, I)
    torch.testing.assert_close(got[0], raw.grad, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(got[1], qt.grad.permute(0, 2, 3, 4, 1), atol=1e-12, rtol=1e-12)
    if key_wise:
        torch.testing.assert_close(got[2], kt.grad.permute(0, 2, 3, 4, 1), atol=1e-12, rtol=1e-12)
    else:
        assert got[2] is None
    assert qt.grad.abs().max() > 1e-2 and raw.grad.abs().max() > 1e-2  # the test can fail


def test_compiled_stages_do_not_recompile_for_new_lengths():
    """The stages are compiled for dynamic batch and lengths: a longer sequence, a different batch size or new
    chunk and key lengths reuse the graphs (a dim marked dynamic by a negative index was once silently ignored,
    and every key length compiled a graph of its own)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    COMPILED.reset("aot_eager")
    G, M, I, Dh = 1, 4, 2, 8
    N = G * M

    def run(B, T):
        gen = torch.Generator().manual_seed(T)
        q, k, v = (torch.randn(B, N, T, Dh, generator=gen) for _ in range(3))
        terms = torch.randn(B, T, G, 4, 2 * I + 1, M, generator=gen)
        inputs = DCMHAInputs(q, k, v, terms[:, :, :, 0::2], terms[:, :, :, 1::2], 0, 0, None, None, I, G, 8)
        with torch.no_grad():
            out, _ = dcmha.dcmha_attention(inputs, "compiled")
            ref, _ = dcmha.dcmha_attention(inputs, "eager")
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)

    try:
        run(2, 24)  # chunks of 8 queries against 8, 16 and 24 keys
        graphs = counters["stats"]["unique_graphs"]
        assert graphs > 0
        run(2, 40)
        run(3, 36)
        assert counters["stats"]["unique_graphs"] == graphs
    finally:
        COMPILED.reset("inductor")
        torch._dynamo.reset()


@pytest.mark.expensive
def test_inductor_model_forward_backward_matches_oracle():
    """The generated kernels themselves: a training step of a whole model (local and global layers, padding,
    chunks recomputed in the backward pass) with "compiled" against "eager" and the oracle. `pytest -m expensive`:
    on CPU "auto" trains with the C++ kernel, and the default run checks "compiled"'s tracing, autograd and written-out
    gradient through aot_eager (test_dcmha_backends.py, test_compose_backward_matches_oracle_gradients); the GPU tests
    run it through Inductor on CUDA."""
    if not dcmha.compile_supported(torch.device("cpu")):
        pytest.skip("no C++ compiler for Inductor")
    torch._dynamo.reset()
    COMPILED.reset("inductor")
    config = make_config(use_qk_norm=True, window_size=4, num_hidden_layers=2, attention_chunk_size=8)
    model = build_model(config).train()
    input_ids, mask = padded_batch()
    model.config.dcmha_implementation = "eager"
    eager_logits, eager_grads = loss_and_grads(model, input_ids, mask)
    model.config.dcmha_implementation = "compiled"
    try:
        logits, grads = loss_and_grads(model, input_ids, mask)
    finally:
        COMPILED.reset()
        torch._dynamo.reset()
    real = mask.bool()
    assert_close(logits[real], eager_logits[real])
    for name, grad in grads.items():
        assert_close(grad, eager_grads[name])
    state = as_double(model.state_dict())
    ids = input_ids[1, real[1]][None]
    assert_close(logits[1, real[1]], oracle_causal_lm(state, config, ids)[0])
