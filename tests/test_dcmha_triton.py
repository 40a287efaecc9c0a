"""The "triton" DCMHA implementation (`modeling_dcformer/kernels/dcmha_triton.py`, flash-style Triton kernels) against the
oracle, forward and backward. Without a GPU the kernels run in Triton's CPU interpreter (conftest.py sets
TRITON_INTERPRET=1): the same kernel code, the numbers checked, the speed not.

- the attention of one layer against Compose -> mask -> softmax -> Compose -> @ v written from the spec in
  float64, and the gradients of q, k, v and every composition factor through it: ranks 1..3, groups, key-wise or
  query-wise, windows, padding (rows that see no key), head sizes and head counts that are not powers of two,
  queries and keys offset (a cache), several blocks, a single query; tiles other than 16 x 16;
- generate() against eager (the shared model checks are in test_dcmha_backends.py);
- clear errors where it cannot run; the real compiler builds the kernels for a GPU target (no GPU needed).
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import VOCAB, assert_close, build_model, make_config, padded_batch
from modeling_dcformer.kernels import dcmha_triton
from modeling_dcformer.dcmha import time_last
from oracle import oracle_attention

pytestmark = pytest.mark.skipif(dcmha_triton.triton is None, reason="Triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module", autouse=True)
def _runs_here():
    if not dcmha_triton.available(DEVICE):
        pytest.skip(f"Triton kernels cannot run here: {dcmha_triton.unsupported(torch.device(DEVICE), 1)}")


CASES = {
    # name: (B, G, M, rank, Dh, T, S, key_wise, window, padding, query_start)  keys start at index 0
    "rank2-pad-window": (2, 1, 4, 2, 8, 37, 37, True, 11, True, 0),
    "querywise-groups2": (2, 2, 2, 2, 32, 20, 20, False, None, True, 0),
    "rank1-odd-heads-dh12": (1, 1, 3, 1, 12, 33, 33, True, None, False, 0),
    "rank3-cached": (1, 1, 4, 3, 8, 9, 40, True, 13, True, 31),
    "decode-step": (2, 2, 3, 2, 8, 1, 21, True, None, True, 20),
    "rank2-dh40": (1, 1, 4, 2, 40, 19, 19, True, 7, True, 0),
    "16-heads": (1, 1, 16, 1, 16, 18, 18, True, None, True, 0),  # the 8-warp settings of big head groups
}


SPLITTABLE = [case for case, shape in CASES.items() if shape[4] > 16]


@pytest.mark.parametrize(
    "case, split", [(case, False) for case in CASES] + [(case, True) for case in SPLITTABLE],
    ids=list(CASES) + [f"{case}-split" for case in SPLITTABLE],
)
def test_triton_matches_oracle_forward_and_backward(case, split, monkeypatch):
    """`split`: the products 16 head dimensions at a time and the outputs (out, dq, dk, dv) in parts of 16 head
    dimensions, each program recomputing the probabilities (what big heads use on a GPU)."""
    B, G, M, I, Dh, T, S, key_wise, window, padding, query_start = CASES[case]
    if split:
        settings = dcmha_triton.block_settings
        monkeypatch.setattr(dcmha_triton, "block_settings", lambda *a: dict(settings(*a), DK=16, DV=16))
    N = G * M
    gen = torch.Generator().manual_seed(len(case))
    q, k, v = torch.randn(B, N, T, Dh, generator=gen), torch.randn(B, N, S, Dh, generator=gen), None
    k, v = torch.randn(B, N, S, Dh, generator=gen), torch.randn(B, N, S, Dh, generator=gen)
    qt = torch.randn(B, T, G, 2, 2 * I + 1, M, generator=gen) * 0.5
    kt = torch.randn(B, S, G, 2, 2 * I + 1, M, generator=gen) * 0.5 if key_wise else None
    pad = None
    if padding:
        pad = torch.rand(B, S, generator=gen) > 0.3
        pad[0, : query_start + 1] = False  # batch 0: its first query sees no real key
    inputs = [x for x in (q, k, v, qt, kt) if x is not None]
    leaves = [x.double().requires_grad_() for x in inputs]
    ref = oracle_attention(*leaves[:4], leaves[4] if key_wise else None, pad, query_start, 0, window, I)
    grad_out = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    ref_grads = torch.autograd.grad((ref * grad_out).sum(), leaves)

    ours = [x.to(DEVICE).requires_grad_() for x in inputs]
    # the factors laid out by the model's own (differentiable) preparation: their gradients come back in its layout
    pad_in = None if pad is None else pad.to(DEVICE)
    qt_in, kt_in = time_last(ours[3]), time_last(ours[4]) if key_wise else None
    pad_in = None if pad_in is None else pad_in.to(torch.uint8)
    out = dcmha_triton.dcmha_triton(*ours[:3], qt_in, kt_in, pad_in, query_start, 0, window, I, G)
    assert out.shape == (B, T, N, Dh)
    grads = torch.autograd.grad((out * grad_out.float().to(DEVICE)).sum(), ours)
    assert_close(out.cpu(), ref)
    for name, grad, expected in zip(("q", "k", "v", "query factors", "key factors"), grads, ref_grads):
        assert grad.shape == expected.shape, name
        assert_close(grad.cpu(), expected, atol=2e-5, rtol=2e-5)
        assert expected.abs().max() > 1e-2, name  # every input matters: the test can fail
    if padding:  # the row that sees no key: output 0, as in the other implementations
        assert (out[0, 0].cpu() == 0).all()


def test_triton_generates_like_eager():
    config = make_config(use_qk_norm=True, window_size=4, num_hidden_layers=2, dcmha_implementation="triton")
    model = build_model(config).to(DEVICE)
    input_ids, mask = (x.to(DEVICE) for x in padded_batch())
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    ours = model.generate(input_ids, attention_mask=mask, **kwargs)
    model.config.dcmha_implementation = "eager"
    assert torch.equal(ours, model.generate(input_ids, attention_mask=mask, **kwargs))


def test_triton_is_a_clear_error_where_it_cannot_run(monkeypatch):
    model = build_model(make_config(num_hidden_layers=1, dcmha_implementation="triton"))
    ids = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # output_attentions: such calls are left to "eager" (tests/test_attentions.py)
        assert len(model(ids, output_attentions=True).attentions) == 1
    plain = build_model(make_config(num_hidden_layers=1, use_dcmha=False, dcmha_implementation="triton"))
    mask = torch.tensor([[0, 1, 1, 1, 1]])
    with torch.no_grad():  # no composition: plain attention, as with "eager"
        logits = plain(ids, attention_mask=mask).logits
        plain.config.dcmha_implementation = "eager"
        assert_close(logits, plain(ids, attention_mask=mask).logits)
    query = torch.zeros(1, 4, 5, 8)
    assert "rank" in dcmha_triton.unsupported(query.device, dcmha_triton.MAX_RANK + 1)
    monkeypatch.setattr(dcmha_triton, "interpreting", lambda: False)
    assert "runs on CUDA" in dcmha_triton.unsupported(torch.device("cpu"), 2)
    monkeypatch.setattr(dcmha_triton, "triton", None)
    with pytest.raises(ValueError, match="Triton is not installed"):
        model(ids)
    with pytest.raises(ValueError, match="Triton is not installed"):  # no "eager" fallback where it cannot run
        model(ids, output_attentions=True)


def test_a_program_too_big_for_the_gpu_is_a_clear_error(monkeypatch):
    class TooBig:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise dcmha_triton.triton.runtime.errors.OutOfResources(262144, 232448, "shared memory")

            return launch

    monkeypatch.setattr(dcmha_triton, "_fwd", TooBig())
    q = torch.zeros(1, 4, 5, 8, device=DEVICE)
    terms = torch.zeros(1, 1, 2, 5, 4, 5, device=DEVICE)  # time-last [B, G, 2, 2I+1, M, T]
    with pytest.raises(ValueError, match="do not fit this GPU for 4 heads per group .* of 16 dimensions"):
        dcmha_triton.dcmha_triton(q, q, q, terms, terms, None, 0, 0, None, 2, 1)


def test_kernels_compile_for_a_gpu_target_without_a_gpu():
    """benchmarks/triton_resources.py: Triton's real compiler (not the interpreter) and ptxas build the forward
    kernel for sm_90 here, at the package's tile and another, and the table reports its shared memory within the
    limit; a tile that is not a power of two is an error naming it."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "triton_resources.py"
    args = ["--heads", "3", "--head-dim", "40", "--kernels", "fwd", "--dtype", "bf16", "--tiles", "16x16,32x16"]
    run = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    for tile in ("16x16", "32x16"):
        rows = [line for line in run.stdout.splitlines() if line.startswith(f"| 3 | 40 | {tile} | fwd |")]
        assert len(rows) == 1, run.stdout
        cells = [c.strip() for c in rows[0].strip("|").split("|")]
        assert int(cells[7]) > 0 and cells[8] == "yes", rows[0]
    run = subprocess.run([sys.executable, str(script), "--tiles", "24x16"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--tiles: 24x16 is not TxS" in run.stderr, run.stderr


@pytest.mark.parametrize("blocks", [(32, 16), (16, 32), (32, 32)], ids=lambda b: f"{b[0]}x{b[1]}")
@pytest.mark.parametrize("case", ["rank2-pad-window", "rank3-cached"])
def test_other_tiles_match_the_oracle_too(case, blocks, monkeypatch):
    """Tiles of BLOCK_T queries x BLOCK_S keys other than the default 16 x 16 (what `profile_shapes.py
    --implementation triton@TxS` times on a GPU): the same numbers, forward and backward."""
    monkeypatch.setattr(dcmha_triton, "BLOCK_T", blocks[0])
    monkeypatch.setattr(dcmha_triton, "BLOCK_S", blocks[1])
    test_triton_matches_oracle_forward_and_backward(case, False, monkeypatch)
