"""Assisted and prompt-lookup decoding with local (sliding-window) layers, and the cache roll-back they need.

`generate` checks candidate tokens in one forward pass and then crops the cache back to the accepted ones. A local
layer keeps only its window, so the roll-back works as in transformers' `DynamicSlidingWindowLayer`: after
`activate_past_recording()` the layer also keeps every key added since the last crop. The tokens are checked
against greedy search computed with the float64 oracle (full recompute, no cache); the cache states against the
oracle's logits and against a cache that never saw the rolled-back tokens.
"""

import pytest
import torch

from helpers import as_double, build_model, make_config
from modeling_dcformer import DCFormerCache
from modeling_dcformer.cache_dcformer import DCFormerCacheLayer
from oracle import oracle_causal_lm

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

WINDOW = 4
NEW_TOKENS = 20
# repeated n-grams: prompt lookup proposes candidates from the start (some accepted, some rejected)
PROMPT = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6]


def local_config(**overrides):
    """Two layers, the first local with a window of 4 (smaller than the 30 tokens generated), the second global."""
    return make_config(num_hidden_layers=2, window_size=WINDOW, window_type="LG", eos_token_id=None, **overrides)


@pytest.fixture(scope="module")
def model():
    return build_model(local_config())


@pytest.fixture(scope="module")
def expected(model):
    """Greedy search from the oracle: each next token the argmax of the full recomputed logits, in float64."""
    state = as_double(model.state_dict())
    ids = torch.tensor([PROMPT])
    for _ in range(NEW_TOKENS):
        nxt = oracle_causal_lm(state, model.config, ids)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], 1)
    return ids


def near_copy(model, std=0.02, seed=7):
    """Another DCFormer with the same vocabulary and windows: the model's weights plus noise, so that its
    candidates are mostly, but not always, the model's own tokens."""
    other = build_model(model.config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mine, theirs in zip(model.parameters(), other.parameters()):
            theirs.copy_(mine + std * torch.randn(mine.shape, generator=gen))
    return other


class CropLog:
    """Wraps `DCFormerCacheLayer.crop`: records, per call on a local layer, (tokens removed, keys kept after it,
    tokens the keys' storage holds after it)."""

    def __init__(self, monkeypatch):
        self.local = []
        original = DCFormerCacheLayer.crop

        def crop(layer, tokens_to_remove):
            before = layer.cumulative_length
            original(layer, tokens_to_remove)
            if layer.window_size is not None and layer.is_initialized:
                removed = before - layer.cumulative_length
                self.local.append((removed, layer.keys.shape[-2], storage_tokens(layer)))

        monkeypatch.setattr(DCFormerCacheLayer, "crop", crop)


def storage_tokens(layer) -> int:
    """How many tokens' keys the storage behind `layer.keys` could hold (a view keeps its whole base alive)."""
    B, N, _, Dh = layer.keys.shape
    return layer.keys.untyped_storage().nbytes() // (B * N * Dh * layer.keys.element_size())


def count_forwards(model):
    calls = []
    handle = model.model.register_forward_hook(lambda *args: calls.append(1))
    return calls, handle


# ------------------------------------------------------------------------------------------------------------
# 1. generate(): assisted and prompt-lookup decoding equal greedy search
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "attention-mask"])
def test_prompt_lookup_decoding_with_local_layers_equals_greedy(model, expected, monkeypatch, masked):
    ids = torch.tensor([PROMPT])
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False)
    if masked:
        kwargs["attention_mask"] = torch.ones_like(ids)
    with torch.no_grad():
        greedy = model.generate(ids, **kwargs)
        log = CropLog(monkeypatch)
        calls, handle = count_forwards(model)
        lookup = model.generate(ids, prompt_lookup_num_tokens=2, **kwargs)
        handle.remove()
    assert torch.equal(greedy, expected)
    assert torch.equal(lookup, expected)
    assert any(removed > 0 for removed, _, _ in log.local), "no candidate was rejected: the roll-back was not tested"
    assert len(calls) < NEW_TOKENS, "no candidate was accepted: every token took its own forward pass"
    assert max(kept for _, kept, _ in log.local) <= WINDOW - 1  # each crop takes the layer back to its window
    assert max(storage for _, _, storage in log.local) <= WINDOW - 1 + 3  # the window, a token and 2 candidates


def test_assisted_decoding_with_local_layers_equals_greedy(model, expected, monkeypatch):
    """The assistant (local layers too) drafts several tokens a round, one forward each; its cache is rolled back
    over several updates, the main model's over one."""
    ids = torch.tensor([PROMPT])
    assistant = near_copy(model)
    with torch.no_grad():
        log = CropLog(monkeypatch)
        calls, handle = count_forwards(model)
        got = model.generate(ids, assistant_model=assistant, max_new_tokens=NEW_TOKENS, do_sample=False)
        handle.remove()
        free = model.generate(ids, assistant_model=build_model(model.config, seed=5), max_new_tokens=NEW_TOKENS)
    assert torch.equal(got, expected)
    assert torch.equal(free, expected)  # an unrelated assistant: nearly every candidate rejected
    assert any(removed > 1 for removed, _, _ in log.local), "no multi-token roll-back happened"
    assert len(calls) < NEW_TOKENS, "no candidate was accepted"


def test_assisted_decoding_of_a_left_padded_row_with_attention_mask(model, expected):
    """A batch of one left-padded row (assisted decoding takes one row): the tokens of the row without padding."""
    ids = torch.tensor([[0, 0, 0] + PROMPT])
    mask = torch.tensor([[0, 0, 0] + [1] * len(PROMPT)])
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        lookup = model.generate(ids, prompt_lookup_num_tokens=2, **kwargs)
        assisted = model.generate(ids, assistant_model=near_copy(model), **kwargs)
    assert torch.equal(lookup[:, 3:], expected)
    assert torch.equal(assisted[:, 3:], expected)


def test_static_cache_prompt_lookup_and_assisted_decoding_equal_greedy(model, expected):
    """cache_implementation="static": the buffers keep every key, so a crop is exact; prompt lookup's last
    candidates may go past the generation's end, and the buffers have room for them."""
    ids = torch.tensor([PROMPT])
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        lookup = model.generate(ids, prompt_lookup_num_tokens=3, **kwargs)
        assisted = model.generate(ids, assistant_model=near_copy(model), **kwargs)
    assert torch.equal(lookup, expected)
    assert torch.equal(assisted, expected)


# ------------------------------------------------------------------------------------------------------------
# 2. The cache: roll-back, its limit, bounded memory
# ------------------------------------------------------------------------------------------------------------
def rand_ids(batch, length, seed):
    return torch.randint(1, 64, (batch, length), generator=torch.Generator().manual_seed(seed))


def assert_same_layers(cache, fresh):
    for mine, theirs in zip(cache.layers, fresh.layers):
        assert mine.cumulative_length == theirs.cumulative_length
        assert mine.keys.shape[-2] == theirs.keys.shape[-2]
        for a, b in ((mine.keys, theirs.keys), (mine.values, theirs.values), (mine.key_terms, theirs.key_terms)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("steps", [[4], [1, 1, 1]], ids=["one-update", "three-updates"])
def test_rolled_back_cache_equals_one_that_never_saw_the_rejected_tokens(model, steps):
    """Prefill 8 tokens; feed candidates whose first is right and the rest wrong (in one update, as the main
    model checks them, or one at a time, as an assistant drafts them); roll back the wrong ones; continue. The
    logits equal the oracle's for the accepted sequence, and the cache equals one fed only the accepted tokens."""
    ids = rand_ids(2, 14, seed=1)
    wrong = rand_ids(2, sum(steps), seed=2)
    wrong[:, 0] = ids[:, 8]
    reference = oracle_causal_lm(as_double(model.state_dict()), model.config, ids)
    with torch.no_grad():
        cache = DCFormerCache(model.config)
        cache.activate_past_recording()
        model(ids[:, :8], past_key_values=cache)
        cache.crop(0)
        start = 0
        for step in steps:
            model(wrong[:, start : start + step], past_key_values=cache)
            start += step
        cache.crop(-(sum(steps) - 1))
        assert cache.get_seq_length() == 9
        fresh = DCFormerCache(model.config)
        model(ids[:, :9], past_key_values=fresh)
        assert_same_layers(cache, fresh)
        logits = model(ids[:, 9:], past_key_values=cache).logits
    torch.testing.assert_close(logits.double(), reference[:, 9:], rtol=1e-4, atol=1e-4)


def test_crop_keeps_the_first_tokens_when_positive_and_goes_back_to_the_window(model):
    """crop(n > 0) keeps the first n tokens (the convention before transformers 5): a local layer may go back to
    any length from the one before its last update."""
    ids = rand_ids(1, 12, seed=3)
    reference = oracle_causal_lm(as_double(model.state_dict()), model.config, ids)
    with torch.no_grad():
        cache = DCFormerCache(model.config)
        cache.activate_past_recording()
        model(ids[:, :6], past_key_values=cache)
        cache.crop(0)  # back to the window: the last 3 keys of the local layer
        assert cache.layers[0].keys.shape[-2] == WINDOW - 1
        model(rand_ids(1, 5, seed=4), past_key_values=cache)  # 6..10, all wrong
        cache.crop(6)
        assert cache.get_seq_length() == 6 and cache.layers[0].keys.shape[-2] == WINDOW - 1
        logits = model(ids[:, 6:], past_key_values=cache).logits
    torch.testing.assert_close(logits.double(), reference[:, 6:], rtol=1e-4, atol=1e-4)


def test_cropping_further_back_than_the_layer_kept_is_an_error(model):
    ids = rand_ids(1, 10, seed=5)
    with torch.no_grad():
        cache = DCFormerCache(model.config)  # not recording: the local layer keeps only its window
        model(ids[:, :8], past_key_values=cache)
        with pytest.raises(ValueError, match=r"window_size=4\): it can roll back at most 0.*activate_past_recording"):
            cache.crop(-1)
        assert cache.get_seq_length() == 8  # nothing changed

        cache = DCFormerCache(model.config)
        cache.activate_past_recording()
        model(ids[:, :8], past_key_values=cache)
        cache.crop(0)
        model(ids[:, 8:10], past_key_values=cache)
        with pytest.raises(ValueError, match=r"cannot crop 3 of the 10 tokens .* at most 2"):
            cache.crop(-3)
        cache.crop(-2)  # the limit itself is fine
        assert cache.get_seq_length() == 8

        short = DCFormerCache(model.config)  # fewer tokens than the window: nothing dropped, anything can go
        model(ids[:, :3], past_key_values=short)
        short.crop(-3)
        assert short.get_seq_length() == 0

    global_first = build_model(local_config(layer_types=["full_attention", "sliding_attention"]))
    with torch.no_grad():
        cache = DCFormerCache(global_first.config)
        global_first(ids[:, :8], past_key_values=cache)
        with pytest.raises(ValueError, match="can roll back at most 0"):
            cache.crop(-1)
    assert [layer.get_seq_length() for layer in cache.layers] == [8, 8]  # the refused crop changed no layer


def test_local_layer_storage_stays_within_the_window(model):
    """Memory does not grow with the sequence: after a long prefill and at every decoding step, without
    recording, the local layer's keys (and the storage behind them) hold at most the window; while recording,
    the window plus the tokens since the last crop."""
    ids = rand_ids(1, 60, seed=6)
    with torch.no_grad():
        cache = DCFormerCache(model.config)
        model(ids[:, :30], past_key_values=cache)
        layer = cache.layers[0]
        sizes = [(layer.keys.shape[-2], storage_tokens(layer))]
        for t in range(30, 60):
            model(ids[:, t : t + 1], past_key_values=cache)
            sizes.append((layer.keys.shape[-2], storage_tokens(layer)))
        assert max(kept for kept, _ in sizes) == WINDOW - 1
        assert max(storage for _, storage in sizes) <= WINDOW
        assert layer.key_terms.shape[1] == WINDOW - 1 and layer.key_terms.untyped_storage().nbytes() <= (
            WINDOW * layer.key_terms[:, :1].numel() * layer.key_terms.element_size()
        )

        cache = DCFormerCache(model.config)
        cache.activate_past_recording()
        model(ids[:, :30], past_key_values=cache)
        cache.crop(0)  # a recording layer keeps what it was given until the next crop
        layer = cache.layers[0]
        sizes = [storage_tokens(layer)]
        for t in range(30, 58, 4):
            model(ids[:, t : t + 4], past_key_values=cache)  # 4 candidates, 2 of them rejected
            sizes.append(layer.keys.shape[-2])
            cache.crop(-2)
            sizes.append(storage_tokens(layer))
        assert max(sizes) <= WINDOW - 1 + 4
        assert layer.keys.shape[-2] == WINDOW - 1


def test_static_cache_crop_zero_removes_nothing(model):
    """crop(0) is what assisted decoding calls after a round with every candidate accepted."""
    ids = rand_ids(1, 8, seed=7)
    with torch.no_grad():
        cache = DCFormerCache(model.config, max_cache_len=10)
        model(ids[:, :6], past_key_values=cache)
        cache.crop(0)
        assert cache.get_seq_length() == 6 and cache.is_croppable
