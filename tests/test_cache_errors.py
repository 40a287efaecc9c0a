"""Caches and cache implementations DCFormer cannot use are refused with one clear line; the ones it can use work.

DCFormer's cache holds each key's composition factors besides its key and value, so transformers' caches of keys and
values (StaticCache, QuantizedCache, offloading ones, EncoderDecoderCache) cannot serve it. An empty plain
DynamicCache (what generic transformers code builds) is accepted and replaced by a growing DCFormerCache, which is
what it stands for. `generate()` with an empty prompt is refused before it fails deep inside.
"""

import pytest
import torch
from transformers import DynamicCache, EncoderDecoderCache, GenerationConfig, StaticCache
from transformers.generation.configuration_utils import ALL_CACHE_IMPLEMENTATIONS

from helpers import build_model, make_config
from modeling_dcformer import DCFormerCache

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

NEW = 5
HINT = "DCFormerCache(model.config, max_cache_len=N)"


@pytest.fixture(scope="module")
def model():
    config = make_config(num_hidden_layers=2, window_size=4, window_type="LG", eos_token_id=None)
    return build_model(config).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def greedy(model, ids):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)


def generate(model, ids, **kwargs):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0, **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# cache objects
# ---------------------------------------------------------------------------------------------------------------
def foreign_caches(config):
    """Cache objects of transformers that DCFormer cannot use (each empty: the refusal is about the kind)."""
    return {
        "StaticCache": lambda: StaticCache(config=config, max_cache_len=32),
        "offloading DynamicCache": lambda: DynamicCache(offloading=True),
        "EncoderDecoderCache": lambda: EncoderDecoderCache(DynamicCache(), DynamicCache()),
        "tuple": lambda: ((torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)),),
    }


@pytest.mark.parametrize("kind", ["StaticCache", "offloading DynamicCache", "EncoderDecoderCache", "tuple"])
@pytest.mark.parametrize("argument", ["cache", "past_key_values"])
def test_a_cache_dcformer_cannot_use_is_refused_by_generate_and_forward(model, ids, kind, argument):
    make = foreign_caches(model.config)[kind]
    with pytest.raises(TypeError) as exc:
        generate(model, ids, **{argument: make()})
    message = str(exc.value)
    assert HINT in message and 'cache_implementation="static"' in message, message
    assert "\n" not in message
    if kind == "StaticCache":
        assert "transformers' StaticCache" in message
    with pytest.raises(TypeError, match=r"DCFormerCache\(model.config, max_cache_len=N\)"):
        with torch.no_grad():
            model(ids, **{argument: make()})


def test_a_filled_dynamic_cache_is_refused(model, ids):
    cache = DynamicCache()
    cache.update(torch.zeros(2, 4, 3, 8), torch.zeros(2, 4, 3, 8), layer_idx=0)
    with pytest.raises(TypeError, match=r"filled DynamicCache \(3 tokens\).*composition factors"):
        with torch.no_grad():
            model(ids, cache=cache)


@pytest.mark.parametrize("make", [DynamicCache, "with config"], ids=["DynamicCache()", "DynamicCache(config=...)"])
def test_an_empty_dynamic_cache_stands_for_a_growing_dcformer_cache(model, ids, greedy, make):
    """The legitimate neighbour: generic code's empty DynamicCache works in generate and forward, with the tokens
    and logits of DCFormer's own cache."""
    new = (lambda: DynamicCache(config=model.config)) if make == "with config" else make
    assert torch.equal(generate(model, ids, cache=new()), greedy)
    with torch.no_grad():
        out = model(ids, cache=new(), use_cache=True)
        ref = model(ids, use_cache=True)
    assert isinstance(out.cache, DCFormerCache) and out.cache.get_seq_length() == ids.shape[1]
    assert torch.equal(out.logits, ref.logits)


@pytest.mark.parametrize("max_cache_len", [None, 32])
def test_dcformer_caches_given_to_generate_work(model, ids, greedy, max_cache_len):
    cache = DCFormerCache(model.config, max_cache_len=max_cache_len)
    assert torch.equal(generate(model, ids, cache=cache), greedy)
    assert cache.get_seq_length() == ids.shape[1] + NEW - 1


# ---------------------------------------------------------------------------------------------------------------
# cache_implementation
# ---------------------------------------------------------------------------------------------------------------
UNSUPPORTED = sorted(set(ALL_CACHE_IMPLEMENTATIONS + ("paged",)) - {"dynamic", "static"})


def test_the_unsupported_list_covers_transformers_deprecated_values():
    assert {"hybrid", "sliding_window", "offloaded", "quantized", "offloaded_static"} <= set(UNSUPPORTED)


@pytest.mark.parametrize("implementation", UNSUPPORTED)
def test_an_unsupported_cache_implementation_is_refused(model, ids, implementation):
    """transformers turns "hybrid" into its default cache silently; DCFormer refuses it, and every other value it
    cannot honour, naming the value and what to use."""
    with pytest.raises(ValueError) as exc:
        generate(model, ids, cache_implementation=implementation)
    message = str(exc.value)
    assert f"cache_implementation={implementation!r} is not supported by DCFormer" in message, message
    assert HINT in message and "\n" not in message


def test_an_unsupported_cache_implementation_in_a_generation_config_is_refused(model, ids):
    config = GenerationConfig(max_new_tokens=NEW, do_sample=False, pad_token_id=0, cache_implementation="hybrid")
    with pytest.raises(ValueError, match="cache_implementation='hybrid' is not supported by DCFormer"):
        with torch.no_grad():
            model.generate(ids, generation_config=config)


@pytest.mark.parametrize("implementation", [None, "dynamic", "static"])
def test_supported_cache_implementations_generate_the_same_tokens(model, ids, greedy, implementation):
    assert torch.equal(generate(model, ids, cache_implementation=implementation), greedy)


# ---------------------------------------------------------------------------------------------------------------
# empty prompt
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch", [1, 2])
def test_generate_with_an_empty_prompt_is_a_clear_error(model, batch):
    with pytest.raises(ValueError) as exc:
        generate(model, torch.zeros(batch, 0, dtype=torch.long))
    message = str(exc.value)
    assert f"empty prompt: input_ids of shape ({batch}, 0)" in message and "\n" not in message, message
    embeds = torch.zeros(batch, 0, model.config.hidden_size)
    with pytest.raises(ValueError, match=rf"empty prompt: inputs_embeds of shape \({batch}, 0, "):
        with torch.no_grad():
            model.generate(inputs_embeds=embeds, max_new_tokens=NEW, do_sample=False, pad_token_id=0)


def test_generate_from_one_token_or_from_nothing_works(model):
    """The neighbours of the empty prompt: a one-token prompt, and no prompt at all (generate starts from BOS)."""
    one = torch.tensor([[model.config.bos_token_id]])
    from_one = generate(model, one)
    assert from_one.shape == (1, 1 + NEW)
    with torch.no_grad():
        from_nothing = model.generate(max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                                      bos_token_id=model.config.bos_token_id)
    assert torch.equal(from_nothing, from_one)
