"""What is specific to the "cpu" DCMHA backend (`modeling_dcformer/kernels/dcmha_cpu.py` and `csrc/dcmha_cpu.cpp`, the
operator `torch.ops.dcformer.compose_softmax_compose_`); the checks shared by every backend (models against the
oracle, decoding, half precision, probabilities) are in test_dcmha_backends.py.

- one chunk of the operator against Compose -> mask -> softmax -> Compose written from the spec in float64
  (`oracle_compose`): ranks 1..5, groups, key-wise or query-wise, windows, padding (rows that see no key), key
  offsets, rows that are not a multiple of the vector width, several blocks and tiles, several threads;
- the operator on scores in other layouts (the model's, `score_layout`, where it composes in place; padded rows; a
  slice of heads): the contiguous chunk's numbers bit for bit, nothing outside the chunk written; overlapping
  layouts refused;
- the backward operator (`compose_softmax_compose_backward_`) on one chunk against autograd through the same float64
  Compose (the products' and every factor's gradient, the same cases), half precision and threads in training;
- grouped-query attention (fewer key/value heads than query heads): the output and every gradient through the
  autograd Function, the chunked inference path and the decode operator against the oracle and against the same
  call with the keys and values copied per query head by hand; no path makes such a copy itself (every op's outputs
  recorded); a number of key/value heads that does not divide the query heads is a clear reason;
- where it applies: "auto" uses it for inference and training on CPU; "cpu" elsewhere is a clear error;
- the operator under torch.compile (its fake implementation) and its own argument checks;
- building: verified cached builds (a corrupt one is rebuilt), what a machine without a compiler gets.
"""

import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from helpers import (
    OutputShapes,
    VOCAB,
    assert_close,
    assert_close_to_scale,
    build_model,
    kv_copies,
    make_config,
    registered,
)
from modeling_dcformer import dcmha
from modeling_dcformer.kernels import build, dcmha_cpu
from modeling_dcformer.dcmha import DCMHA_BACKENDS, DCMHAInputs
from oracle import expand_kv, oracle_attention, oracle_compose, oracle_dynamic_weights

pytestmark = pytest.mark.usefixtures("one_thread_each_test")


@pytest.fixture(scope="module", autouse=True)
def _kernel_built():
    if not dcmha_cpu.ensure_built():
        pytest.skip(f"the CPU kernel cannot be built here: {dcmha_cpu.CPU.failure}")


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
    # masked keys get the lowest float64 (a row that sees no key: uniform, then 0 below; finite, so the gradient too)
    probs = torch.softmax(pre.masked_fill(~mask, torch.finfo(torch.float64).min), dim=-1)
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
    "heads8": (1, 2, 8, 2, 5, 24, True, 7, True, 1, 2),  # the code compiled for 8 heads a group
    # 12 and 16 heads (code of their own); keys over several blocks of both passes, a tail that is not a multiple
    # of the vector width
    "heads12-blocks": (1, 1, 12, 2, 9, 150, True, None, True, 0, 0),
    "heads16-querywise": (1, 1, 16, 2, 4, 70, False, 30, False, 0, 3),
    # whole 16-key vectors in every block: in `score_layout`'s layout the operator composes the scores in place
    "heads12-whole-blocks": (1, 1, 12, 2, 9, 256, True, None, True, 0, 0),
    "groups2-whole-blocks": (2, 2, 4, 2, 6, 64, True, 20, True, 1, 0),
}


def chunk_case(case: str, seed: int) -> dict:
    """One chunk of CASES[case]: raw products, factors covering more queries and keys than the chunk, padding, the
    chunk's absolute positions and what each query sees."""
    B, G, M, I, c, s, key_wise, window, padding, t0, s0 = CASES[case]
    N, T, S = G * M, t0 + c + 2, s0 + s + 3  # the factors cover more queries / keys than the chunk
    gen = torch.Generator().manual_seed(seed)
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
    return dict(raw=raw, qt=qt, kt=kt, pad=pad, qpos0=qpos0, kpos0=kpos0, allowed=allowed, window=window, I=I, G=G,
                t0=t0, s0=s0, c=c, s=s)


def time_last(terms):
    return None if terms is None else terms.permute(0, 2, 3, 4, 5, 1).contiguous()


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_chunk_matches_oracle(case, rows, monkeypatch):
    monkeypatch.setattr(dcmha_cpu, "rows_per_tile", lambda heads, keys: rows)
    x = chunk_case(case, len(case) * 10 + rows)
    raw, qt, kt, pad, qpos0, kpos0, allowed, window, I, G = (x[k] for k in "raw qt kt pad qpos0 kpos0 allowed window I G".split())
    t0, s0, c, s = x["t0"], x["s0"], x["c"], x["s"]
    scores = raw.clone()
    out = dcmha_cpu.compose_softmax_compose(
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


def cpu_has_avx512() -> bool:
    return " avx512f" in build.cpu_signature()  # the CPU's flags, as the kernel's build key reads them


def test_the_kernel_is_built_for_this_cpus_vector_width():
    """16-float vectors where the CPU has AVX-512, else 8 (or what DCFORMER_TEST_KERNEL_CFLAGS chose: conftest.py)."""
    forced_8 = "-mno-avx512f" in os.environ.get("DCFORMER_TEST_KERNEL_CFLAGS", "")
    assert dcmha_cpu.vector_width() == (16 if cpu_has_avx512() and not forced_8 else 8)


def test_the_models_score_layout_is_the_one_the_operator_composes_in_place():
    """HEAD_STAGGER (Python's score layout) and STRIDE (the C++ operator's block stride) are one number kept in two
    languages: where they differ the operator still computes the right scores, on copies (slower), so only this
    test would notice. The layout's head stride is STRIDE modulo 4 KiB at several chunk shapes."""
    stride = dcmha_cpu.block_stride()
    assert stride == dcmha_cpu.HEAD_STAGGER, (stride, dcmha_cpu.HEAD_STAGGER)
    for c, s in [(64, 1024), (64, 64), (5, 7), (128, 2048)]:
        _, strides = dcmha_cpu.score_layout(2, 12, c, s)
        assert strides[1] % 1024 == stride and strides[1] >= c * s, (c, s, strides)


@pytest.mark.skipif(not cpu_has_avx512(), reason="without AVX-512 the 8-wide build is the native one: every test runs it")
@pytest.mark.skipif("DCFORMER_TEST_KERNEL_CFLAGS" in os.environ, reason="this test is the one that sets the flags")
def test_the_8_wide_build_matches_the_oracle_too():
    """On an AVX-512 CPU the other tests run the 16-wide build; AVX2 CPUs get the 8-wide one. It is built here with
    -mno-avx512f and the oracle tests run against it in a fresh process (the library registers the same operators)."""
    env = {**os.environ, "DCFORMER_TEST_KERNEL_CFLAGS": "-mno-avx512f"}
    selected = "matches_oracle or in_other_layouts or vector_width"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", selected],
        env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    passed = re.search(r"(\d+) passed", result.stdout)
    summary = result.stdout.splitlines()[-1]
    assert passed and int(passed.group(1)) >= 70 and "skipped" not in summary, result.stdout[-2000:]


def laid_out(raw: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`raw` [B, N, c, s] copied into a tensor laid out as `layout` says, and the storage around it: "staggered"
    (`score_layout`, as the model's chunks), "padded" (rows of more floats than keys, heads and batches apart by
    more than they hold: a slice of a bigger tensor) or "heads-sliced" (the last N of N + 1 heads of a contiguous
    tensor)."""
    B, N, c, s = raw.shape
    if layout == "staggered":
        size, strides = dcmha_cpu.score_layout(B, N, c, s)
    elif layout == "padded":
        row, head = s + 5, (s + 5) * c + 3
        size, strides = B * (N * head + 7), (N * head + 7, head, row, 1)
    else:
        size, strides = B * (N + 1) * c * s, ((N + 1) * c * s, c * s, s, 1)
    storage = torch.full((size,), 12345.0)
    view = storage.as_strided(raw.shape, strides, c * s if layout == "heads-sliced" else 0)
    view.copy_(raw)
    return view, storage


@pytest.mark.parametrize("layout", ["staggered", "padded", "heads-sliced"])
@pytest.mark.parametrize("case", ["rank2", "blocks-tail", "heads12-blocks", "heads12-whole-blocks",
                                  "groups2-whole-blocks", "querywise"])
def test_kernel_chunk_in_other_layouts(case, layout):
    """The operator takes scores in any layout of non-overlapping rows of contiguous keys; in the model's (staggered)
    it composes whole blocks where they are instead of on copies. Same numbers as the contiguous chunk (the same
    arithmetic, bit for bit), the oracle's, and nothing outside the chunk's keys written."""
    x = chunk_case(case, 7)
    raw, qt, kt, pad, qpos0, kpos0, allowed, window, I, G = (x[k] for k in "raw qt kt pad qpos0 kpos0 allowed window I G".split())
    args = (time_last(qt), x["t0"], time_last(kt), x["s0"], pad, qpos0, kpos0, window, 0.3, I, G)
    contiguous = dcmha_cpu.compose_softmax_compose(raw.clone(), *args)
    scores, storage = laid_out(raw, layout)
    untouched = storage.clone()
    out = dcmha_cpu.compose_softmax_compose(scores, *args)
    assert out.data_ptr() == scores.data_ptr() and out.stride() == scores.stride()
    assert torch.equal(scores, contiguous)
    ref = oracle_chunk(raw, qt[:, x["t0"] : x["t0"] + x["c"]], None if kt is None else kt[:, x["s0"] : x["s0"] + x["s"]],
                       allowed, 0.3, I)  # fmt: skip
    torch.testing.assert_close(scores.double(), ref, atol=1e-5, rtol=1e-5)
    outside = torch.ones_like(storage, dtype=torch.bool)
    outside.as_strided(scores.shape, scores.stride(), scores.storage_offset()).fill_(False)
    assert torch.equal(storage[outside], untouched[outside])  # the padding between rows and heads is not written


def test_kernel_refuses_scores_whose_rows_overlap():
    """The loops write each row in place: a layout whose rows, heads or batches overlap is an error that says so,
    and the legitimate neighbours (contiguous, staggered, padded rows) run."""
    B, G, M, I, c, s = 2, 1, 2, 1, 3, 16
    qt = torch.zeros(B, G, 2, 2 * I + 1, M, c)
    storage = torch.zeros(5000)
    run = lambda scores: dcmha_cpu.compose_softmax_compose(scores, qt, 0, None, 0, None, 0, 0, None, 1.0, I, G)  # noqa: E731
    for strides in [(96, 48, 8, 1), (96, 40, 16, 1), (80, 48, 16, 1), (96, 48, 16, 2)]:
        with pytest.raises(ValueError, match="laid out|contiguous"):  # rows, heads, batches overlap; keys strided
            run(storage.as_strided((B, G * M, c, s), strides))
    for strides in [(96, 48, 16, 1), (200, 60, 20, 1), dcmha_cpu.score_layout(B, G * M, c, s)[1]]:
        run(storage.as_strided((B, G * M, c, s), strides))
    with pytest.raises(ValueError, match="float32"):
        run(torch.zeros(B, G * M, c, s, dtype=torch.float64))


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_gradient_matches_oracle(case):
    """The backward operator: given the probabilities' gradient, the gradient of the raw products and of every factor
    of both slots (the chunk's queries' rows and keys' columns; nothing elsewhere) against autograd through the
    float64 oracle, and the probabilities it leaves in `raw`."""
    x = chunk_case(case, len(case))
    raw, qt, kt, pad, allowed, I, G = (x[k] for k in "raw qt kt pad allowed I G".split())
    t0, s0, c, s = x["t0"], x["s0"], x["c"], x["s"]
    grad = torch.randn(raw.shape, generator=torch.Generator().manual_seed(7))
    raw64 = raw.double().requires_grad_()
    q64 = qt[:, t0 : t0 + c].double().requires_grad_()
    k64 = None if kt is None else kt[:, s0 : s0 + s].double().requires_grad_()
    ref = oracle_chunk(raw64, q64, k64, allowed, 0.3, I)
    (ref * grad.double()).sum().backward()
    scores, dscores = raw.clone(), grad.clone()
    dqt = torch.zeros_like(time_last(qt))
    dkt = None if kt is None else torch.zeros_like(time_last(kt))
    out = dcmha_cpu.compose_softmax_compose_backward(
        scores, dscores, time_last(qt), t0, time_last(kt), s0, pad, x["qpos0"], x["kpos0"], x["window"], 0.3, I, G,
        dqt, dkt,
    )  # fmt: skip
    assert out.data_ptr() == dscores.data_ptr()  # in place
    torch.testing.assert_close(scores.double(), ref.detach(), atol=1e-5, rtol=1e-5)  # the probabilities
    torch.testing.assert_close(dscores.double(), raw64.grad, atol=1e-4, rtol=1e-4)
    dq = dqt.permute(0, 5, 1, 2, 3, 4)  # back to [B, T, G, 2, 2I+1, M]
    torch.testing.assert_close(dq[:, t0 : t0 + c].double(), q64.grad, atol=1e-4, rtol=1e-4)
    assert (dq[:, :t0] == 0).all() and (dq[:, t0 + c :] == 0).all()
    if kt is not None:
        dk = dkt.permute(0, 5, 1, 2, 3, 4)
        torch.testing.assert_close(dk[:, s0 : s0 + s].double(), k64.grad, atol=1e-4, rtol=1e-4)
        assert (dk[:, :s0] == 0).all() and (dk[:, s0 + s :] == 0).all()
    assert q64.grad.abs().max() > 1e-2  # the test can fail (in rank1-groups2 no row sees two keys: raw's is 0)


def test_kernel_training_in_half_precision_and_on_threads(monkeypatch):
    """Through the autograd Function: bf16 inputs get bf16 gradients, within bf16's rounding of eager's; in fp32 the
    backward operator on two threads gives the numbers of one."""
    B, N, T, Dh, G, I = 2, 4, 12, 8, 2, 2
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, N, T, Dh, generator=gen) for _ in range(3))
    qt = torch.randn(B, T, G, 2, 2 * I + 1, N // G, generator=gen) * 0.5
    kt = torch.randn(B, T, G, 2, 2 * I + 1, N // G, generator=gen) * 0.5
    pad = torch.ones(B, T, dtype=torch.bool)
    pad[1, :3] = False

    def grads(implementation, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v, qt, kt)]
        inputs = DCMHAInputs(*leaves, 0, 0, pad, None, I, G, 5)
        out, _ = dcmha.dcmha_attention(inputs, implementation)
        out.float().square().sum().backward()
        return [t.grad for t in leaves]

    for ours, eager in zip(grads("cpu", torch.bfloat16), grads("eager", torch.bfloat16)):
        assert ours.dtype == torch.bfloat16
        scale = eager.float().abs().max().item()
        torch.testing.assert_close(ours.float(), eager.float(), rtol=3e-2, atol=3e-2 * scale)
    one = grads("cpu", torch.float32)
    monkeypatch.setattr(dcmha_cpu, "PARALLEL_MIN_SCORES", 0)
    monkeypatch.setattr(dcmha_cpu, "_parallel_pid", None)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two = grads("cpu", torch.float32)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, two):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def chunk_inputs(B=2, G=2, M=4, I=2, c=32, s=200, seed=5):
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randn(B, G * M, c, s, generator=gen)
    qt = torch.randn(B, G, 2, 2 * I + 1, M, c, generator=gen) * 0.5
    kt = torch.randn(B, G, 2, 2 * I + 1, M, s, generator=gen) * 0.5
    return raw, qt, kt, I, G


def test_kernel_threads_give_the_same_numbers(monkeypatch):
    """Tiles spread over PyTorch's intra-op threads: each tile is computed alone, so the numbers do not depend on
    them."""
    monkeypatch.setattr(dcmha_cpu, "PARALLEL_MIN_SCORES", 0)  # this small chunk too
    monkeypatch.setattr(dcmha_cpu, "_parallel_pid", None)
    raw, qt, kt, I, G = chunk_inputs()
    c, s = raw.shape[2:]
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        assert dcmha_cpu.runs_parallel(raw.numel()) == (threads > 1)
        scores = raw.clone()
        dcmha_cpu.compose_softmax_compose(scores, qt, 0, kt, 0, None, s - c, 0, None, 0.125, I, G)
        results.append(scores)
    assert torch.equal(results[0], results[1])


def test_a_forked_child_runs_the_kernel_on_its_own_thread(monkeypatch):
    """After the kernel ran in parallel, a forked child (whose parent's OpenMP threads do not exist there) runs it
    on the calling thread, and finishes."""
    monkeypatch.setattr(dcmha_cpu, "PARALLEL_MIN_SCORES", 0)
    monkeypatch.setattr(dcmha_cpu, "_parallel_pid", None)
    torch.set_num_threads(2)
    raw, qt, kt, I, G = chunk_inputs()
    c, s = raw.shape[2:]
    scores, again = raw.clone(), raw.clone()
    dcmha_cpu.compose_softmax_compose(scores, qt, 0, kt, 0, None, s - c, 0, None, 0.125, I, G)
    assert dcmha_cpu._parallel_pid == os.getpid()
    pid = os.fork()
    if pid == 0:  # the child: no new tensor (PyTorch's own parallel copies would hang here), only the kernel
        signal.alarm(30)
        try:
            assert not dcmha_cpu.runs_parallel(raw.numel())
            dcmha_cpu.compose_softmax_compose(again, qt, 0, kt, 0, None, s - c, 0, None, 0.125, I, G)
            same = again.view(-1)[:2000].tolist() == scores.view(-1)[:2000].tolist()  # serial, unlike torch.equal
            os._exit(0 if same else 3)
        except BaseException:
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status}"


def count_operator_calls(monkeypatch, *names: str) -> dict:
    """Counts the calls of the `dcmha_cpu` functions `names` (a dict, updated as they run)."""
    calls = dict.fromkeys(names, 0)
    for name in names:
        real = getattr(dcmha_cpu, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(dcmha_cpu, name, counted)
    return calls


def test_auto_uses_the_kernel_for_inference_and_training(monkeypatch):
    calls = count_operator_calls(monkeypatch, "compose_softmax_compose", "compose_softmax_compose_backward")
    model = build_model(make_config(num_hidden_layers=2, dcmha_implementation="auto"))
    # more queries than the decode operator takes: the chunked path
    ids = torch.randint(0, VOCAB, (1, dcmha_cpu.DECODE_MAX_QUERIES + 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        inference = model(ids).logits
    assert calls == {"compose_softmax_compose": 2, "compose_softmax_compose_backward": 0}  # one chunk per layer
    calls.update(dict.fromkeys(calls, 0))
    training = model(ids).logits  # gradients wanted: the kernel's autograd Function
    assert calls == {"compose_softmax_compose": 2, "compose_softmax_compose_backward": 0}
    # inference's projection is the kernel's operator (its own summation order and erf): not bit for bit
    assert_close(inference, training.detach(), atol=1e-4, rtol=1e-4)
    training.sum().backward()
    assert calls["compose_softmax_compose_backward"] == 2  # and the forward pass recomputed per chunk
    model.config.dcmha_implementation = "eager"
    model.zero_grad()
    model(ids).logits.sum().backward()
    eager = {n: p.grad for n, p in model.named_parameters()}
    model.config.dcmha_implementation = "auto"
    model.zero_grad()
    model(ids).logits.sum().backward()
    for name, param in model.named_parameters():  # 21 positions summed: gradients of order 10-100
        assert_close_to_scale(param.grad, eager[name])


def test_chunk_spans_take_a_cap_on_queries():
    """DCMHAInputs.chunk_spans(max_queries): chunks of min(queries_per_chunk, max_queries) queries, each with the
    keys its last query sees (causal) or the window's; no cap, or a larger one, leaves the config's chunks."""
    q = torch.zeros(1, 2, 10, 4)
    terms = torch.zeros(1, 10, 1, 2, 5, 2)

    def spans(chunk, window=None, cap=None):
        return DCMHAInputs(q, q, q, terms, terms, 0, 0, None, window, 2, 1, chunk).chunk_spans(cap)

    assert spans(8) == [(0, 8, 0, 8), (8, 10, 0, 10)]
    assert spans(8, cap=16) == spans(8)
    assert spans(8, cap=4) == [(0, 4, 0, 4), (4, 8, 0, 8), (8, 10, 0, 10)]
    assert spans(8, window=128, cap=4) == spans(4, window=128)  # local layers: min(chunk, max(64, window // 2))
    assert spans(8, window=3, cap=4) == [(0, 4, 0, 4), (4, 8, 2, 8), (8, 10, 6, 10)]


@pytest.mark.parametrize("chunk", [128, 32])
def test_kernel_chunks_hold_at_most_its_cap_of_queries(chunk, monkeypatch):
    """The kernel attends CHUNK_QUERIES queries at a time where attention_chunk_size allows more (less masked
    work per causal chunk), and the config's chunk where it is smaller; forward and gradients equal eager's (which
    keeps the config's chunks)."""
    cap = dcmha_cpu.CHUNK_QUERIES
    assert cap < 128
    calls = count_operator_calls(monkeypatch, "compose_softmax_compose", "compose_softmax_compose_backward")
    config = make_config(num_hidden_layers=2, attention_chunk_size=chunk, max_position_embeddings=256)
    model = build_model(config)
    ids = torch.randint(0, VOCAB, (2, 2 * cap + 3), generator=torch.Generator().manual_seed(5))
    per_layer = -(-ids.shape[1] // min(chunk, cap))
    model.config.dcmha_implementation = "cpu"
    kernel_logits = model(ids).logits
    kernel_logits.sum().backward()
    assert calls == {"compose_softmax_compose": 2 * per_layer, "compose_softmax_compose_backward": 2 * per_layer}
    kernel = {n: p.grad for n, p in model.named_parameters()}
    model.config.dcmha_implementation = "eager"
    model.zero_grad()
    eager_logits = model(ids).logits
    eager_logits.sum().backward()
    assert_close(kernel_logits.detach(), eager_logits.detach(), atol=1e-4, rtol=1e-4)
    for name, param in model.named_parameters():
        assert_close_to_scale(param.grad, kernel[name])


def probe(requires_grad=False, device="cpu", rank=2):
    q = torch.zeros(1, 4, 5, 8, device=device, requires_grad=requires_grad)
    terms = torch.zeros(1, 5, 1, 2, 2 * rank + 1, 4, device=device)
    return DCMHAInputs(q, q, q, terms, terms, 0, 0, None, None, rank, 1, 4)


def test_kernel_is_a_clear_error_where_it_cannot_run():
    kernel = DCMHA_BACKENDS["cpu"]
    assert "output_attentions" in kernel.why_not(probe(requires_grad=True), output_attentions=True)
    assert kernel.why_not(probe(requires_grad=True)) is None
    many = DCMHAInputs(*(torch.zeros(1, 258, 2, 4, requires_grad=True) for _ in range(3)),
                       torch.zeros(1, 2, 1, 2, 5, 258), None, 0, 0, None, None, 2, 1, 4)  # fmt: skip
    assert "heads a group" in kernel.why_not(many)
    with torch.no_grad():
        assert kernel.why_not(many) is None  # inference has no such limit
    assert "runs on CPU" in kernel.why_not(probe(device="meta"))
    assert "rank" in kernel.why_not(probe(rank=dcmha_cpu.MAX_RANK + 1))
    assert kernel.why_not(probe()) is None
    with pytest.raises(ValueError, match="float32 CPU scores"):
        dcmha_cpu.compose_softmax_compose(
            torch.zeros(1, 2, 3, 4, dtype=torch.float64), torch.zeros(1, 1, 2, 5, 2, 3), 0, None, 0, None, 0, 0,
            None, 1.0, 2, 1,
        )  # fmt: skip
    with pytest.raises(ValueError, match="do not match"):
        dcmha_cpu.compose_softmax_compose(
            torch.zeros(1, 2, 3, 4), torch.zeros(1, 1, 2, 5, 3, 3), 0, None, 0, None, 0, 0, None, 1.0, 2, 1
        )
    raw, qt = torch.zeros(1, 2, 3, 4), torch.zeros(1, 1, 2, 5, 2, 3)

    def backward(grad, query_terms_grad):
        return dcmha_cpu.compose_softmax_compose_backward(
            raw.clone(), grad, qt, 0, None, 0, None, 0, 0, None, 1.0, 2, 1, query_terms_grad, None
        )

    with pytest.raises(ValueError, match="grad is not"):
        backward(raw.double(), torch.zeros_like(qt))
    with pytest.raises(ValueError, match="query_terms_grad must match"):
        backward(raw.clone(), torch.zeros(1, 1, 2, 5, 2, 4))
    backward(raw.clone(), torch.zeros_like(qt))  # the same call, well formed


def test_auto_keeps_the_gradient_of_any_input():
    """Only the values need a gradient (say, a frozen model with an adapter on them): "auto" takes the kernel's
    autograd Function, and the gradient is the eager one."""
    B, N, T, Dh, G, I = 1, 4, 6, 8, 2, 2
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(B, N, T, Dh, generator=gen) for _ in range(3))
    qt = torch.randn(B, T, G, 2, 2 * I + 1, N // G, generator=gen) * 0.5
    kt = torch.randn(B, T, G, 2, 2 * I + 1, N // G, generator=gen) * 0.5
    grads = {}
    for implementation in ("auto", "eager"):
        value = v.clone().requires_grad_()
        inputs = DCMHAInputs(q, k, value, qt, kt, 0, 0, None, None, I, G, 4)
        assert dcmha.choose_auto(inputs).name == "cpu"
        out, _ = dcmha.dcmha_attention(inputs, implementation)
        out.sum().backward()
        grads[implementation] = value.grad
    assert_close(grads["auto"], grads["eager"])
    assert grads["auto"].abs().max() > 1e-3


def test_kernel_refuses_bounds_it_would_read_past():
    """The C++ loops trust their offsets: the operator checks them (a mistake is an error, not a stray read)."""
    B, G, M, I, c, s = 1, 1, 2, 1, 3, 5
    scores = torch.zeros(B, G * M, c, s)
    qt, kt = torch.zeros(B, G, 2, 2 * I + 1, M, 4), torch.zeros(B, G, 2, 2 * I + 1, M, 6)
    run = lambda *a: dcmha_cpu.compose_softmax_compose(scores, *a, 0, 0, None, 1.0, I, G)  # noqa: E731
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
    """A machine without a C++ compiler (none on the PATH, no $CXX): "auto" gives eager's numbers, "cpu" says why,
    and nothing is written to the cache."""
    monkeypatch.setenv("DCFORMER_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CXX", raising=False)
    model = build_model(make_config(num_hidden_layers=1, dcmha_implementation="eager"))
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), registered("cpu", dcmha_cpu.CPUBackend()) as unbuilt:
        expected = model(ids).logits
        model.config.dcmha_implementation = "auto"
        assert_close(model(ids).logits, expected)
        assert "no C++ compiler" in unbuilt.why_not(probe())
        model.config.dcmha_implementation = "cpu"
        with pytest.raises(ValueError, match="no C\\+\\+ compiler"):
            model(ids)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_build_leaves_no_library(monkeypatch, tmp_path):
    source = tmp_path / "broken.cpp"
    source.write_text("this is not C++;\n")
    monkeypatch.setenv("DCFORMER_CACHE", str(tmp_path / "cache"))
    library = build.OperatorLibrary(source)
    with pytest.raises(RuntimeError, match="cannot be built"):
        library.load()
    # nothing but the entry's (empty) lock file: no library, no private build folder
    assert [p for p in (tmp_path / "cache").rglob("*") if p.suffix != ".lock"] == []
    with pytest.raises(RuntimeError, match="cannot be built"):  # remembered: no second build
        library.load()


# ----------------------------------------------------------------------------------------------------------------
# The inference operators: a few queries' whole attention (`decode_attention`) and the dynamic-weight projection
# (`dynamic_terms`), each in one call
# ----------------------------------------------------------------------------------------------------------------
DECODE_CASES = {
    # name: (B, G, M, rank, T, S, key_wise, window, padding, Dh)
    "decode-step": (1, 1, 8, 2, 1, 70, True, None, False, 16),
    "groups-padding": (2, 2, 4, 2, 3, 40, True, None, True, 20),  # Dh not a multiple of the 8 lanes
    "querywise": (2, 2, 3, 1, 2, 33, False, None, True, 8),
    "window": (2, 3, 2, 3, 5, 33, True, 7, True, 16),
    "drafts-blocks": (1, 1, 4, 2, 16, 300, True, None, False, 8),  # keys over three of the tile's blocks
}


def decode_case(case: str, seed: int, kv_heads: int | None = None) -> DCMHAInputs:
    """The inputs of one call as the model makes them at a decode step: the queries' factors a strided slice of
    the projection's packed slots, the keys, values and keys' factors views into longer (cache) tensors; the keys
    and values with `kv_heads` heads (None: one a query head)."""
    B, G, M, I, T, S, key_wise, window, padding, Dh = DECODE_CASES[case]
    N, W = G * M, 2 * I + 1
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, N, T, Dh, generator=gen)
    k, v = (torch.randn(B, kv_heads or N, S + 4, Dh, generator=gen)[:, :, 4:] for _ in range(2))  # strided views
    terms = torch.randn(B, T, G, 4 if key_wise else 2, W, M, generator=gen) * 0.5
    qt = terms[:, :, :, 0::2] if key_wise else terms
    kt = torch.randn(B, S + 2, G, 4, W, M, generator=gen)[:, 2:, :, 1::2] * 0.5 if key_wise else None
    pad = None
    if padding:
        pad = torch.rand(B, S, generator=gen) > 0.3
        pad[0, : S - T + 1] = False  # batch 0: its first query sees no real key
    key_start = 11
    return DCMHAInputs(q, k, v, qt, kt, key_start + S - T, key_start, pad, window, I, G, 256)  # last key: last query


def decode_oracle(inputs: DCMHAInputs, composed: bool = True) -> torch.Tensor:
    """The call's output [B, T, N, Dh] from the spec in float64 (`composed=False`: all factors 0, plain attention)."""
    qt, kt = (None if t is None else t.double() * composed for t in (inputs.query_terms, inputs.key_terms))
    q, k, v = (x.double() for x in (inputs.query, inputs.key, inputs.value))
    return oracle_attention(q, k, v, qt, kt, inputs.key_padding_mask, inputs.query_start, inputs.key_start,
                            inputs.window_size, inputs.rank)


@pytest.mark.parametrize("kv_heads", [None, 2, 1], ids=["mha", "kv2", "kv1"])
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_operator_matches_oracle(case, kv_heads):
    """Every case with one key/value head a query head, and grouped (2 key/value heads, 1): the operator reads
    query head n's keys and values at head n // (N / Nkv) of the cache's tensors, the oracle's numbers, and bit for
    bit the numbers of the same call with the keys and values copied per query head."""
    inputs = decode_case(case, seed=len(case), kv_heads=kv_heads)
    assert dcmha_cpu.is_decode_call(inputs)
    with torch.no_grad():
        out = dcmha_cpu.decode_attention(inputs)  # [B, T, N, Dh]
    ref = decode_oracle(inputs)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert (decode_oracle(inputs, composed=False) - ref).abs().max() > 1e-2  # the test can fail
    if kv_heads is not None:
        N = inputs.query.shape[1]
        expanded = with_kv(inputs, expand_kv(inputs.key, N), expand_kv(inputs.value, N))
        with torch.no_grad():
            assert torch.equal(dcmha_cpu.decode_attention(expanded), out)


def test_decode_operator_is_taken_only_where_it_applies():
    """A few fp32 queries without gradient or probabilities go to the decode operator; more queries, half
    precision, a gradient or output_attentions take the chunked path, with the same numbers."""
    inputs = decode_case("groups-padding", seed=3)
    kernel = DCMHA_BACKENDS["cpu"]
    with torch.no_grad():
        fused, _ = kernel(inputs)
        chunked, probs = kernel(inputs, output_attentions=True)
    assert dcmha_cpu.is_decode_call(inputs) and not dcmha_cpu.is_decode_call(inputs, output_attentions=True)
    assert probs is not None
    assert_close(fused, chunked)
    assert inputs.shapes[2] <= dcmha_cpu.DECODE_MAX_QUERIES
    longer = DCMHAInputs(*(torch.zeros(1, 4, dcmha_cpu.DECODE_MAX_QUERIES + 1, 8) for _ in range(3)),
                         torch.zeros(1, dcmha_cpu.DECODE_MAX_QUERIES + 1, 1, 2, 5, 4), None, 0, 0, None, None, 2, 1,
                         256)  # fmt: skip
    assert not dcmha_cpu.is_decode_call(longer)
    half = DCMHAInputs(inputs.query.bfloat16(), inputs.key.bfloat16(), inputs.value.bfloat16(), inputs.query_terms,
                       inputs.key_terms, inputs.query_start, inputs.key_start, inputs.key_padding_mask,
                       inputs.window_size, inputs.rank, inputs.num_groups, 256)  # fmt: skip
    assert not dcmha_cpu.is_decode_call(half)
    with torch.no_grad():
        assert_close(kernel(half)[0], fused, atol=0.05, rtol=0.05)  # the chunked path in bf16
    grad = DCMHAInputs(inputs.query.clone().requires_grad_(), inputs.key, inputs.value, inputs.query_terms,
                       inputs.key_terms, inputs.query_start, inputs.key_start, inputs.key_padding_mask,
                       inputs.window_size, inputs.rank, inputs.num_groups, 256)  # fmt: skip
    assert not dcmha_cpu.is_decode_call(grad)
    trained = kernel(grad)[0]
    assert trained.requires_grad
    assert_close(trained.detach(), fused)


def test_decode_operator_refuses_operands_that_do_not_match():
    inputs = decode_case("groups-padding", seed=4)
    q, k, v, qt, kt = inputs.query, inputs.key, inputs.value, inputs.query_terms, inputs.key_terms
    pad = inputs.key_padding_mask.to(torch.uint8).contiguous()

    def run(q=q, k=k, v=v, qt=qt, kt=kt, pad=pad, rank=inputs.rank, groups=inputs.num_groups):
        with dcmha_cpu.operator_errors():
            return torch.ops.dcformer.dcmha_decode(q, k, v, qt, kt, pad, inputs.query_start, inputs.key_start, 0,
                                                   0.1, rank, groups, False)

    run()  # well formed
    with pytest.raises(ValueError, match="do not match"):
        run(v=v[:, :, 1:])
    with pytest.raises(ValueError, match="query_terms"):
        run(qt=qt[:, :, :, :, :3])
    with pytest.raises(ValueError, match="key_terms"):
        run(kt=kt[:, 1:])
    with pytest.raises(ValueError, match="key_padding_mask"):
        run(pad=pad[:, 1:].contiguous())
    with pytest.raises(ValueError, match="float32"):
        run(q=q.double())
    with pytest.raises(ValueError, match="last contiguous"):
        run(k=k.transpose(2, 3).contiguous().transpose(2, 3))
    with pytest.raises(ValueError, match="dynamic_rank"):
        run(rank=dcmha_cpu.MAX_RANK + 1)


# R <= 4 rows: the operator's own products (a decode step); more: ATen's
@pytest.mark.parametrize("G,C,K,I,M,R", [(1, 4, 32, 2, 8, 1), (2, 4, 6, 1, 3, 4), (2, 4, 6, 1, 3, 5),
                                         (3, 2, 9, 3, 2, 40)])
def test_dynamic_terms_operator_matches_oracle(G, C, K, I, M, R):
    D = 24
    gen = torch.Generator().manual_seed(G * 100 + R)
    x = torch.randn(R, D, generator=gen)
    dw1 = torch.randn(D, G, C, K, generator=gen) / D**0.5
    qkw = torch.randn(G, C, K, 2 * I, M, generator=gen) / K**0.5
    dd = torch.randn(D, G, C * M, generator=gen) / D**0.5
    out = dcmha_cpu.dynamic_terms(x, dw1.view(D, -1), dd.view(D, -1), qkw, I, 1e-6)
    assert out.shape == (R, G, C, 2 * I + 1, M)
    slots = oracle_dynamic_weights(x.double()[None], dw1.double(), qkw.double(), dd.double(), I)
    for c, (w1, w2, diag) in enumerate(slots):
        torch.testing.assert_close(out[:, :, c, :I].double(), w1[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[:, :, c, I : 2 * I].double(), w2[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[:, :, c, 2 * I].double(), diag[0], atol=1e-5, rtol=1e-5)
    rows = torch.randn(R, 2 * D, generator=gen)[:, 3 : 3 + D]  # the same rows, not contiguous with each other
    rows.copy_(x)
    torch.testing.assert_close(dcmha_cpu.dynamic_terms(rows, dw1.view(D, -1), dd.view(D, -1), qkw, I, 1e-6), out)
    # the parameters as the model holds them (dw1 [D, G, C, K], dd [D, G, C*M]) and x [batch, time, D]: viewed 2-D by
    # the operator, the same factors
    assert torch.equal(dcmha_cpu.dynamic_terms(x.view(1, R, D), dw1, dd, qkw, I, 1e-6), out)
    with pytest.raises(ValueError, match=r"dw1 \[D, \.\.\.\]"):
        dcmha_cpu.dynamic_terms(x, dw1.reshape(-1), dd, qkw, I, 1e-6)
    with pytest.raises(ValueError, match="do not match"):
        dcmha_cpu.dynamic_terms(x, dw1.view(D, -1)[:, 1:], dd.view(D, -1), qkw, I, 1e-6)
    with pytest.raises(ValueError, match="2 \\* rank"):
        dcmha_cpu.dynamic_terms(x, dw1.view(D, -1), dd.view(D, -1), qkw, I + 1, 1e-6)
    with pytest.raises(ValueError, match="float32"):
        dcmha_cpu.dynamic_terms(x.double(), dw1.view(D, -1), dd.view(D, -1), qkw, I, 1e-6)


def test_where_the_model_uses_the_inference_operators(monkeypatch):
    """"auto" and "cpu" inference in fp32 use both operators for a few queries (up to 16 rows of batch x time:
    here 2 x 7) and neither for more; training, half precision, autocast and "eager" use neither; the logits are
    eager's every time."""
    calls = count_operator_calls(monkeypatch, "decode_attention", "dynamic_terms", "compose_softmax_compose")
    model = build_model(make_config(num_hidden_layers=2, num_head_groups=2, window_size=4, window_type="LG"))
    short, long = (torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(n))
                   for n in (7, dcmha_cpu.DECODE_MAX_QUERIES + 3))  # fmt: skip
    assert short.numel() <= dcmha_cpu.DECODE_MAX_QUERIES < long.shape[1]

    def run(ids, implementation, grad=False, dtype=torch.float32):
        for key in calls:
            calls[key] = 0
        model.config.dcmha_implementation = implementation
        with torch.set_grad_enabled(grad):
            logits = model.to(dtype)(ids).logits.float()
        model.float()
        return logits, dict(calls)

    for ids in (short, long):
        eager, counts = run(ids, "eager")
        assert counts == {"decode_attention": 0, "dynamic_terms": 0, "compose_softmax_compose": 0}
        for implementation in ("auto", "cpu"):
            logits, counts = run(ids, implementation)
            assert_close(logits, eager)
            assert counts["dynamic_terms"] == counts["decode_attention"] == (2 if ids is short else 0)
            assert counts["compose_softmax_compose"] == (0 if ids is short else 2)  # one chunk a layer
        logits, counts = run(ids, "auto", grad=True)
        assert counts["dynamic_terms"] == counts["decode_attention"] == 0
        assert_close(logits, eager)
        logits, counts = run(ids, "auto", dtype=torch.bfloat16)
        assert counts["dynamic_terms"] == counts["decode_attention"] == 0
        assert_close(logits, eager, atol=0.3, rtol=0.1)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # fp32 weights, products in bf16: the Python projection
            autocast, counts = run(ids, "auto")
            autocast_eager, _ = run(ids, "eager")
        assert counts["dynamic_terms"] == 0
        assert_close(autocast, autocast_eager)


def test_greedy_decoding_with_the_inference_operators_matches_eager(monkeypatch):
    """Generation through the cache (left padding, a local layer, groups, key-wise composition): every step's
    scores under "auto" (both operators) are eager's, and the operators ran at every step."""
    calls = count_operator_calls(monkeypatch, "decode_attention", "dynamic_terms", "compose_softmax_compose")
    model = build_model(make_config(num_hidden_layers=2, num_head_groups=2, window_size=4, window_type="LG"))
    model.generation_config.pad_token_id = 0
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(8))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    outs = {}
    for implementation in ("eager", "auto"):
        model.config.dcmha_implementation = implementation
        outs[implementation] = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                              output_scores=True, return_dict_in_generate=True)  # fmt: skip
    assert calls["decode_attention"] == 2 * 8 and calls["dynamic_terms"] == 2 * 8
    assert torch.equal(outs["auto"].sequences, outs["eager"].sequences)
    for auto, eager in zip(outs["auto"].scores, outs["eager"].scores):
        assert_close(auto, eager, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------------------------------------------
# Grouped-query attention: keys and values with Nkv heads, query head n reading key/value head n // (N / Nkv)
# ----------------------------------------------------------------------------------------------------------------
def with_kv(inputs: DCMHAInputs, key: torch.Tensor, value: torch.Tensor) -> DCMHAInputs:
    """`inputs` with other keys and values (the rest of the call as it is)."""
    return DCMHAInputs(inputs.query, key, value, inputs.query_terms, inputs.key_terms, inputs.query_start,
                       inputs.key_start, inputs.key_padding_mask, inputs.window_size, inputs.rank, inputs.num_groups,
                       inputs.chunk_size)  # fmt: skip


GQA_CASES = {
    # name: (B, G, I, Dh, T, S, query_start, key_wise, window, padding, chunk_size)  N = 4 query heads, keys from 0
    "chunks": (2, 2, 2, 8, 70, 70, 0, True, None, False, 32),  # three chunks, the last shorter
    "window-padding": (2, 1, 2, 8, 40, 40, 0, True, 9, True, 16),
    "querywise-cached": (2, 2, 1, 6, 5, 13, 8, False, None, True, 256),  # a few queries: the decode operator
}


def gqa_case(case: str, kv_heads: int) -> tuple[list[torch.Tensor], dict]:
    """The tensors (q, k, v, query factors[, key factors]) of a case with `kv_heads` key/value heads, and the rest
    of its call."""
    B, G, I, Dh, T, S, query_start, key_wise, window, padding, chunk = GQA_CASES[case]
    N = 4
    gen = torch.Generator().manual_seed(len(case) + kv_heads)
    q = torch.randn(B, N, T, Dh, generator=gen)
    k, v = (torch.randn(B, kv_heads, S, Dh, generator=gen) for _ in range(2))
    tensors = [q, k, v, torch.randn(B, T, G, 2, 2 * I + 1, N // G, generator=gen) * 0.5]
    if key_wise:
        tensors.append(torch.randn(B, S, G, 2, 2 * I + 1, N // G, generator=gen) * 0.5)
    pad = None
    if padding:
        pad = torch.rand(B, S, generator=gen) > 0.3
        pad[0, : query_start + 2] = False  # batch 0: its first query sees no real key
    return tensors, dict(pad=pad, query_start=query_start, window=window, rank=I, groups=G, chunk=chunk)


def gqa_inputs(tensors: list[torch.Tensor], call: dict) -> DCMHAInputs:
    q, k, v, qt, kt = (*tensors, None)[:5]
    return DCMHAInputs(q, k, v, qt, kt, call["query_start"], 0, call["pad"], call["window"], call["rank"],
                       call["groups"], call["chunk"])  # fmt: skip


@pytest.mark.parametrize("kv_heads", [2, 1])
@pytest.mark.parametrize("case", list(GQA_CASES))
def test_grouped_kv_heads_match_oracle_and_expanded_heads(case, kv_heads):
    """N = 4 query heads on 2 or 1 key/value heads: the output and the gradients of q, k, v and the factors through
    the autograd Function, and the inference paths' outputs (chunked, with the probabilities; the decode operator
    or the chunked path without), against autograd through the float64 oracle; and against the same call with the
    keys and values copied per query head by hand, whose gradients summed over each group's heads are the grouped
    ones."""
    tensors, call = gqa_case(case, kv_heads)
    N = tensors[0].shape[1]
    leaves = [t.double().requires_grad_() for t in tensors]
    key_terms = leaves[4] if len(leaves) == 5 else None
    ref = oracle_attention(*leaves[:4], key_terms, call["pad"], call["query_start"], 0, call["window"], call["rank"])
    grad_out = torch.randn(ref.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    ref_grads = torch.autograd.grad((ref * grad_out).sum(), leaves)
    ref = ref.detach()

    ours = [t.clone().requires_grad_() for t in tensors]
    out, _ = dcmha.dcmha_attention(gqa_inputs(ours, call), "cpu")
    grads = torch.autograd.grad((out * grad_out.float()).sum(), ours)
    assert_close_to_scale(out, ref)
    for name, grad, expected in zip(("q", "k", "v", "query factors", "key factors"), grads, ref_grads):
        assert grad.shape == expected.shape, name
        assert_close_to_scale(grad, expected, 2e-5)
        assert expected.abs().max() > 1e-2, name  # every input matters: the test can fail
    with torch.no_grad():
        inference, _ = dcmha.dcmha_attention(gqa_inputs(tensors, call), "cpu")
        chunked, probs = dcmha.dcmha_attention(gqa_inputs(tensors, call), "cpu", output_attentions=True)
    assert dcmha_cpu.is_decode_call(gqa_inputs(tensors, call)) == (case == "querywise-cached")
    for result in (inference, chunked):
        assert_close_to_scale(result, ref)
    assert probs.shape == (*ref.shape[:1], N, ref.shape[1], tensors[1].shape[2])

    expanded = [t.clone().requires_grad_() for t in (*tensors[:1], expand_kv(tensors[1], N), expand_kv(tensors[2], N),
                                                      *tensors[3:])]  # fmt: skip
    plain, _ = dcmha.dcmha_attention(gqa_inputs(expanded, call), "cpu")
    plain_grads = torch.autograd.grad((plain * grad_out.float()).sum(), expanded)
    assert_close(out, plain)
    for index, (grad, plain_grad) in enumerate(zip(grads, plain_grads)):
        if index in (1, 2):  # the copies' gradients summed over the query heads of each key/value head
            plain_grad = plain_grad.unflatten(1, (kv_heads, N // kv_heads)).sum(2)
        assert_close_to_scale(grad, plain_grad)


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_grouped_kv_heads_are_never_copied_per_query_head(kv_heads):
    """Every path of the backend (the autograd Function forward and backward, the chunked inference path with and
    without the probabilities, the decode operator) with every op's outputs recorded: none has the shape of the
    keys or values once per query head. S (29) is no other size of the calls; the recorder does see such a copy
    (transformers' `repeat_kv`) where one is made."""
    B, N, G, I, Dh, T, S = 2, 4, 2, 2, 6, 21, 29
    gen = torch.Generator().manual_seed(kv_heads)
    q = torch.randn(B, N, T, Dh, generator=gen, requires_grad=True)
    k, v = (torch.randn(B, kv_heads, S, Dh, generator=gen, requires_grad=True) for _ in range(2))
    qt, kt = (torch.randn(B, L, G, 2, 2 * I + 1, N // G, generator=gen, requires_grad=True) for L in (T, S))
    call = dict(pad=torch.rand(B, S, generator=gen) > 0.2, query_start=S - T, window=None, rank=I, groups=G, chunk=8)
    with OutputShapes() as recorded:
        out, _ = dcmha.dcmha_attention(gqa_inputs([q, k, v, qt, kt], call), "cpu")
        out.square().sum().backward()
        with torch.no_grad():
            dcmha.dcmha_attention(gqa_inputs([q, k, v, qt, kt], call), "cpu")
            dcmha.dcmha_attention(gqa_inputs([q, k, v, qt, kt], call), "cpu", output_attentions=True)
            few = [q[:, :, -3:], k, v, qt[:, -3:], kt]
            assert dcmha_cpu.is_decode_call(gqa_inputs(few, {**call, "query_start": S - 3}))
            dcmha.dcmha_attention(gqa_inputs(few, {**call, "query_start": S - 3}), "cpu")
    assert k.grad.shape == (B, kv_heads, S, Dh) and k.grad.abs().max() > 0
    assert len(recorded.shapes) > 50 and (B, N, T, Dh) in recorded.shapes
    assert kv_copies(recorded.shapes, B, N, S, Dh) == []
    with OutputShapes() as control:  # transformers' repeat_kv
        k[:, :, None].expand(B, kv_heads, N // kv_heads, S, Dh).reshape(B, N, S, Dh)
    assert kv_copies(control.shapes, B, N, S, Dh) == [(B, N, S, Dh)]


def test_key_value_heads_that_do_not_divide_the_query_heads_are_a_clear_reason():
    kernel = DCMHA_BACKENDS["cpu"]
    q, terms = torch.zeros(1, 4, 5, 8), torch.zeros(1, 5, 1, 2, 5, 4)
    for key, value in [(torch.zeros(1, 3, 5, 8),) * 2, (torch.zeros(1, 2, 5, 8), torch.zeros(1, 1, 5, 8))]:
        inputs = DCMHAInputs(q, key, value, terms, terms, 0, 0, None, None, 2, 1, 4)
        reason = kernel.why_not(inputs)
        assert "divides the queries' 4" in reason and str(tuple(key.shape)) in reason and "\n" not in reason
        with pytest.raises(ValueError, match="divides the queries' 4"):
            dcmha.dcmha_attention(inputs, "cpu")
    grouped = DCMHAInputs(q, torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8), terms, terms, 0, 0, None, None, 2, 1, 4)
    assert kernel.why_not(grouped) is None
