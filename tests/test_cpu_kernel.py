"""The "kernel" DCMHA implementation (`modeling_dcformer/cpu_kernel.py`, C built on first use) against the oracle.

- one chunk of the C function against Compose -> mask -> softmax -> Compose written from the spec in float64
  (`oracle_compose`): ranks 1..5, groups, key-wise or query-wise, windows, padding (rows that see no key), key
  offsets, rows that are not a multiple of the vector width, several blocks and tiles, several threads;
- whole models: logits against the oracle (padding, windows), a cached decode against the full forward;
- where it applies: "auto" uses it only where nothing needs gradients; "kernel" elsewhere is a clear error;
- building: into $DCFORMER_CACHE, and what a machine without a working compiler gets.
"""

import pytest
import torch

import modeling_dcformer.modeling_dcformer as mdl
from modeling_dcformer import cpu_kernel
from oracle import oracle_compose
from test_fast_dcmha import (
    assert_auto_does_without,
    assert_decoding_matches_full_forward,
    assert_rows_match_oracle,
    padded_batch,
)
from test_oracle import VOCAB, assert_close, build_model, make_config


pytestmark = pytest.mark.usefixtures("one_thread_each_test")


@pytest.fixture(scope="module", autouse=True)
def _kernel_built():
    if not cpu_kernel.available():
        pytest.skip("no C compiler: the CPU kernel cannot be built here")


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


def test_kernel_threads_give_the_same_numbers(monkeypatch):
    """Tiles spread over OpenMP threads: each tile is computed alone, so the numbers do not depend on them."""
    monkeypatch.setattr(cpu_kernel, "PARALLEL_MIN_SCORES", 0)  # this small chunk too
    assert cpu_kernel.threads_for(1) == torch.get_num_threads()
    B, G, M, I, c, s = 2, 2, 4, 2, 32, 200
    gen = torch.Generator().manual_seed(5)
    raw = torch.randn(B, G * M, c, s, generator=gen)
    qt = torch.randn(B, G, 2, 2 * I + 1, M, c, generator=gen) * 0.5
    kt = torch.randn(B, G, 2, 2 * I + 1, M, s, generator=gen) * 0.5
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        assert cpu_kernel.threads_for(raw.numel()) == threads
        scores = raw.clone()
        cpu_kernel.compose_softmax_compose(scores, qt, 0, kt, 0, None, s - c, 0, None, 0.125, I, G)
        results.append(scores)
    assert torch.equal(results[0], results[1])


def test_no_openmp_threads_in_a_forked_child(monkeypatch):
    """After the kernel ran in parallel in one process, a forked child gets 1 thread (its parent's OpenMP threads
    do not exist there)."""
    monkeypatch.setattr(cpu_kernel, "_parallel_pid", None)
    torch.set_num_threads(2)
    big = cpu_kernel.PARALLEL_MIN_SCORES
    assert cpu_kernel.threads_for(big) == 2 and cpu_kernel._parallel_pid is not None
    assert cpu_kernel.threads_for(big - 1) == 1
    monkeypatch.setattr(cpu_kernel, "_parallel_pid", -1)  # as seen from a child: started by another process
    assert cpu_kernel.threads_for(big) == 1


@pytest.mark.parametrize(
    "options",
    [
        dict(query_wise=False, num_head_groups=1, dynamic_rank=2, attention_chunk_size=4),
        dict(query_wise=True, num_head_groups=2, dynamic_rank=1, attention_chunk_size=512),
        dict(query_wise=False, num_head_groups=2, dynamic_rank=3, attention_chunk_size=5),
    ],
    ids=["chunk4", "querywise-groups2", "rank3-chunk5"],
)
def test_kernel_model_matches_eager_and_oracle(options):
    config = make_config(use_qk_norm=True, window_size=4, dcmha_implementation="eager", **options)
    model = build_model(config).eval()
    input_ids, mask = padded_batch()
    with torch.no_grad():
        eager = model(input_ids, attention_mask=mask, use_cache=False).logits
        model.config.dcmha_implementation = "kernel"
        logits = model(input_ids, attention_mask=mask, use_cache=False).logits
    real = mask.bool()
    assert_close(logits[real], eager[real])
    assert_rows_match_oracle(model, logits, input_ids, mask)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_kernel_in_half_precision_matches_eager(dtype):
    """bf16 / fp16 models: the products in that dtype, the scores in fp32, as in the eager implementation."""
    config = make_config(use_qk_norm=True, window_size=4, attention_chunk_size=5, dcmha_implementation="eager")
    model = build_model(config).to(dtype)
    input_ids, mask = padded_batch()
    with torch.no_grad():
        eager = model(input_ids, attention_mask=mask).logits
        model.config.dcmha_implementation = "kernel"
        logits = model(input_ids, attention_mask=mask).logits
    assert logits.dtype == dtype
    real = mask.bool()
    scale = eager[real].float().abs().max().item()
    torch.testing.assert_close(logits[real].float(), eager[real].float(), rtol=2e-2, atol=2e-2 * scale)


def test_kernel_decodes_like_full_forward():
    config = make_config(use_qk_norm=True, window_size=4, attention_chunk_size=3, dcmha_implementation="kernel")
    assert_decoding_matches_full_forward(build_model(config))


def test_auto_uses_the_kernel_only_without_gradients(monkeypatch):
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return cpu_kernel.compose_softmax_compose(*args, **kwargs)

    monkeypatch.setattr(mdl, "compose_softmax_compose", counted)
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


def test_kernel_is_a_clear_error_where_it_cannot_run():
    model = build_model(make_config(num_hidden_layers=1, dcmha_implementation="kernel")).train()
    ids = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="computes no gradients"):
        model(ids)
    query, terms = torch.zeros(1, 4, 5, 8, device="meta"), torch.zeros(1, 5, 1, 2, 5, 4, device="meta")
    assert "runs on CPU" in mdl.kernel_unsupported(query, (query, terms), terms, 2)
    query, terms = torch.zeros(query.shape), torch.zeros(terms.shape)
    assert "rank" in mdl.kernel_unsupported(query, (query, terms), terms, cpu_kernel.MAX_RANK + 1)
    assert mdl.kernel_unsupported(query, (query, terms), terms, 2) is None
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
        out, _ = mdl.dcmha_attention(q, k, value, qt, kt, 0, 0, None, None, I, G, 4, implementation=implementation)
        out.sum().backward()
        grads[implementation] = value.grad
    assert_close(grads["auto"], grads["eager"])
    value = v.clone().requires_grad_()
    with pytest.raises(ValueError, match="computes no gradients"):
        mdl.dcmha_attention(q, k, value, qt, kt, 0, 0, None, None, I, G, 4, implementation="kernel")


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """The kernel module as in a new process, building into tmp_path; the model's "auto" state reset too."""
    monkeypatch.setenv("DCFORMER_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_kernel, "_library", None)
    monkeypatch.setattr(cpu_kernel, "_build_error", None)
    monkeypatch.setattr(mdl, "_kernel_failed", False)
    return tmp_path


def test_kernel_builds_once_into_the_cache_directory(fresh_build):
    library = cpu_kernel.load()
    built = list(fresh_build.iterdir())
    assert len(built) == 1 and built[0].name.startswith("dcmha_kernel_") and built[0].suffix == ".so"
    assert cpu_kernel.load() is library
    cpu_kernel._library = None  # a new process finds the built library and does not rebuild
    mtime = built[0].stat().st_mtime_ns
    cpu_kernel.load()
    assert built[0].stat().st_mtime_ns == mtime and list(fresh_build.iterdir()) == built


def test_without_a_compiler_auto_does_without_and_kernel_says_why(fresh_build, monkeypatch, caplog):
    monkeypatch.setattr(cpu_kernel, "compiler", lambda: None)
    assert_auto_does_without("kernel", "_kernel_failed", "no C compiler", length=7)
    assert list(fresh_build.iterdir()) == []


def test_a_failed_build_leaves_no_library(fresh_build, monkeypatch):
    monkeypatch.setattr(cpu_kernel, "SOURCE", cpu_kernel.SOURCE + "\nthis is not C;\n")
    with pytest.raises(RuntimeError, match="building the DCMHA CPU kernel"):
        cpu_kernel.load()
    assert [p for p in fresh_build.rglob("*") if p.is_file()] == []
    with pytest.raises(RuntimeError, match="building the DCMHA CPU kernel"):  # remembered: no second build
        cpu_kernel.load()


def test_kernel_refuses_bounds_it_would_read_past():
    """The C function trusts its offsets: the wrapper checks them (a mistake is an error, not a stray read)."""
    B, G, M, I, c, s = 1, 1, 2, 1, 3, 5
    scores = torch.zeros(B, G * M, c, s)
    qt, kt = torch.zeros(B, G, 2, 2 * I + 1, M, 4), torch.zeros(B, G, 2, 2 * I + 1, M, 6)
    run = lambda *a: cpu_kernel.compose_softmax_compose(scores, *a, 0, 0, None, 1.0, I, G)
    with pytest.raises(ValueError, match="queries"):
        run(qt, 2, kt, 0, None)
    with pytest.raises(ValueError, match="keys"):
        run(qt, 0, kt, 2, None)
    with pytest.raises(ValueError, match="key_padding_mask"):
        run(qt, 0, kt, 0, torch.ones(B, 4, dtype=torch.bool))
    run(qt, 1, kt, 1, torch.ones(B, 6, dtype=torch.bool))  # the last valid offsets
