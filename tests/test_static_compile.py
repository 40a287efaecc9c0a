"""generate(cache_implementation="static") and torch.compile: the decoding step compiled as transformers compiles
Llama's.

DCFormer's static cache (`DCFormerStaticCacheLayer`) is compileable: buffers of max_cache_len tokens written in place,
and its length a tensor on the buffers' device, advanced in place; a traced decode step attends to the whole buffers,
masked, so that every step has the same shapes. Shown here: the model's forward has no graph break on a decode step
(`torch._dynamo.explain`, `fullgraph=True`), one graph serves every step, and the compiled greedy tokens are the eager
ones, by each route:
- `torch.compile(model.forward, fullgraph=True)` on single steps;
- `generate()` compiling the step itself, as it does for Llama: on an accelerator whenever the cache `is_compileable`
  (`_valid_auto_compile_criteria`, asked with a CUDA device faked), on the CPU where its compile config says so
  (`_compile_all_devices`, as transformers' own tests do);
- `model.forward = torch.compile(model.forward, dynamic=True)` around `generate()`, as users write it.
"aot_eager" (dynamo's graph capture, guards and recompilations, AOTAutograd; no code generation) runs by default;
Inductor compiles C++ for the graphs (minutes on a 2-core CPU), so it is opt-in (`pytest -m expensive`).
"""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from transformers import CompileConfig, GenerationConfig

from helpers import assert_compiled_generation_equals, build_model, make_config
from modeling_dcformer import DCFormerCache, DCFormerForCausalLM
from modeling_dcformer.modeling_dcformer import CACHE_NAME

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

NEW = 6
CACHE_LEN = 16


@pytest.fixture(scope="module")
def model():
    config = make_config(num_hidden_layers=2, window_size=4, window_type="LG", use_qk_norm=True, eos_token_id=None)
    return build_model(config).eval()


@pytest.fixture(scope="module")
def prompt():
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # a left-padded row: the padding mask is applied under compile too
    return ids, mask


@pytest.fixture
def dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def test_the_static_cache_keeps_its_length_on_the_device_and_hands_out_whole_buffers(model, prompt):
    """What makes a step's shapes static: the layers return their whole buffers from key 0, and the length is one
    0-dim tensor, advanced, cropped and reset in place (a compiled step reads it, never a Python number)."""
    ids, _ = prompt
    cache = DCFormerCache(model.config, max_cache_len=CACHE_LEN)
    assert cache.is_compileable and not DCFormerCache(model.config).is_compileable
    with torch.no_grad():
        model(ids[:, :5], cache=cache, use_cache=True)
        layer = cache.layers[0]
        length = layer.cumulative_length
        assert isinstance(length, torch.Tensor) and length.dim() == 0 and int(cache.get_seq_length()) == 5
        model(ids[:, 5:6], cache=cache, use_cache=True)
    key = torch.zeros(2, model.config.num_attention_heads, 1, model.config.head_dim)
    keys, values, terms, key_start = cache.update_dcmha(key, key, None, 1)  # a layer: its whole buffers
    assert keys.shape[2] == values.shape[2] == CACHE_LEN and key_start == 0 and keys is cache.layers[1].keys
    assert layer.cumulative_length is length and int(length) == 6
    cache.crop(-2)
    assert int(length) == 4 and cache.layers[1].cumulative_length.item() == 5  # the one more token fed to it
    cache.crop(3)
    assert int(length) == 3
    cache.reset()
    assert layer.cumulative_length is length and int(length) == 0


def static_step_inputs(model, cache, ids, mask, t):
    """What generate() passes the model for token t: the padding mask widened to the cache (its
    `create_masks_for_generate`) and the positions."""
    step_mask = model.create_masks_for_generate(attention_mask=mask[:, : t + 1], cache=cache)
    positions = (mask[:, : t + 1].cumsum(-1) - 1).clamp(min=0)[:, t:].contiguous()  # generate's are contiguous
    return dict(input_ids=ids[:, t : t + 1], attention_mask=step_mask, position_ids=positions, use_cache=True,
                **{CACHE_NAME: cache})


def test_a_decode_step_traces_whole_and_one_graph_serves_every_step(model, prompt, dynamo):
    """After an eager prefill (left padding, a local and a global layer, qk-norm), a decode step traces into one graph
    with no break (`torch._dynamo.explain`), compiles with fullgraph=True, and that one graph serves the later steps
    (no recompilation: nothing in a step changes but tensors' values); the logits are eager's."""
    ids, mask = prompt
    longer = torch.cat([ids, torch.randint(0, 64, (2, 3), generator=torch.Generator().manual_seed(1))], 1)
    longer_mask = torch.cat([mask, torch.ones(2, 3, dtype=mask.dtype)], 1)
    caches = [DCFormerCache(model.config, max_cache_len=CACHE_LEN) for _ in range(3)]
    with torch.no_grad():
        for cache in caches:
            model(ids[:, :6], attention_mask=mask[:, :6], cache=cache, use_cache=True)
        explained = torch._dynamo.explain(model.forward)(**static_step_inputs(model, caches[0], longer, longer_mask, 6))
        assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(model.forward, backend=counter, fullgraph=True)
        for t in range(6, 10):
            got = compiled(**static_step_inputs(model, caches[1], longer, longer_mask, t)).logits
            want = model(**static_step_inputs(model, caches[2], longer, longer_mask, t)).logits
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert counter.frame_count == 1  # one graph for the four steps


def test_generate_compiles_the_decode_step_when_the_cache_is_static(model, prompt, monkeypatch, dynamo):
    """transformers' own rule (`_valid_auto_compile_criteria`): on a CUDA device (faked) generate() compiles the
    decoding step with the static cache, as for Llama, and not with the growing one. On the CPU, told to
    (`_compile_all_devices`): one graph, through aot_eager, serves every decode step of two generations, and the
    greedy tokens are the eager ones."""
    ids, mask = prompt
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    with monkeypatch.context() as patched:
        patched.setattr(DCFormerForCausalLM, "device", property(lambda self: torch.device("cuda")))
        static = {CACHE_NAME: DCFormerCache(model.config, max_cache_len=CACHE_LEN)}
        assert model._valid_auto_compile_criteria(static, GenerationConfig())
        assert not model._valid_auto_compile_criteria({CACHE_NAME: DCFormerCache(model.config)}, GenerationConfig())
    with torch.no_grad():
        eager = model.generate(ids, cache_implementation="static", **kwargs)
        assert torch.equal(eager, model.generate(ids, **kwargs))  # the static cache gives the growing one's tokens
    compile_config = CompileConfig(backend="aot_eager", fullgraph=True)
    compile_config._compile_all_devices = True
    try:
        with torch.no_grad():
            for _ in range(2):
                got = model.generate(ids, cache_implementation="static", compile_config=compile_config, **kwargs)
                assert torch.equal(got, eager)
    finally:  # the module's model, for the next tests: without transformers' compiled call
        model.__dict__.pop("_compiled_call", None)
        model.__dict__.pop("_last_compile_config", None)
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("backend", [
    pytest.param("aot_eager", marks=pytest.mark.slow),  # ~20 s: a prefill graph with dynamic lengths, the steps'
    pytest.param("inductor", marks=pytest.mark.expensive),
])
def test_compiled_static_cache_greedy_generation_equals_eager(backend):
    config = make_config(num_hidden_layers=2, window_size=4, window_type="LG", eos_token_id=None)
    model = build_model(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # a left-padded row: the padding mask is applied under compile too
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                  cache_implementation="static")
    with torch.no_grad():
        eager = model.generate(ids, **kwargs)
        dynamic_cache = model.generate(ids, **{**kwargs, "cache_implementation": None})
    assert torch.equal(eager, dynamic_cache)

    assert_compiled_generation_equals(model, lambda: model.generate(ids, **kwargs), eager, backend)
