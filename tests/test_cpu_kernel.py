"""What is specific to the "kernel" DCMHA backend (`modeling_dcformer/cpu_kernel.py` and `csrc/dcmha_cpu.cpp`, the
operator `torch.ops.dcformer.compose_softmax_compose_`); the checks shared by every backend (models against the
oracle, decoding, half precision, probabilities) are in test_dcmha_backends.py.

- one chunk of the operator against Compose -> mask -> softmax -> Compose written from the spec in float64
  (`oracle_compose`): ranks 1..5, groups, key-wise or query-wise, windows, padding (rows that see no key), key
  offsets, rows that are not a multiple of the vector width, several blocks and tiles, several threads;
- where it applies: "auto" uses it only where nothing needs gradients; "kernel" elsewhere is a clear error;
- the operator under torch.compile (its fake implementation) and its own argument checks;
- building: verified cached builds (a corrupt one is rebuilt), what a machine without a compiler gets.
"""

import os
import signal

import pytest
import torch

from helpers import VOCAB, assert_close, build_model, make_config
from modeling_dcformer import cpu_kernel, dcmha
from modeling_dcformer.dcmha import DCMHA_BACKENDS, DCMHAInputs
from oracle import oracle_compose

pytestmark = pytest.mark.usefixtures("one_thread_each_test")


@pytest.fixture(scope="module", autouse=True)
def _kernel_built():
    if not cpu_kernel.available():
        pytest.skip(f"the CPU kernel cannot be built here: {cpu_kernel.KERNEL.failure}")


def oracle_chunk(raw, qt, kt, allowed, scale, rank):
    """DCMHA between the two matrix products, from the spec, in float64: raw [B, N, c, s] q.k products;
    qt [B, c, G, 2, 2I+1, M], kt [B, s, G, 2, 2I+1, M] or None (slots pre, post); allowed [B, c, s] bool."""
    I = rank

    def slot(terms, k):
        if terms is None:
            return ()
        t = terms[:, :, :, k].double()
        return t[..., :I, :], t[..., I : 2 * I, :], t[..., 2 * I, :]

    mask = allowed[:, None]
    pre = oracle_compose(raw.double() * scale, *slot(qt, 0), *slot(kt, 0))
    probs = torch.softmax(pre.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)  # no visible key: 0
    post = oracle_compose(probs, *slot(qt, 1), *slot(kt, 1))
    return post.masked_fill(~mask, 0.0)


CASES = {
    # name: (B, G, M, rank, c, s, key_wise, window, padding, t0, s0)
    "rank2": (2, 1, 4, 2, 5, 21, True, None, False, 0, 0),
    "rank1-groups2": (1, 2, 3, 1, 4, 40, True, None, True, 3, 0),
    "querywise": (2, 2, 2, 2, 3, 17, False, None, True, 0, 0),
    "rank3-window": (1, 1, 5, 3, 6, 30, True, 9, False, 2, 5),
    "rank5-generic": (2, 1, 3, 5, 3, 19, True, None, True, 0, 0),
    "blocks-tail": (1, 1, 4, 2, 4, 300, True, 200, True, 7, 100),
    "decode-step": (2, 1, 4, 2, 1, 33, True, None, True, 0, 0),
}


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_chunk_matches_oracle(case, rows, monkeypatch):
    B, G, M, I, c, s, key_wise, window, padding, t0, s0 = CASES[case]
    monkeypatch.setattr(cpu_kernel, "rows_per_tile", lambda heads, keys: rows)
    N, T, S = G * M, t0 + c + 2, s0 + s + 3  # the factors cover more queries / keys than the chunk
    gen = torch.Generator().manual_seed(len(case) * 10 + rows)
    raw = torch.randn(B, N, c, s, generator=gen) * 3
    qt = torch.randn(B, T, G, 2, 2 * I + 1, M, generator=gen) * 0.5
    kt = torch.randn(B, S, G, 2, 2 * I + 1, M, generator=gen) * 0.5 if key_wise else None
    pad = None
    if padding:
        pad = torch.rand(B, S, generator=gen) > 0.3
        pad[0, : s0 + s - c + 1] = False  # batch 0: its first query sees no real key
    # the chunk's queries sit at absolute positions qpos0.., its keys at kpos0..; the last key is the last query
    kpos0 = 50
    qpos0 = kpos0 + s - c
    q_pos, k_pos = torch.arange(qpos0, qpos0 + c), torch.arange(kpos0, kpos0 + s)
    allowed = (k_pos[None, :] <= q_pos[:, None]).expand(B, c, s)
    if window is not None:
        allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
    if pad is not None:
        allowed = allowed & pad[:, None, s0 : s0 + s]
    assert not allowed[0, 0].any() or not padding
    time_last = lambda terms: None if terms is None else terms.permute(0, 2, 3, 4, 5, 1).contiguous()
    scores = raw.clone()
    out = cpu_kernel.compose_softmax_compose(
        scores, time_last(qt), t0, time_last(kt), s0, pad, qpos0, kpos0, window, 0.3, I, G
    )
    assert out.data_ptr() == scores.data_ptr()  # in place
    qt_chunk = qt[:, t0 : t0 + c]
    kt_chunk = None if kt is None else kt[:, s0 : s0 + s]
    ref = oracle_chunk(raw, qt_chunk, kt_chunk, allowed, 0.3, I)
    torch.testing.assert_close(scores.double(), ref, atol=1e-5, rtol=1e-5)
    assert (scores.masked_select(~allowed[:, None].expand_as(scores)) == 0).all()
    # the test can fail: the composition moves the result
    plain = torch.softmax(raw.double().mul(0.3).masked_fill(~allowed[:, None], float("-inf")), -1).nan_to_num(0.0)
    assert (plain - ref).abs().max() > 1e-2


def chunk_inputs(B=2, G=2, M=4, I=2, c=32, s=200, seed=5):
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randn(B, G * M, c, s, generator=gen)
    qt = torch.randn(B, G, 2, 2 * I + 1, M, c, generator=gen) * 0.5
    kt = torch.randn(B, G, 2, 2 * I + 1, M, s, generator=gen) * 0.5
    return raw, qt, kt, I, G


def test_kernel_threads_give_the_same_numbers(monkeypatch):
    """Tiles spread over PyTorch's intra-op threads: each tile is computed alone, so the numbers do not depend on
    them."""
    monkeypatch.setattr(cpu_kernel, "PARALLEL_MIN_SCORES", 0)  # this small chunk too
    monkeypatch.setattr(cpu_kernel, "_parallel_pid", None)
    raw, qt, kt, I, G = chunk_inputs()
    c, s = raw.shape[2:]
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        assert cpu_kernel.runs_parallel(raw.numel()) == (threads > 1)
        scores = raw.clone()
        cpu_kernel.compose_softmax_compose(scores, qt, 0, kt, 0, None, s - c, 0, None, 0.125, I, G)
        results.append(scores)
    assert torch.equal(results[0], results[1])


def test_a_forked_child_runs_the_kernel_on_its_own_thread(monkeypatch):
    """After the kernel ran in parallel, a forked child (whose parent's OpenMP threads do not exist there) runs it
    on the calling thread, and finishes."""
    monkeypatch.setattr(cpu_kernel, "PARALLEL_MIN_SCORES", 0)
    monkeypatch.setattr(cpu_kernel, "_parallel_pid", None)
    torch.set_num_threads(2)
    raw, qt, kt, I, G = chunk_inputs()
    c, s = raw.shape[2:]
    scores, again = raw.clone(), raw.clone()
    cpu_kernel.compose_softmax_compose(scores, qt, 0, kt, 0, None, s - c, 0, None, 0.125, I, G)
    assert cpu_kernel._parallel_pid == os.getpid()
    pid = os.fork()
    if pid == 0:  # the child: no new tensor (PyTorch's own parallel copies would hang here), only the kernel
        signal.alarm(30)
        try:
            assert not cpu_kernel.runs_parallel(raw.numel())
            cpu_kernel.compose_softmax_compose(again, qt, 0, kt, 0, None, s - c, 0, None, 0.125, I, G)
            same = again.view(-1)[:2000].tolist() == scores.view(-1)[:2000].tolist()  # serial, unlike torch.equal
            os._exit(0 if same else 3)
        except BaseException:
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status}"


def test_auto_uses_the_kernel_only_without_gradients(monkeypatch):
    calls = []
    real = cpu_kernel.compose_softmax_compose

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_kernel, "compose_softmax_compose", counted)
    model = build_model(make_config(num_hidden_layers=2, dcmha_implementation="auto"))
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        inference = model(ids).logits
    assert len(calls) == 2  # one chunk per layer
    calls.clear()
    training = model(ids).logits  # gradients wanted: "compiled" or "eager", never the kernel
    assert calls == []
    assert_close(inference, training.detach())
    training.sum().backward()
    assert model.lm_head.weight.grad is not None


def probe(requires_grad=False, device="cpu", rank=2):
    q = torch.zeros(1, 4, 5, 8, device=device, requires_grad=requires_grad)
    terms = torch.zeros(1, 5, 1, 2, 2 * rank + 1, 4, device=device)
    return DCMHAInputs(q, q, q, terms, terms, 0, 0, None, None, rank, 1, 4)


def test_kernel_is_a_clear_error_where_it_cannot_run():
    model = build_model(make_config(num_hidden_layers=1, dcmha_implementation="kernel")).train()
    ids = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="computes no gradients"):
        model(ids)
    kernel = DCMHA_BACKENDS["kernel"]
    assert "runs on CPU" in kernel.why_not(probe(device="meta"))
    assert "rank" in kernel.why_not(probe(rank=cpu_kernel.MAX_RANK + 1))
    assert kernel.why_not(probe()) is None
    with pytest.raises(ValueError, match="contiguous float32"):
        cpu_kernel.compose_softmax_compose(
            torch.zeros(1, 2, 3, 4, dtype=torch.float64), torch.zeros(1, 1, 2, 5, 2, 3), 0, None, 0, None, 0, 0,
            None, 1.0, 2, 1,
        )  # fmt: skip
    with pytest.raises(ValueError, match="do not match"):
        cpu_kernel.compose_softmax_compose(
            torch.zeros(1, 2, 3, 4), torch.zeros(1, 1, 2, 5, 3, 3), 0, None, 0, None, 0, 0, None, 1.0, 2, 1
        )


def test_auto_keeps_the_gradient_of_any_input():
    """Only the values need a gradient (say, a frozen model with an adapter on them): "auto" must not take the
    forward-only kernel, and the gradient is the eager one."""
    B, N, T, Dh, G, I = 1, 4, 6, 8, 2, 2
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(B, N, T, Dh, generator=gen) for _ in range(3))
    qt = torch.randn(B, T, G, 2, 2 * I + 1, N // G, generator=gen) * 0.5
    kt = torch.randn(B, T, G, 2, 2 * I + 1, N // G, generator=gen) * 0.5
    grads = {}
    for implementation in ("auto", "eager"):
        value = v.clone().requires_grad_()
        out, _ = dcmha.dcmha_attention(DCMHAInputs(q, k, value, qt, kt, 0, 0, None, None, I, G, 4), implementation)
        out.sum().backward()
        grads[implementation] = value.grad
    assert_close(grads["auto"], grads["eager"])
    value = v.clone().requires_grad_()
    with pytest.raises(ValueError, match="computes no gradients"):
        dcmha.dcmha_attention(DCMHAInputs(q, k, value, qt, kt, 0, 0, None, None, I, G, 4), "kernel")


def test_kernel_refuses_bounds_it_would_read_past():
    """The C++ loops trust their offsets: the operator checks them (a mistake is an error, not a stray read)."""
    B, G, M, I, c, s = 1, 1, 2, 1, 3, 5
    scores = torch.zeros(B, G * M, c, s)
    qt, kt = torch.zeros(B, G, 2, 2 * I + 1, M, 4), torch.zeros(B, G, 2, 2 * I + 1, M, 6)
    run = lambda *a: cpu_kernel.compose_softmax_compose(scores, *a, 0, 0, None, 1.0, I, G)  # noqa: E731
    with pytest.raises(ValueError, match="queries"):
        run(qt, 2, kt, 0, None)
    with pytest.raises(ValueError, match="keys"):
        run(qt, 0, kt, 2, None)
    with pytest.raises(ValueError, match="key_padding_mask"):
        run(qt, 0, kt, 0, torch.ones(B, 4, dtype=torch.bool))
    run(qt, 1, kt, 1, torch.ones(B, 6, dtype=torch.bool))  # the last valid offsets


def test_the_operator_traces_under_torch_compile():
    """A real PyTorch operator with a fake implementation: torch.compile (fullgraph) traces it, same numbers."""
    raw, qt, kt, I, G = chunk_inputs(c=8, s=20)
    c, s = raw.shape[2:]

    def step(scores):
        scores = scores.clone()
        torch.ops.dcformer.compose_softmax_compose_(scores, qt, 0, kt, 0, None, s - c, 0, 0, 0.125, I, G, 4, False)
        return scores * 2

    torch._dynamo.reset()
    try:
        compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
        assert torch.equal(compiled(raw), step(raw))
    finally:
        torch._dynamo.reset()


def test_without_a_compiler_auto_does_without_and_kernel_says_why(monkeypatch, tmp_path):
    """A machine without a C++ compiler: "auto" gives eager's numbers, "kernel" says why; the failure is kept on the
    backend object."""
    monkeypatch.setenv("DCFORMER_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_kernel, "compiler", lambda: None)
    lazy = DCMHA_BACKENDS["kernel"]
    monkeypatch.setattr(lazy, "_backend", cpu_kernel.CPUKernelBackend())
    model = build_model(make_config(num_hidden_layers=1, dcmha_implementation="eager"))
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits
        model.config.dcmha_implementation = "auto"
        assert_close(model(ids).logits, expected)
        assert "no C++ compiler" in lazy.backend.failure
        model.config.dcmha_implementation = "kernel"
        with pytest.raises(ValueError, match="no C\\+\\+ compiler"):
            model(ids)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_build_leaves_no_library(monkeypatch, tmp_path):
    source = tmp_path / "broken.cpp"
    source.write_text("this is not C++;\n")
    monkeypatch.setenv("DCFORMER_CACHE", str(tmp_path / "cache"))
    backend = cpu_kernel.CPUKernelBackend(source)
    with pytest.raises(RuntimeError, match="cannot be built"):
        backend.load()
    # nothing but the entry's (empty) lock file: no library, no private build folder
    assert [p for p in (tmp_path / "cache").rglob("*") if p.suffix != ".lock"] == []
    with pytest.raises(RuntimeError, match="cannot be built"):  # remembered: no second build
        backend.load()
