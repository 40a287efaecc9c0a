"""One conformance suite for every DCMHA backend in the registry (`modeling_dcformer.dcmha.DCMHA_BACKENDS`), and the
registry itself.

Each built-in backend ("eager", "compiled" through torch.compile's cheap `aot_eager` backend, "cpu", "triton"
in Triton's CPU interpreter) against the float64 oracle and the eager reference: logits with padding, windows,
qk-norm, groups and query-wise composition; gradients; the returned probabilities; cached decoding; half precision;
and a clear error for what it cannot do. A backend that cannot run on this machine is skipped, naming why.
The registry: "auto"'s rule, failures remembered on the backend object, a user's own backend, the old name "kernel".
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
    registered,
)
from modeling_dcformer import DCFormerConfig, dcmha, dcmha_compiled
from modeling_dcformer.dcmha import DCMHA_BACKENDS, DCMHABackend, DCMHAInputs, DCMHAInterface
from modeling_dcformer.dcmha_compiled import COMPILED

pytestmark = pytest.mark.usefixtures("one_thread_each_test", "aot_eager_compile")

BUILT_IN = ["eager", "compiled", "cpu", "triton"]
# what each built-in backend computes (the conformance checks follow from it)
GRADIENTS = {"eager": True, "compiled": True, "cpu": True, "triton": True}


def probe_inputs(requires_grad: bool = False) -> DCMHAInputs:
    """A small composed attention call on this machine's device for the tests."""
    gen = torch.Generator().manual_seed(0)
    B, N, T, Dh, G, I = 1, 4, 5, 8, 1, 2
    q, k, v = (torch.randn(B, N, T, Dh, generator=gen).requires_grad_(requires_grad) for _ in range(3))
    terms = torch.randn(B, T, G, 2, 2 * I + 1, N // G, generator=gen)
    return DCMHAInputs(q, k, v, terms, terms.clone(), 0, 0, None, None, I, G, 4)


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
TRITON_EXPENSIVE = ["eager", "compiled", "cpu", pytest.param("triton", marks=EXPENSIVE)]  # gradients
# decoding: also "compiled" (each decode step a chunk of one query; on CPU "auto" decodes with the kernel, and
# "compiled"'s forward is checked by the logits test)
DECODE_BACKENDS = ["eager", pytest.param("compiled", marks=EXPENSIVE), "cpu", pytest.param("triton", marks=EXPENSIVE)]


OPTIONS = {
    "chunk4": dict(query_wise=False, num_head_groups=1, dynamic_rank=2, attention_chunk_size=4),
    "querywise-groups2": dict(query_wise=True, num_head_groups=2, dynamic_rank=1, attention_chunk_size=512),
    "rank3-groups2-chunk5": dict(query_wise=False, num_head_groups=2, dynamic_rank=3, attention_chunk_size=5),
    # grouped-query attention: 2 key/value heads for 4 query heads, head_dim 12 (4 x 12 != hidden 32), no o bias
    "gqa2-headdim12": dict(num_key_value_heads=2, head_dim=12, attention_output_bias=False, query_wise=False,
                           num_head_groups=2, dynamic_rank=2, attention_chunk_size=5),
}
# The gradient, probability, decoding and half-precision checks share one configuration (local and global layers,
# two head groups, rank 2, chunks of 5): "compiled" traces its stages once per static configuration (groups, rank,
# window, scale), and the tests after the first reuse its graphs.
SHARED = dict(use_qk_norm=True, window_size=4, num_head_groups=2, attention_chunk_size=5)
# the same with grouped-query attention: one key/value head for two query heads, which each backend's products and
# the cache take without a copy per query head
SHARED_GQA = dict(SHARED, num_key_value_heads=2, head_dim=12)
SHARED_SETS = {"mha": SHARED, "gqa": SHARED_GQA}


@pytest.mark.parametrize(
    "backend, options",
    [(b, o) for b in BUILT_IN for o in OPTIONS if b != "compiled" or o in ("querywise-groups2", "gqa2-headdim12")]
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


@pytest.mark.parametrize("shared", list(SHARED_SETS))
@pytest.mark.parametrize("backend", TRITON_EXPENSIVE)
def test_gradients_match_eager(backend, shared):
    """A training step (local and global layers, padding on both sides, chunks recomputed in the backward pass):
    logits and every parameter's gradient against "eager"; a backend without gradients says so."""
    backend = usable(backend)
    config = make_config(dcmha_implementation="eager", **SHARED_SETS[shared])
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


@pytest.mark.parametrize("shared", list(SHARED_SETS))
@pytest.mark.parametrize("backend", DECODE_BACKENDS)
def test_decoding_matches_full_forward(backend, shared):
    backend = usable(backend)
    config = make_config(dcmha_implementation=backend, **SHARED_SETS[shared])
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


class StandIn(DCMHABackend):
    """A backend for the rule's tests: its name, its rank, and what it refuses (a predicate of the call)."""

    def __init__(self, name: str, auto_rank: int | None, refuses=lambda inputs: False):
        self.name, self.auto_rank, self.refuses = name, auto_rank, refuses

    def why_not(self, inputs, output_attentions=False):
        return self.failure or ("refused" if self.refuses(inputs) else None)


def gpu_call(num_scores: int):
    """What the built-in backends' rules read of a call (its size, device, rank), for a call on a CUDA GPU this
    machine may not have."""
    query = SimpleNamespace(device=torch.device("cuda", 0), is_cpu=False, shape=(1, 4, 5, 8))
    key = SimpleNamespace(shape=(1, 2, 5, 8))  # grouped-query attention: two key/value heads
    return SimpleNamespace(num_scores=num_scores, query=query, key=key, value=key, composed=True, rank=2)


def test_auto_is_the_highest_ranked_backend_that_takes_the_call():
    """"auto" is a pure function of the call and the backends: the highest `auto_rank` whose `why_not_auto` has no
    objection and that has not failed here; a backend without a rank is never chosen; "eager" when none takes it."""
    call = probe_inputs()
    big = StandIn("big", 20, refuses=lambda inputs: inputs.num_scores < 1000)
    small, unranked = StandIn("small", 10), StandIn("unranked", None)
    assert dcmha.choose_auto(call, backends=[small, big, unranked]) is small  # `big` refuses 100 scores
    assert dcmha.choose_auto(gpu_call(1000), backends=[small, big, unranked]) is big
    assert dcmha.choose_auto(call, backends=[unranked]).name == "eager"
    small.record_failure(RuntimeError("its build failed"))
    assert dcmha.choose_auto(call, backends=[small, big]).name == "eager"
    assert "its build failed" in small.why_not(call)


def test_the_built_in_backends_rules_for_auto():
    """The built-ins' own rules, applied by `choose_auto` to a list of them: on CPU "cpu" for inference and training
    (where it builds); on a CUDA GPU, for calls of at least the backends' minimum of scores, "triton" from compute
    capability 8.0 (Triton multiplies bf16 only from Ampere on), else "compiled"; "eager" below the minimum."""
    from modeling_dcformer.kernels import CPU, TritonBackend

    cpu_ok = CPU.why_not(probe_inputs()) is None
    training = probe_inputs(requires_grad=True)
    with torch.no_grad():
        assert dcmha.choose_auto(probe_inputs()).name == ("cpu" if cpu_ok else "eager")
    assert dcmha.choose_auto(training).name == ("cpu" if cpu_ok else "eager")  # the registered backends
    assert dcmha.choose_auto(training, backends=[COMPILED]).name == "eager"  # 4 x 5 x 5 scores: below the minimum
    compiled = dcmha_compiled.CompiledBackend(auto_min_scores=training.num_scores)
    assert dcmha.choose_auto(training, backends=[compiled]) is compiled
    capability = {"value": (9, 0)}  # an H100 / H200
    triton = TritonBackend(auto_min_scores=100, device_capability=lambda device: capability["value"])
    on_gpu, backends = gpu_call(100), [CPU, triton, dcmha_compiled.CompiledBackend(auto_min_scores=100)]
    assert "runs on CPU" in CPU.why_not(on_gpu)
    if triton.why_not(on_gpu) is None:  # Triton is installed
        assert dcmha.choose_auto(on_gpu, backends=backends) is triton
        capability["value"] = (8, 0)  # an A100
        assert dcmha.choose_auto(on_gpu, backends=backends) is triton
    capability["value"] = (7, 5)  # a T4: no bf16 products in Triton
    assert dcmha.choose_auto(on_gpu, backends=backends).name == "compiled"
    assert dcmha.choose_auto(gpu_call(99), backends=backends).name == "eager"  # below the minimum
    assert dcmha.choose_auto(training, backends=[triton]).name == "eager"  # the CPU: there Triton would only interpret
    assert not dcmha.compile_supported(torch.device("meta"))


def test_a_triton_failure_is_remembered_and_auto_does_without_it():
    """A Triton build that fails under "auto" (say, a GPU that Triton cannot compile for) is recorded on the backend:
    its why_not gives the reason from then on, so "auto" stops choosing it."""
    from modeling_dcformer.kernels import TritonBackend

    triton = TritonBackend(auto_min_scores=1, device_capability=lambda device: (9, 0))
    inputs = gpu_call(1)
    if triton.why_not(inputs) is not None:
        pytest.skip(f"Triton cannot run here: {triton.why_not(inputs)}")
    assert dcmha.choose_auto(inputs, backends=[triton]) is triton
    triton.record_failure(RuntimeError("PTX for this GPU failed"))
    assert "PTX for this GPU failed" in triton.why_not(inputs)
    assert dcmha.choose_auto(inputs, backends=[triton]).name == "eager"


def test_auto_falls_back_to_eager_and_the_backend_remembers_the_failure():
    """"auto" on a machine where torch.compile cannot build its code: a warning, eager's numbers, the failure kept on
    the backend object (not in a module global); asking for "compiled" itself then says why."""

    def broken(*args):
        raise RuntimeError("no C++ compiler worked")

    compiled = dcmha_compiled.CompiledBackend(auto_min_scores=1)
    compiled._stages = (broken, broken, broken)  # its compiled stages, as a machine that cannot build them gets
    model = build_model(make_config(num_hidden_layers=1, dcmha_implementation="eager"))
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), registered("compiled", compiled), registered("cpu", None):
        expected = model(ids).logits
        model.config.dcmha_implementation = "auto"
        assert_close(model(ids).logits, expected)
        assert "no C++ compiler worked" in compiled.failure
        assert dcmha.choose_auto(probe_inputs()).name == "eager"
        model.config.dcmha_implementation = "compiled"
        with pytest.raises(ValueError, match='"compiled" cannot compute this attention: .*no C\\+\\+ compiler worked'):
            model(ids)


def test_a_users_own_backend():
    """A backend registered by a user: a valid dcmha_implementation, called with the inputs object, its output
    used; a function is enough."""
    calls = []

    def mine(inputs: DCMHAInputs, *, output_attentions=False, recompute=False):
        calls.append(inputs.shapes)
        return DCMHA_BACKENDS["eager"](inputs, output_attentions=output_attentions, recompute=recompute)

    with registered("mine", mine):
        assert "mine" in dcmha.implementation_names()
        with pytest.raises(ValueError, match="dcmha_implementation"):
            DCFormerConfig(hidden_size=32, num_attention_heads=4, dcmha_implementation="theirs")
        model = build_model(make_config(num_hidden_layers=2, dcmha_implementation="eager"))
        ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            expected = model(ids).logits
            model.config.dcmha_implementation = "mine"
            assert_close(model(ids).logits, expected)
        assert calls == [(2, 4, 7, 7, 8)] * 2
        assert dcmha.choose_auto(probe_inputs()).name != "mine"  # a function has no rank: only by name
    assert "mine" not in dcmha.implementation_names()
    for name in ("auto", "kernel"):
        with pytest.raises(ValueError, match="not a name a backend can take"):
            DCMHAInterface.register(name, mine)
    with pytest.raises(ValueError, match="cannot be removed"):
        DCMHAInterface.unregister("eager")


def test_unknown_or_unavailable_backends_are_clear_errors():
    """An unknown name; a built-in kernel where it is not registered (a save's remote code without the package)."""
    inputs = probe_inputs()
    with pytest.raises(ValueError, match="not registered"):
        dcmha.dcmha_attention(inputs, "flash")
    with registered("triton", None), pytest.raises(ValueError, match="unavailable here.*pip install modeling-dcformer"):
        dcmha.dcmha_attention(inputs, "triton")
    assert "triton" in dcmha.implementation_names()  # still a valid value: a config naming it loads anywhere


def test_the_old_name_kernel_is_cpu_with_a_deprecation_warning():
    """ "kernel", the CPU backend's old name, is still accepted everywhere an implementation is named, with a
    FutureWarning, and means "cpu"."""
    with pytest.warns(FutureWarning, match='"kernel" is now called "cpu"'):
        config = make_config(dcmha_implementation="kernel")
    assert config.dcmha_implementation == "cpu"
    model = build_model(make_config(num_hidden_layers=1, dcmha_implementation="eager"))
    with pytest.warns(FutureWarning, match='"kernel" is now called "cpu"'):
        model.set_attn_implementation("kernel")
    assert model.config.dcmha_implementation == "cpu"
    inputs = probe_inputs()
    with torch.no_grad():
        expected = dcmha.dcmha_attention(inputs, "eager")[0]
        with pytest.warns(FutureWarning, match="now called"):
            assert_close(dcmha.dcmha_attention(inputs, "kernel")[0], expected)


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
    assert backend.why_not(probe_inputs()) is None and backend.why_not_auto(probe_inputs()) is None
    assert backend.auto_rank is None and not backend.traced_as_eager  # by name only; traced as it is
    backend.prepare()  # nothing to build
    assert backend.project(*([None] * 4), 2, 1e-6) is None  # the model's own projection
    with pytest.raises(NotImplementedError):
        backend(probe_inputs())
    backend.record_failure(RuntimeError("boom"))
    assert "boom" in backend.why_not(probe_inputs())
