"""generate(cache_implementation="static") with the model's forward under torch.compile, as transformers users do
for speed (`model.forward = torch.compile(model.forward)`): the same greedy tokens as eager generation.

transformers 5.24 compiles generate's decode steps by itself only on an accelerator and only when the cache says it
is compileable; DCFormer's static cache attends to views of its filled part (shapes that grow), so it says it is not,
and the compile is the user's `torch.compile`. With the "aot_eager" backend (dynamo's graph capture, guards and
recompilations, AOTAutograd; no code generation) the test takes seconds and runs by default (marked slow); with
inductor, what users get by default, it compiles C++ for a few graphs: minutes on a 2-core CPU, so it is opt-in
(`pytest -m expensive`).
"""

import pytest
import torch

from helpers import assert_compiled_generation_equals, build_model, make_config

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

NEW = 6


@pytest.mark.parametrize("backend", [
    pytest.param("aot_eager", marks=pytest.mark.expensive),  # ~1.5 min of tracing: -m expensive
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
