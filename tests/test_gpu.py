"""On a CUDA GPU (`pytest -m gpu`; every test skips without one): the paths that only a GPU runs, against the float64
oracle (`oracle.py`) and the eager model on the CPU.

- each backend that runs on CUDA ("eager", "compiled" through Inductor's Triton code, "triton"): logits with
  padding on both sides, windows, qk-norm and head groups against the oracle; every parameter's gradient against
  the CPU's eager model; decoding through the cache against the full forward; bf16 within its rounding;
- `generate` on CUDA: a left-padded batch gives each row's greedy tokens of that row alone on the CPU; a static cache
  under `torch.compile` (Inductor, what transformers users do for speed) gives the eager tokens;
- training on CUDA: activation checkpointing gives the same gradients; AdamW steps under bf16 autocast lower the loss;
- "triton" holds no more than its memory budget: its chunks' scores, never a whole layer's;
- "auto" on CUDA runs "triton" for large calls (the oracle's logits) and "eager" for a decoding step.

fp32 products run without TF32 here (the fixture below), so fp32 on the GPU is held to fp32's tolerance.
"""

import copy
import importlib.util

import pytest
import torch

from helpers import (
    VOCAB,
    as_double,
    assert_close,
    assert_compiled_generation_equals,
    assert_decoding_matches_full_forward,
    build_model,
    loss_and_grads,
    make_config,
    padded_batch,
    registered,
)
from oracle import oracle_causal_lm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CUDA = torch.device("cuda")
BACKENDS = ["eager", "compiled", "triton"]
# one configuration for the backend checks: local and global layers, two head groups, qk-norm, chunks of 5 (the
# compiled stages are traced once and serve every test)
SHARED = dict(use_qk_norm=True, window_size=4, num_head_groups=2, attention_chunk_size=5)
# the same with grouped-query attention (2 key/value heads for 4 query heads, head_dim 12): the Llama-family shapes
SHARED_SETS = {"mha": SHARED, "gqa": dict(SHARED, num_key_value_heads=2, head_dim=12)}
FP32_TOL = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture(autouse=True)
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def needs(backend: str) -> str:
    if backend == "triton" and importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    return backend


def on_cuda(model):
    return copy.deepcopy(model).to(CUDA)


@pytest.mark.parametrize("shared", list(SHARED_SETS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_on_cuda_match_the_oracle(backend, shared):
    """Each row's real tokens against the float64 oracle run on that row alone, and against the CPU's eager model."""
    model = build_model(make_config(dcmha_implementation="eager", **SHARED_SETS[shared]))
    input_ids, mask = padded_batch()
    gpu = on_cuda(model)
    gpu.config.dcmha_implementation = needs(backend)
    with torch.no_grad():
        logits = gpu(input_ids.to(CUDA), attention_mask=mask.to(CUDA), use_cache=False).logits.cpu()
        cpu = model(input_ids, attention_mask=mask, use_cache=False).logits
    state = as_double(model.state_dict())
    for row in range(input_ids.shape[0]):
        real = mask[row].bool()
        expected = oracle_causal_lm(state, model.config, input_ids[row, real][None])[0]
        assert_close(logits[row, real], expected, **FP32_TOL)
        assert_close(logits[row, real], cpu[row, real], **FP32_TOL)


@pytest.mark.parametrize("shared", list(SHARED_SETS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_on_cuda_match_cpu_eager(backend, shared):
    model = build_model(make_config(dcmha_implementation="eager", **SHARED_SETS[shared])).train()
    input_ids, mask = padded_batch()
    _, expected = loss_and_grads(model, input_ids, mask)
    gpu = on_cuda(model)
    gpu.config.dcmha_implementation = needs(backend)
    _, grads = loss_and_grads(gpu, input_ids.to(CUDA), mask.to(CUDA))
    for name, grad in grads.items():
        assert grad.device.type == "cuda"
        assert_close(grad.cpu(), expected[name], **FP32_TOL)
    assert max(g.abs().max().item() for n, g in grads.items() if "dyn_w_proj" in n) > 1e-4  # the test can fail


@pytest.mark.parametrize("backend", BACKENDS)
def test_decoding_on_cuda_matches_the_full_forward(backend):
    """Prefill of 6 tokens, then one token at a time through the cache (a local layer keeps only its window)."""
    model = on_cuda(build_model(make_config(dcmha_implementation=needs(backend), **SHARED)))
    assert_decoding_matches_full_forward(model)  # within 1e-4, as FP32_TOL


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_on_cuda_is_within_its_rounding_of_fp32(backend):
    model = build_model(make_config(num_hidden_layers=2, dcmha_implementation="eager", **SHARED))
    input_ids, mask = padded_batch()
    with torch.no_grad():
        expected = model(input_ids, attention_mask=mask).logits
        gpu = on_cuda(model).to(torch.bfloat16)
        gpu.config.dcmha_implementation = needs(backend)
        logits = gpu(input_ids.to(CUDA), attention_mask=mask.to(CUDA)).logits
    assert logits.dtype == torch.bfloat16
    real = mask.bool()
    scale = expected[real].abs().max().item()
    torch.testing.assert_close(logits.cpu()[real].float(), expected[real], rtol=3e-2, atol=3e-2 * scale)


def greedy(model, ids, mask, **kwargs):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0, **kwargs)
    return out[:, ids.shape[1] :]


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_left_padded_generation_on_cuda_gives_each_rows_tokens(backend):
    config = make_config(dcmha_implementation="eager", eos_token_id=None, **SHARED)
    model = build_model(config)
    ids = torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :6] = 0
    alone = [greedy(model, ids[r, mask[r].bool()][None], None)[0] for r in range(3)]
    gpu = on_cuda(model)
    gpu.config.dcmha_implementation = needs(backend)
    batch = greedy(gpu, ids.to(CUDA), mask.to(CUDA)).cpu()
    for row in range(3):
        assert torch.equal(batch[row], alone[row]), (row, batch[row], alone[row])


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_activation_checkpointing_on_cuda_gives_the_same_gradients(backend):
    model = on_cuda(build_model(make_config(dcmha_implementation=needs(backend), **SHARED))).train()
    input_ids, mask = (t.to(CUDA) for t in padded_batch())
    _, plain = loss_and_grads(model, input_ids, mask)
    model.activation_checkpointing_enable()
    _, checkpointed = loss_and_grads(model, input_ids, mask)
    for name, grad in checkpointed.items():
        assert_close(grad, plain[name], **FP32_TOL)


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_adamw_steps_under_bf16_autocast_on_cuda_lower_the_loss(backend):
    model = on_cuda(build_model(make_config(dcmha_implementation=needs(backend), **SHARED))).train()
    ids = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(2)).to(CUDA)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.7 * losses[0], losses


def test_triton_holds_no_more_than_its_memory_budget():
    """A training step of one layer at T=2048, 8 heads: "triton" with a budget of a quarter of the layer's
    [heads, T, T] fp32 scores holds less than half of them (its chunks within the budget, the layer's activations
    besides); "eager" (chunks of 512 queries) holds more."""
    needs("triton")
    from modeling_dcformer.kernels.dcmha_triton import TritonBackend

    heads, T = 8, 2048
    config = make_config(num_hidden_layers=1, hidden_size=256, num_attention_heads=heads, intermediate_size=256,
                         max_position_embeddings=T, attention_chunk_size=512, dcmha_implementation="triton")
    model = on_cuda(build_model(config)).train()
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(0)).to(CUDA)
    scores_bytes = heads * T * T * 4

    def peak(implementation: str) -> int:
        model.config.dcmha_implementation = implementation
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids, use_cache=False).loss.backward()  # warm-up: kernels, gradients allocated
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        model(ids, labels=ids, use_cache=False).loss.backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before

    with registered("triton", TritonBackend(memory_budget=scores_bytes // 4)):
        triton_peak = peak("triton")
    eager_peak = peak("eager")
    assert triton_peak < scores_bytes // 2, (triton_peak, scores_bytes)
    assert eager_peak > triton_peak  # the measurement can tell the two apart


def test_static_cache_generation_under_inductor_on_cuda_equals_eager():
    """`model.forward = torch.compile(model.forward)` and `cache_implementation="static"` (Inductor generates Triton
    code for the GPU): the eager tokens, and a second generation of the same lengths compiles nothing new."""
    config = make_config(num_hidden_layers=2, window_size=4, window_type="LG", eos_token_id=None)
    model = on_cuda(build_model(config))
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0)).to(CUDA)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    eager = greedy(model, ids, mask, cache_implementation="static")
    assert torch.equal(eager, greedy(model, ids, mask))  # the static cache equals the dynamic one
    assert_compiled_generation_equals(
        model, lambda: greedy(model, ids, mask, cache_implementation="static"), eager, "inductor"
    )


def test_auto_runs_triton_for_large_calls_on_cuda():
    """"auto" on CUDA: "triton" for calls of at least its minimum of scores (lowered to this test's), with the
    oracle's logits; a small call (one decoding step) runs "eager"."""
    needs("triton")
    from modeling_dcformer.kernels.dcmha_triton import AUTO_MIN_CAPABILITY, TritonBackend

    if torch.cuda.get_device_capability() < AUTO_MIN_CAPABILITY:
        pytest.skip(f'"auto" keeps "compiled" below compute capability {AUTO_MIN_CAPABILITY}')
    chosen = []

    class Counted(TritonBackend):
        def __call__(self, inputs, **kwargs):
            chosen.append(inputs.num_scores)
            return super().__call__(inputs, **kwargs)

    model = build_model(make_config(dcmha_implementation="eager", **SHARED))
    input_ids, mask = padded_batch()
    gpu = on_cuda(model)
    gpu.config.dcmha_implementation = "auto"
    with torch.no_grad(), registered("triton", Counted(auto_min_scores=64)):
        logits = gpu(input_ids.to(CUDA), attention_mask=mask.to(CUDA), use_cache=False).logits.cpu()
        assert len(chosen) == model.config.num_hidden_layers, chosen  # every layer's attention
        chosen.clear()
        gpu(input_ids[:1, :1].to(CUDA), use_cache=False)
        assert not chosen, "auto ran triton for a single decoding step"
    state = as_double(model.state_dict())
    for row in range(input_ids.shape[0]):
        real = mask[row].bool()
        expected = oracle_causal_lm(state, model.config, input_ids[row, real][None])[0]
        assert_close(logits[row, real], expected, **FP32_TOL)