"""One conformance suite for every DCMHA backend in the registry (`modeling_dcformer.dcmha.DCMHA_BACKENDS`), and the
registry itself.

Each built-in backend ("eager", "compiled" through torch.compile's cheap `aot_eager` backend, "kernel", "triton"
in Triton's CPU interpreter) against the float64 oracle and the eager reference: logits with padding, windows,
qk-norm, groups and query-wise composition; gradients; the returned probabilities; cached decoding; half precision;
and a clear error for what it cannot do. A backend that cannot run on this machine is skipped, naming why.
The registry: "auto"'s choice, failures remembered on the backend object, and a user's own backend.
"""

from types import SimpleNamespace

import pytest
import torch

from helpers import (
    VOCAB,
    assert_close,
    assert_decoding_matches_full_forward,
    assert_rows_match_oracle,
    build_model,
    loss_and_grads,
    make_config,
    padded_batch,
)
from modeling_dcformer import DCFormerConfig, dcmha, dcmha_compiled
from modeling_dcformer.dcmha import DCMHA_BACKENDS, DCMHABackend, DCMHAInputs, DCMHAInterface
from modeling_dcformer.dcmha_compiled import COMPILED

pytestmark = pytest.mark.usefixtures("one_thread_each_test")

BUILT_IN = ["eager", "compiled", "kernel", "triton"]
# what each built-in backend computes (the conformance checks follow from it)
GRADIENTS = {"eager": True, "compiled": True, "kernel": True, "triton": True}


def probe_inputs(requires_grad: bool = False) -> DCMHAInputs:
    """A small composed attention call on this machine's device for the tests."""
    gen = torch.Generator().manual_seed(0)
    B, N, T, Dh, G, I = 1, 4, 5, 8, 1, 2
    q, k, v = (torch.randn(B, N, T, Dh, generator=gen).requires_grad_(requires_grad) for _ in range(3))
    terms = torch.randn(B, T, G, 2, 2 * I + 1, N // G, generator=gen)
    return DCMHAInputs(q, k, v, terms, terms.clone(), 0, 0, None, None, I, G, 4)


@pytest.fixture(scope="module", autouse=True)
def aot_eager_compile():
    """"compiled" through torch.compile's `aot_eager` backend: the same tracing, dynamic shapes and autograd as
    with Inductor, without generating C++ (seconds instead of a minute). Once for the module: the stages' graphs
    serve every test (their lengths are dynamic)."""
    torch._dynamo.reset()
    COMPILED.reset("aot_eager")
    yield
    COMPILED.reset("inductor")
    torch._dynamo.reset()


def usable(name: str) -> str:
    problem = DCMHA_BACKENDS[name].why_not(probe_inputs())
    if problem is not None:
        pytest.skip(f'"{name}" cannot run here: {problem}')
    return name


@pytest.fixture(params=BUILT_IN)
def backend(request):
    return usable(request.param)


# The slowest combinations run with `pytest -m expensive` (the suite's time budget, docs/testing.md); the default run
# still has each backend's logits, gradients, probabilities and decoding: Triton's decode and gradient steps in its
# CPU interpreter (minutes), and "compiled" on two options sets fewer (each set traces its own graphs; the gradient
# test runs it on SHARED's groups, windows and qk-norm).
EXPENSIVE = pytest.mark.expensive
TRITON_EXPENSIVE = ["eager", "compiled", "kernel", pytest.param("triton", marks=EXPENSIVE)]  # gradients
# decoding: also "compiled" (each decode step a chunk of one query; on CPU "auto" decodes with the kernel, and
# "compiled"'s forward is checked by the logits test)
DECODE_BACKENDS = ["eager", pytest.param("compiled", marks=EXPENSIVE), "kernel", pytest.param("triton", marks=EXPENSIVE)]


OPTIONS = {
    "chunk4": dict(query_wise=False, num_head_groups=1, dynamic_rank=2, attention_chunk_size=4),
    "querywise-groups2": dict(query_wise=True, num_head_groups=2, dynamic_rank=1, attention_chunk_size=512),
    "rank3-groups2-chunk5": dict(query_wise=False, num_head_groups=2, dynamic_rank=3, attention_chunk_size=5),
}
# The gradient, probability, decoding and half-precision checks share one configuration (local and global layers,
# two head groups, rank 2, chunks of 5): "compiled" traces its stages once per static configuration (groups, rank,
# window, scale), and the tests after the first reuse its graphs.
SHARED = dict(use_qk_norm=True, window_size=4, num_head_groups=2, attention_chunk_size=5)


@pytest.mark.parametrize(
    "backend, options",
    [(b, o) for b in BUILT_IN for o in OPTIONS if b != "compiled" or o == "querywise-groups2"]
    + [pytest.param("compiled", o, marks=EXPENSIVE) for o in ("chunk4", "rank3-groups2-chunk5")],
)
def test_logits_match_eager_and_oracle(backend, options):
    backend = usable(backend)
    config = make_config(use_qk_norm=True, window_size=4, dcmha_implementation="eager", **OPTIONS[options])
    model = build_model(config).eval()
    input_ids, mask = padded_batch()
    with torch.no_grad():
        eager = model(input_ids, attention_mask=mask, use_cache=False).logits
        model.config.dcmha_implementation = backend
        logits = model(input_ids, attention_mask=mask, use_cache=False).logits
    real = mask.bool()
    assert_close(logits[real], eager[real])
    assert_rows_match_oracle(model, logits, input_ids, mask)


@pytest.mark.parametrize("backend", TRITON_EXPENSIVE)
def test_gradients_match_eager(backend):
    """A training step (local and global layers, padding on both sides, chunks recomputed in the backward pass):
    logits and every parameter's gradient against "eager"; a backend without gradients says so."""
    backend = usable(backend)
    config = make_config(dcmha_implementation="eager", **SHARED)
    model = build_model(config).train()
    input_ids, mask = padded_batch()
    eager_logits, eager_grads = loss_and_grads(model, input_ids, mask)
    model.config.dcmha_implementation = backend
    if not GRADIENTS[backend]:
        with pytest.raises(ValueError, match=f'dcmha_implementation="{backend}" cannot compute.*gradients'):
            loss_and_grads(model, input_ids, mask)
        return
    logits, grads = loss_and_grads(model, input_ids, mask)
    real = mask.bool()
    assert_close(logits[real], eager_logits[real])
    for name, grad in grads.items():
        assert_close(grad, eager_grads[name])
    assert max(g.abs().max().item() for n, g in grads.items() if "dyn_w_proj" in n) > 1e-4  # the test can fail


def test_compiled_evaluation_after_training_traces_nothing_new():
    """Evaluation after a training step (Trainer's evaluate, generate after fine-tuning) reuses the compiled stages'
    graphs: the stages see detached inputs, so torch.compile's requires_grad guards do not trace every stage twice."""
    usable("compiled")
    model = build_model(make_config(dcmha_implementation="compiled", **SHARED)).train()
    input_ids, mask = padded_batch()
    loss_and_grads(model, input_ids, mask)  # traces the stages, unless a test before this one did
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch.no_grad():
        model.eval()(input_ids, attention_mask=mask, use_cache=False)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_probabilities_match_eager(backend):
    """output_attentions: the composed probabilities of every layer equal eager's (a backend that cannot return
    them, "triton", leaves such calls to "eager": tests/test_attentions.py)."""
    config = make_config(dcmha_implementation="eager", **SHARED)
    model = build_model(config).eval()
    input_ids, mask = padded_batch()
    with torch.no_grad():
        eager = model(input_ids, attention_mask=mask, output_attentions=True).attentions
        model.config.dcmha_implementation = backend
        ours = model(input_ids, attention_mask=mask, output_attentions=True).attentions
    assert len(ours) == len(eager) == config.num_hidden_layers
    for a, b in zip(ours, eager):
        assert_close(a, b)


@pytest.mark.parametrize("backend", DECODE_BACKENDS)
def test_decoding_matches_full_forward(backend):
    backend = usable(backend)
    config = make_config(dcmha_implementation=backend, **SHARED)
    assert_decoding_matches_full_forward(build_model(config))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_matches_eager(backend, dtype):
    """bf16 / fp16: the products in that dtype, the scores in fp32, within its rounding of the eager model (4 layers;
    2 for "triton", whose blocks round in another order)."""
    layers = 2 if backend == "triton" else 4
    config = make_config(num_hidden_layers=layers, dcmha_implementation="eager", **SHARED)
    model = build_model(config).to(dtype)
    input_ids, mask = padded_batch()
    with torch.no_grad():
        eager = model(input_ids, attention_mask=mask).logits
        model.config.dcmha_implementation = backend
        logits = model(input_ids, attention_mask=mask).logits
    assert logits.dtype == dtype
    real = mask.bool()
    scale = eager[real].float().abs().max().item()
    torch.testing.assert_close(logits[real].float(), eager[real].float(), rtol=2e-2, atol=2e-2 * scale)


def test_plain_attention_ignores_the_implementation(backend):
    """use_dcmha=False: every implementation runs plain attention (SDPA), the same numbers."""
    config = make_config(use_dcmha=False, window_size=4, dcmha_implementation="eager")
    model = build_model(config).eval()
    input_ids, mask = padded_batch()
    with torch.no_grad():
        eager = model(input_ids, attention_mask=mask).logits
        model.config.dcmha_implementation = backend
        assert_close(model(input_ids, attention_mask=mask).logits, eager)


# ----------------------------------------------------------------------------------------------------------------
# the registry
# ----------------------------------------------------------------------------------------------------------------
def test_registry_lists_the_built_in_backends():
    assert set(BUILT_IN) <= set(DCMHA_BACKENDS)
    for name in BUILT_IN:
        assert DCMHA_BACKENDS[name].name == name


def gpu_call(num_scores: int):
    """What `choose_auto` reads of a call (its size and device), for a call on a CUDA GPU this machine may not have."""
    return SimpleNamespace(num_scores=num_scores, query=SimpleNamespace(device=torch.device("cuda", 0)))


def test_auto_picks_by_size_and_device(monkeypatch):
    """"auto": the CPU kernel, for inference and training (when it builds here); where it cannot run, for calls of at
    least AUTO_COMPILE_MIN_SCORES scores "triton" on a GPU where Triton runs, else "compiled"; "eager" below the
    threshold or where nothing can be compiled."""
    kernel_ok = DCMHA_BACKENDS["kernel"].why_not(probe_inputs()) is None
    training = probe_inputs(requires_grad=True)
    with torch.no_grad():
        assert dcmha.choose_auto(probe_inputs()).name == ("kernel" if kernel_ok else "eager")
    assert dcmha.choose_auto(training).name == ("kernel" if kernel_ok else "eager")
    monkeypatch.setattr(DCMHA_BACKENDS["kernel"], "why_not", lambda *a: "not here")  # say, on a GPU
    assert dcmha.choose_auto(training).name == "eager"  # 4 x 5 x 5 scores: below the threshold
    monkeypatch.setattr(dcmha, "AUTO_COMPILE_MIN_SCORES", training.num_scores)
    monkeypatch.setattr(dcmha_compiled, "compile_supported", lambda device: True)
    assert dcmha.choose_auto(training).name == "compiled"
    # on a GPU from Ampere on, "triton" before "compiled" where it can run, for large calls only
    monkeypatch.setattr(DCMHA_BACKENDS["triton"], "why_not", lambda *a: None)
    assert dcmha.choose_auto(training).name == "compiled"  # the CPU: there Triton would only interpret
    on_gpu = gpu_call(training.num_scores)
    capability = {"value": (9, 0)}  # an H100 / H200
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["value"])
    assert dcmha.choose_auto(on_gpu).name == "triton"
    capability["value"] = (8, 0)  # an A100
    assert dcmha.choose_auto(on_gpu).name == "triton"
    capability["value"] = (7, 5)  # a T4: no bf16 products in Triton
    assert dcmha.choose_auto(on_gpu).name == "compiled"
    capability["value"] = (9, 0)
    assert dcmha.choose_auto(gpu_call(training.num_scores - 1)).name == "eager"  # below the threshold
    monkeypatch.setattr(DCMHA_BACKENDS["triton"], "why_not", lambda *a: "Triton is not installed")
    assert dcmha.choose_auto(on_gpu).name == "compiled"
    monkeypatch.setattr(dcmha_compiled, "compile_supported", lambda device: False)
    assert dcmha.choose_auto(training).name == "eager"
    assert "torch.compile cannot generate code" in COMPILED.why_not(training)
    assert not dcmha.compile_supported(torch.device("meta"))


def test_a_triton_failure_is_remembered_and_auto_does_without_it(monkeypatch):
    """A Triton build that fails under "auto" (say, a GPU that Triton cannot compile for) is recorded on the backend:
    its why_not gives the reason from then on, so "auto" stops choosing it."""
    from modeling_dcformer.triton_kernel import TRITON

    monkeypatch.setattr(TRITON, "failure", None)
    monkeypatch.setattr(dcmha, "AUTO_COMPILE_MIN_SCORES", 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(DCMHA_BACKENDS["kernel"], "why_not", lambda *a: "not in this test")
    monkeypatch.setattr(dcmha_compiled, "compile_supported", lambda device: False)
    monkeypatch.setattr("modeling_dcformer.triton_kernel.unsupported", lambda device, rank: None)
    inputs = SimpleNamespace(composed=True, rank=2, **vars(gpu_call(1)))
    assert dcmha.choose_auto(inputs).name == "triton"
    TRITON.record_failure(RuntimeError("PTX for this GPU failed"))
    assert "PTX for this GPU failed" in TRITON.why_not(inputs)
    assert dcmha.choose_auto(inputs).name == "eager"


def test_auto_falls_back_to_eager_and_the_backend_remembers_the_failure(monkeypatch):
    """"auto" on a machine where torch.compile cannot build its code: a warning, eager's numbers, the failure kept on
    the backend object (not in a module global); asking for "compiled" itself then says why."""

    def broken(*args):
        raise RuntimeError("no C++ compiler worked")

    monkeypatch.setattr(COMPILED, "_stages", (broken, broken, broken))
    monkeypatch.setattr(COMPILED, "failure", None)  # restored afterwards: later tests compile again
    monkeypatch.setattr(DCMHA_BACKENDS["kernel"], "why_not", lambda *a: "not in this test")
    monkeypatch.setattr(dcmha, "AUTO_COMPILE_MIN_SCORES", 1)
    model = build_model(make_config(num_hidden_layers=1, dcmha_implementation="eager"))
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits
        model.config.dcmha_implementation = "auto"
        assert_close(model(ids).logits, expected)
        assert "no C++ compiler worked" in COMPILED.failure
        assert dcmha.choose_auto(probe_inputs()).name == "eager"
        model.config.dcmha_implementation = "compiled"
        with pytest.raises(ValueError, match='"compiled" cannot compute this attention: .*no C\\+\\+ compiler worked'):
            model(ids)


def test_a_users_own_backend(monkeypatch):
    """A backend registered by a user: a valid dcmha_implementation, called with the inputs object, its output
    used; a function is enough."""
    calls = []

    def mine(inputs: DCMHAInputs, *, output_attentions=False, recompute=False):
        calls.append(inputs.shapes)
        return DCMHA_BACKENDS["eager"](inputs, output_attentions=output_attentions, recompute=recompute)

    monkeypatch.setitem(DCMHAInterface._global_mapping, "placeholder", None)  # restores the mapping afterwards
    DCMHAInterface.register("mine", mine)
    try:
        with pytest.raises(ValueError, match="dcmha_implementation"):
            DCFormerConfig(hidden_size=32, num_attention_heads=4, dcmha_implementation="theirs")
        model = build_model(make_config(num_hidden_layers=2, dcmha_implementation="eager"))
        ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            expected = model(ids).logits
            model.config.dcmha_implementation = "mine"
            assert_close(model(ids).logits, expected)
        assert calls == [(2, 4, 7, 7, 8)] * 2
    finally:
        DCMHAInterface._global_mapping.pop("mine", None)
    with pytest.raises(ValueError, match='"auto" is the selection rule'):
        DCMHAInterface.register("auto", mine)


def test_unknown_or_unavailable_backends_are_clear_errors():
    inputs = probe_inputs()
    with pytest.raises(ValueError, match="not registered"):
        dcmha.dcmha_attention(inputs, "flash")
    missing = dcmha.LazyBackend("nothing", "no_such_module", "X")
    assert "pip install modeling-dcformer" in missing.why_not(inputs)
    with pytest.raises(ValueError, match="unavailable"):
        missing(inputs)


def test_bad_implementation_in_the_config_is_a_clear_error():
    with pytest.raises(ValueError, match="dcmha_implementation"):
        DCFormerConfig(hidden_size=32, num_attention_heads=4, dcmha_implementation="flash")


def test_implementation_survives_save_and_load(tmp_path):
    from modeling_dcformer import DCFormerForCausalLM

    config = make_config(dcmha_implementation="eager")
    DCFormerForCausalLM(config).save_pretrained(tmp_path)
    assert DCFormerConfig.from_pretrained(tmp_path).dcmha_implementation == "eager"


def test_backend_base_class_is_the_interface():
    class Half(DCMHABackend):
        name = "half"

    backend = Half()
    assert backend.why_not(probe_inputs()) is None
    with pytest.raises(NotImplementedError):
        backend(probe_inputs())
    backend.record_failure(RuntimeError("boom"))
    assert "boom" in backend.why_not(probe_inputs())
