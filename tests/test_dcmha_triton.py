"""The "triton" DCMHA implementation (`modeling_dcformer/kernels/dcmha_triton.py`: chunked cuBLAS products and
Triton kernels between them) against the float64 oracle, forward and backward. Without a GPU the kernels run in
Triton's CPU interpreter (conftest.py sets TRITON_INTERPRET=1): the same kernel code, the numbers checked, the speed
not.

- one layer's attention against Compose -> mask -> softmax -> Compose -> @ v written from the spec in float64, and
  the gradients of q, k, v and every composition factor through it: 12 and 32 heads a group, two groups, ranks 1 to
  3, key-wise or query-wise, windows, padding on the left and on the right (rows that see no key), queries and keys
  offset (a cache), one chunk or several (a small memory budget), fp32 and bf16;
- grouped-query attention (2 or 1 key/value heads for 4 or 6 query heads): the same against the oracle and against
  the call with the keys and values copied per query head by hand (their gradients summed per group), no op making
  such a copy itself (every op's outputs recorded), and a number of key/value heads that does not divide the query
  heads a clear reason;
- generate() and a model with qk-norm against eager (the shared model checks are in test_dcmha_backends.py);
- clear errors where it cannot run;
- the resource gate: every kernel compiled for sm_90 by Triton 3.6.0 (the GPU image's), no spilled register.
"""

import os
import subprocess
import sys
from pathlib import Path

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
    padded_batch,
)
from modeling_dcformer.dcmha import DCMHAInputs
from modeling_dcformer.kernels import dcmha_triton
from oracle import expand_kv, oracle_attention

pytestmark = pytest.mark.skipif(dcmha_triton.triton is None, reason="Triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = Path(__file__).resolve().parent.parent
GATE_TRITON = ROOT / ".cache" / "triton-3.6.0"  # `make install` puts the GPU image's Triton there


@pytest.fixture(scope="module")
def runs_here():
    if not dcmha_triton.available(DEVICE):
        pytest.skip(f"Triton kernels cannot run here: {dcmha_triton.unsupported(torch.device(DEVICE), 1)}")


CASES = {
    # name: (B, G, M, rank, Dh, T, S, key_wise, window, padding, query_start)  keys start at index 0
    "pad-left-and-right-window": (2, 1, 4, 2, 8, 23, 23, True, 7, True, 0),
    "querywise-groups2": (2, 2, 3, 2, 16, 12, 12, False, None, True, 0),
    "rank1-odd-heads-dh12": (1, 1, 3, 1, 12, 19, 19, True, None, False, 0),
    "rank3-groups2-cached": (2, 2, 2, 3, 8, 6, 20, True, 9, True, 14),
    "decode-step": (2, 1, 4, 2, 8, 1, 21, True, None, True, 20),
    "12-heads": (1, 1, 12, 2, 8, 10, 10, True, None, True, 0),
    "32-heads": (1, 1, 32, 2, 8, 6, 6, True, 4, False, 0),
}
# a budget of a few chunks for the cases below (at least one row tile each)
SMALL_BUDGET = 1 << 14


def attention_case(case: str, dtype=torch.float32, kv_heads: int | None = None):
    """The inputs of a case (float32 or `dtype` activations; fp32 factors), with their padding and window; the keys
    and values with `kv_heads` heads (None: one a query head)."""
    B, G, M, I, Dh, T, S, key_wise, window, padding, query_start = CASES[case]
    N = G * M
    gen = torch.Generator().manual_seed(len(case))
    heads = (N, kv_heads or N, kv_heads or N)
    q, k, v = (torch.randn(B, H, L, Dh, generator=gen) for H, L in zip(heads, (T, S, S)))
    qt = torch.randn(B, T, G, 2, 2 * I + 1, M, generator=gen) * 0.5
    kt = torch.randn(B, S, G, 2, 2 * I + 1, M, generator=gen) * 0.5 if key_wise else None
    pad = None
    if padding:
        pad = torch.ones(B, S, dtype=torch.bool)
        pad[0, : query_start + 2] = False  # batch 0 left-padded: its first query sees no real key
        pad[-1, S - 3 :] = False  # the last row right-padded
    return (q.to(dtype), k.to(dtype), v.to(dtype), qt, kt), pad, query_start, window, I, G


def check_against_oracle(case: str, budget: int, dtype=torch.float32, rel=2e-5, kv_heads: int | None = None):
    """The output and every gradient of a case against the oracle's, within `rel` of each tensor's largest value
    (float32 sums of many terms round with their scale); the keys and values with `kv_heads` heads."""
    (q, k, v, qt, kt), pad, query_start, window, I, G = attention_case(case, dtype, kv_heads)
    inputs = [x for x in (q, k, v, qt, kt) if x is not None]
    leaves = [x.double().requires_grad_() for x in inputs]
    key_wise = kt is not None
    ref = oracle_attention(*leaves[:4], leaves[4] if key_wise else None, pad, query_start, 0, window, I)
    grad_out = torch.randn(ref.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ref_grads = torch.autograd.grad((ref * grad_out).sum(), leaves)

    ours = [x.to(DEVICE).requires_grad_() for x in inputs]
    call = DCMHAInputs(*ours[:4], ours[4] if key_wise else None, query_start, 0,
                       None if pad is None else pad.to(DEVICE), window, I, G, 4)  # fmt: skip
    out = dcmha_triton.dcmha_triton(call, budget)
    assert out.shape == ref.shape and out.dtype == dtype
    grads = torch.autograd.grad((out.float() * grad_out.float().to(DEVICE)).sum(), ours)
    ref = ref.detach()
    assert_close_to_scale(out.float().cpu(), ref, rel)
    for name, grad, given, expected in zip(("q", "k", "v", "query factors", "key factors"), grads, ours, ref_grads):
        assert grad.shape == expected.shape and grad.dtype == given.dtype, name
        assert_close_to_scale(grad.float().cpu(), expected, rel)
        assert expected.abs().max() > 1e-2, name  # every input matters: the test can fail
    if pad is not None:  # the row that sees no key: output 0, as in the other implementations
        assert (out[0, 0].cpu() == 0).all()
    if kv_heads is not None:  # the call with the keys and values copied per query head: their grads summed per group
        N = q.shape[1]
        expanded = [x.to(DEVICE).requires_grad_() for x in (q, expand_kv(k, N), expand_kv(v, N), *inputs[3:])]
        plain = dcmha_triton.dcmha_triton(DCMHAInputs(*expanded[:4], expanded[4] if key_wise else None, query_start,
                                                      0, call.key_padding_mask, window, I, G, 4), budget)  # fmt: skip
        plain_grads = torch.autograd.grad((plain.float() * grad_out.float().to(DEVICE)).sum(), expanded)
        assert_close(out.float().cpu(), plain.float().cpu())
        for index, (grad, plain_grad) in enumerate(zip(grads, plain_grads)):
            if index in (1, 2):
                plain_grad = plain_grad.unflatten(1, (kv_heads, N // kv_heads)).sum(2)
            assert_close_to_scale(grad.float().cpu(), plain_grad.float().cpu())
    return call


@pytest.mark.usefixtures("runs_here")
@pytest.mark.parametrize("budget", [dcmha_triton.MEMORY_BUDGET, SMALL_BUDGET], ids=["one-chunk", "chunks"])
@pytest.mark.parametrize("case", [c for c in CASES if c != "32-heads"])
def test_triton_matches_oracle_forward_and_backward(case, budget):
    call = check_against_oracle(case, budget)
    chunks = dcmha_triton.Call(call, None, None, budget)
    T = call.shapes[2]
    assert len(chunks.spans) == -(-T // chunks.chunk)
    if budget == SMALL_BUDGET and case in ("pad-left-and-right-window", "12-heads", "querywise-groups2"):
        assert len(chunks.spans) > 1  # the gradients of keys and values summed over chunks


@pytest.mark.usefixtures("runs_here")
# one key/value head (multi-query attention) with `pytest -m expensive` (about 12 s each in the interpreter): the
# default run has two key/value heads on each path
@pytest.mark.parametrize("case,budget,kv_heads", [
    pytest.param("pad-left-and-right-window", SMALL_BUDGET, 2, id="window-chunks-kv2"),
    pytest.param("pad-left-and-right-window", SMALL_BUDGET, 1, id="window-chunks-kv1", marks=pytest.mark.expensive),
    pytest.param("rank3-groups2-cached", dcmha_triton.MEMORY_BUDGET, 2, id="cached-kv2"),
    pytest.param("rank3-groups2-cached", dcmha_triton.MEMORY_BUDGET, 1, id="cached-kv1", marks=pytest.mark.expensive),
    pytest.param("querywise-groups2", SMALL_BUDGET, 2, id="querywise-kv2"),
])
def test_triton_with_grouped_kv_heads_matches_oracle_and_expanded_heads(case, budget, kv_heads):
    """Query heads (4, or 6 query-wise) on 2 or 1 key/value heads: the output and the gradients of q, k, v and the
    factors against the oracle, and against the call with the keys and values copied per query head."""
    call = check_against_oracle(case, budget, kv_heads=kv_heads)
    assert call.key.shape[1] == kv_heads < call.query.shape[1]


@pytest.mark.usefixtures("runs_here")
@pytest.mark.parametrize("kv_heads", [2, pytest.param(1, marks=pytest.mark.expensive)])
def test_triton_never_copies_grouped_kv_heads_per_query_head(kv_heads):
    """Forward and backward over two chunks with every op's outputs recorded: none has the shape of the keys or
    values once per query head (S = 13 is no other size of the call); the recorder does see such a copy
    (transformers' `repeat_kv`) where one is made."""
    B, N, G, I, Dh, T, S = 2, 4, 2, 2, 8, 10, 13
    gen = torch.Generator().manual_seed(kv_heads)
    q = torch.randn(B, N, T, Dh, generator=gen, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(B, kv_heads, S, Dh, generator=gen, device=DEVICE, requires_grad=True) for _ in range(2))
    qt, kt = (torch.randn(B, L, G, 2, 2 * I + 1, N // G, generator=gen, device=DEVICE, requires_grad=True)
              for L in (T, S))  # fmt: skip
    inputs = DCMHAInputs(q, k, v, qt, kt, S - T, 0, None, 6, I, G, 4)
    with OutputShapes() as recorded:
        out = dcmha_triton.dcmha_triton(inputs, chunk=8)
        out.square().sum().backward()
    assert k.grad.shape == (B, kv_heads, S, Dh) and k.grad.abs().max() > 0
    assert len(dcmha_triton.Call(inputs, None, None, 0, 8).spans) == 2
    assert len(recorded.shapes) > 50 and (B, T, N, Dh) in recorded.shapes
    assert kv_copies(recorded.shapes, B, N, S, Dh) == []
    with OutputShapes() as control:  # transformers' repeat_kv
        k[:, :, None].expand(B, kv_heads, N // kv_heads, S, Dh).reshape(B, N, S, Dh)
    assert kv_copies(control.shapes, B, N, S, Dh) == [(B, N, S, Dh)]


@pytest.mark.usefixtures("runs_here")
def test_key_value_heads_that_do_not_divide_the_query_heads_are_a_clear_reason():
    q, terms = torch.zeros(1, 4, 5, 8, device=DEVICE), torch.zeros(1, 5, 1, 2, 5, 4, device=DEVICE)
    key = torch.zeros(1, 3, 5, 8, device=DEVICE)
    inputs = DCMHAInputs(q, key, key, terms, terms, 0, 0, None, None, 2, 1, 4)
    reason = dcmha_triton.TRITON.why_not(inputs)
    assert "divides the queries' 4" in reason and "(1, 3, 5, 8)" in reason and "\n" not in reason
    with pytest.raises(ValueError, match="divides the queries' 4"):
        dcmha_triton.dcmha_triton(inputs)
    grouped = torch.zeros(1, 2, 5, 8, device=DEVICE)
    assert dcmha_triton.TRITON.why_not(DCMHAInputs(q, grouped, grouped, terms, terms, 0, 0, None, None, 2, 1, 4)) \
        is None


@pytest.mark.usefixtures("runs_here")
def test_triton_with_32_heads_a_group_matches_oracle():
    """DCPythia-6.9B's head group (32 heads), with a window; the kernels loop over the heads at run time."""
    check_against_oracle("32-heads", SMALL_BUDGET)


@pytest.mark.usefixtures("runs_here")
@pytest.mark.parametrize("case", ["pad-left-and-right-window", "12-heads"])
def test_triton_in_bf16_matches_oracle_to_bf16_rounding(case):
    """bf16 activations: the products and the composed probabilities in bf16 (as the eager path rounds them), the
    rest in fp32."""
    check_against_oracle(case, SMALL_BUDGET, torch.bfloat16, rel=3e-2)


@pytest.mark.usefixtures("runs_here")
def test_triton_generates_like_eager_with_qk_norm_and_a_window():
    config = make_config(use_qk_norm=True, window_size=4, num_hidden_layers=2, dcmha_implementation="triton")
    model = build_model(config).to(DEVICE)
    input_ids, mask = (x.to(DEVICE) for x in padded_batch())
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    ours = model.generate(input_ids, attention_mask=mask, **kwargs)
    with torch.no_grad():
        logits = model(input_ids, attention_mask=mask).logits
    model.config.dcmha_implementation = "eager"
    assert torch.equal(ours, model.generate(input_ids, attention_mask=mask, **kwargs))
    with torch.no_grad():
        assert_close(logits, model(input_ids, attention_mask=mask).logits)


@pytest.mark.usefixtures("runs_here")
def test_chunks_follow_the_memory_budget():
    """The chunk size: as many queries as the budget holds (in the backward pass, which holds the most), the call in
    chunks of equal size (a multiple of the row tiles, no small last chunk), at least one tile, at most the call."""
    step = max(dcmha_triton.FORWARD_TILE[0], dcmha_triton.BACKWARD_TILE[0])
    per_query = 2 * 32 * 2048 * dcmha_triton.bytes_per_score(torch.bfloat16, 2, backward=True)
    for room in (3, 100, 1000, 2047, 5000):
        chunk = dcmha_triton.chunk_queries(2, 32, 2048, 2048, torch.bfloat16, 2, int(per_query * room))
        count = -(-2048 // chunk)
        assert chunk % step == 0 or chunk == 2048, (room, chunk)
        assert chunk <= max(room, step) and (chunk == 2048 or chunk * count - 2048 < step * count), (room, chunk)
    assert dcmha_triton.chunk_queries(2, 32, 50, 2048, torch.bfloat16, 2, 1 << 40) == 50
    # DCPythia-6.9B's layer, 1 x 2,048 in bf16: as few chunks as the budget allows, each within it
    per_query = 32 * 2048 * dcmha_triton.bytes_per_score(torch.bfloat16, 2, backward=True)
    chunk = dcmha_triton.chunk_queries(1, 32, 2048, 2048, torch.bfloat16, 2, dcmha_triton.MEMORY_BUDGET)
    assert chunk * per_query <= dcmha_triton.MEMORY_BUDGET
    assert -(-2048 // chunk) == -(-2048 // (dcmha_triton.MEMORY_BUDGET // per_query // step * step))
    assert dcmha_triton.bytes_per_score(torch.float32, 2, False) > dcmha_triton.bytes_per_score(torch.bfloat16, 2, False)


def test_triton_is_a_clear_error_where_it_cannot_run(monkeypatch):
    model = build_model(make_config(num_hidden_layers=1, dcmha_implementation="triton"))
    ids = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    query = torch.zeros(1, 4, 5, 8)
    assert "rank" in dcmha_triton.unsupported(query.device, dcmha_triton.MAX_RANK + 1)
    monkeypatch.setattr(dcmha_triton, "interpreting", lambda: False)
    assert "runs on CUDA" in dcmha_triton.unsupported(torch.device("cpu"), 2)
    monkeypatch.setattr(dcmha_triton, "triton", None)
    with pytest.raises(ValueError, match="Triton is not installed"):
        model(ids)
    with pytest.raises(ValueError, match="Triton is not installed"):  # no "eager" fallback where it cannot run
        model(ids, output_attentions=True)


@pytest.mark.usefixtures("runs_here")
def test_calls_it_cannot_compute_run_eager_or_say_why():
    """output_attentions: such calls are left to "eager" (tests/test_attentions.py); no composition: plain
    attention, as with "eager"."""
    model = build_model(make_config(num_hidden_layers=1, dcmha_implementation="triton"))
    ids = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert len(model(ids, output_attentions=True).attentions) == 1
    plain = build_model(make_config(num_hidden_layers=1, use_dcmha=False, dcmha_implementation="triton"))
    mask = torch.tensor([[0, 1, 1, 1, 1]])
    with torch.no_grad():
        logits = plain(ids, attention_mask=mask).logits
        plain.config.dcmha_implementation = "eager"
        assert_close(logits, plain(ids, attention_mask=mask).logits)


def test_a_program_too_big_for_the_gpu_is_a_clear_error(monkeypatch, runs_here):
    class TooBig:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise dcmha_triton.triton.runtime.errors.OutOfResources(262144, 232448, "shared memory")

            return launch

    monkeypatch.setattr(dcmha_triton, "_fwd_stats", TooBig())
    q = torch.zeros(1, 4, 5, 8, device=DEVICE)
    terms = torch.zeros(1, 5, 1, 2, 5, 4, device=DEVICE)
    rows, keys = dcmha_triton.FORWARD_TILE
    with pytest.raises(ValueError, match=f"do not fit this GPU at a tile of {rows} queries x {keys} keys"):
        dcmha_triton.dcmha_triton(DCMHAInputs(q, q, q, terms, terms, 0, 0, None, None, 2, 1, 4))


def gate(*args: str) -> subprocess.CompletedProcess:
    """benchmarks/triton_resources.py with the GPU image's Triton (3.6.0) first on the path."""
    if not (GATE_TRITON / "triton").is_dir():
        pytest.skip(f"Triton 3.6.0 is not in {GATE_TRITON} (make install puts it there)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(GATE_TRITON), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)
    script = ROOT / "benchmarks" / "triton_resources.py"
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=600,
                          env=env)  # fmt: skip


def test_resource_gate_every_kernel_compiles_for_sm_90_without_spills():
    """The shipped kernels, compiled by Triton 3.6.0 and its ptxas for sm_90 (no GPU needed): one line per kernel,
    configuration and shape, `KERNEL SHAPE regs=N stack=N`, and no stack bytes (no register spilled to local
    memory). About 30 s."""
    run = gate()
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = [line.split() for line in run.stdout.splitlines() if " regs=" in line]
    kernels = {"fwd_stats", "fwd_probs", "bwd_stats", "bwd_grads"}
    assert {line[0] for line in lines} == kernels, run.stdout
    assert {line[1].split("/")[0] for line in lines} == {"pythia-160m", "dcpythia-6.9b"}, run.stdout
    assert all(line[3] == "stack=0" for line in lines), run.stdout
    assert "triton 3.6.0" in run.stdout


def test_resource_gate_fails_on_spills():
    """The gate's other side: a tile too big for the registers spills, and the gate says so and fails."""
    run = gate("--tiles", "32x64", "--kernels", "bwd_grads", "--dtypes", "fp32")
    assert run.returncode == 2, run.stdout[-3000:] + run.stderr[-3000:]
    assert any(" regs=" in line and "stack=0" not in line for line in run.stdout.splitlines()), run.stdout
    assert "spill" in run.stderr
