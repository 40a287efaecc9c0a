"""Behavioural tests of the DCFormer causal LM: registration and serialisation, config validation, loss,
padding, the DCMHA cache, generation, outputs, gradient checkpointing, dtypes and attention chunking.

Every equivalence test randomises the dynamic-weight projections (`dyn_w_proj`, std 0.5; see conftest) so the
composition terms move the logits as much as the rest of the model does.
"""

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from modeling_dcformer import DCFormerCache, DCFormerConfig, DCFormerForCausalLM, DCFormerModel
from modeling_dcformer.kernels import dcmha_cpu
from modeling_dcformer.cache_dcformer import DCFormerCacheLayer

# Configurations the equivalence tests sweep: global only, local windows smaller than the sequences, the
# query-wise ablation, qk-norm, head groups and the LLaMA-style body.
BODIES = {
    "global": dict(),
    "LG-w3": dict(window_size=3, window_type="LG"),
    "LGLL-w3-qknorm-querywise": dict(
        window_size=3, window_type="LGLL", num_hidden_layers=4, use_qk_norm=True, query_wise=True
    ),
    "LG-w3-qknorm-groups2-llama": dict(
        window_size=3,
        window_type="LG",
        use_qk_norm=True,
        num_head_groups=2,
        norm_type="rmsnorm",
        use_parallel_residual=False,
        use_gated_mlp=True,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        partial_rotary_factor=1.0,
    ),
    # composition off: plain multi-head attention through SDPA (its own code paths: one causal call, masked chunks)
    "plain-LG-w3": dict(window_size=3, window_type="LG", use_dcmha=False),
}
body_params = pytest.mark.parametrize("body", list(BODIES), ids=list(BODIES))


pytestmark = pytest.mark.usefixtures("one_thread_per_module")


def rand_ids(batch, length, seed=0, vocab=100):
    return torch.randint(1, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def lengths_batch(lengths, seed=0, pad_id=0, side="left"):
    """Rows of the given lengths padded to the longest: (input_ids, attention_mask, list of the rows alone)."""
    width = max(lengths)
    rows = [rand_ids(1, n, seed=seed + i)[0] for i, n in enumerate(lengths)]
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        sl = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[i, sl] = row
        mask[i, sl] = 1
    return ids, mask, rows


def real_slice(mask_row):
    idx = mask_row.nonzero().flatten()
    return slice(int(idx[0]), int(idx[-1]) + 1)


def enable_checkpointing(model, method):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # gradient_checkpointing_enable is deprecated in v5
        getattr(model, method)()


# ------------------------------------------------------------------------------------------------------------
# 1. Registration and serialisation
# ------------------------------------------------------------------------------------------------------------
def test_auto_classes_registered(tiny_config):
    cfg = tiny_config(window_size=3)
    assert isinstance(AutoConfig.for_model("dcformer"), DCFormerConfig)
    assert type(AutoModelForCausalLM.from_config(cfg)) is DCFormerForCausalLM
    assert type(AutoModel.from_config(cfg)) is DCFormerModel


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_save_pretrained_round_trip(tiny_model, tmp_path, tied):
    model = tiny_model(window_size=3, window_type="LGLL", num_hidden_layers=4, use_qk_norm=True, tie_word_embeddings=tied)
    emb, head = model.model.embed_tokens.weight, model.lm_head.weight
    if tied:
        assert head.data_ptr() == emb.data_ptr()
    else:
        assert head.data_ptr() != emb.data_ptr() and not torch.equal(head, emb)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    assert not list(tmp_path.glob("*.bin"))

    config = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(config, DCFormerConfig)
    for key in ("window_size", "window_type", "layer_types", "use_qk_norm", "tie_word_embeddings", "dynamic_hidden_size"):
        assert getattr(config, key) == getattr(model.config, key), key

    ids = rand_ids(2, 9)
    with torch.no_grad():
        ref = model(ids).logits
    ref_state = model.state_dict()
    for cls in (DCFormerForCausalLM, AutoModelForCausalLM):
        loaded = cls.from_pretrained(tmp_path).eval()
        assert type(loaded) is DCFormerForCausalLM
        state = loaded.state_dict()
        assert state.keys() == ref_state.keys()
        for key, value in ref_state.items():
            assert state[key].dtype == value.dtype, key
            assert torch.equal(state[key], value), f"{key} changed in the round trip"
        with torch.no_grad():
            torch.testing.assert_close(loaded(ids).logits, ref, rtol=0, atol=0)
        l_emb, l_head = loaded.model.embed_tokens.weight, loaded.lm_head.weight
        assert (l_head.data_ptr() == l_emb.data_ptr()) is tied


def test_tied_embeddings_share_storage(tiny_model):
    model = tiny_model(tie_word_embeddings=True)
    with torch.no_grad():
        model.model.embed_tokens.weight[3, 0] = 7.0
    assert model.lm_head.weight[3, 0].item() == 7.0


# ------------------------------------------------------------------------------------------------------------
# 2. Config validation
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(hidden_size=30, num_attention_heads=4), "num_attention_heads"),
        (dict(window_size=3, window_type="LX"), "window_type"),
        (dict(window_type="LX"), "window_type"),
        (dict(vocab_size=-5), "vocab_size"),
        (dict(hidden_size=-32), "hidden_size"),
        (dict(num_hidden_layers=0), "num_hidden_layers"),
        (dict(intermediate_size=-1), "intermediate_size"),
        (dict(window_size=-1), "window_size"),
        (dict(window_size=0), "window_size"),
        (dict(window_size=129, max_position_embeddings=128), "window_size"),
        (dict(num_head_groups=3), "num_head_groups"),
        (dict(norm_type="batchnorm"), "norm_type"),
        (dict(layer_types=["full_attention"] * 3), "layer_types"),
        (dict(layer_types=["full_attention", "banana"]), "layer_types"),
        (dict(layer_types=["sliding_attention", "full_attention"]), "window_size"),
        (dict(attention_chunk_size=0), "attention_chunk_size"),
        (dict(rope_theta=0.0), "rope_theta"),
        (dict(rope_theta=-10000.0), "rope_theta"),
        (dict(rope_theta=float("inf")), "rope_theta"),
        (dict(layer_norm_eps=0.0), "layer_norm_eps"),
        (dict(layer_norm_eps=float("nan")), "layer_norm_eps"),
        (dict(layer_norm_eps=float("inf")), "layer_norm_eps"),
        (dict(qk_norm_eps=float("nan")), "qk_norm_eps"),
        (dict(hidden_act="gelux"), "hidden_act"),
        (dict(window_size=None, window_type="LG"), "window_type"),
        (dict(head_dim=0), "head_dim"),
        (dict(num_key_value_heads=3), "num_key_value_heads"),
    ],
)
def test_bad_config_raises_naming_field(tiny_config, overrides, field):
    with pytest.raises(ValueError, match=field):
        tiny_config(**overrides)


def test_value_changed_after_construction_is_checked_before_saving(tiny_config, tmp_path):
    """The checks are the strict config's validators: `save_pretrained` runs them again."""
    config = tiny_config()
    config.layer_norm_eps = -1.0
    with pytest.raises(Exception, match="layer_norm_eps must be a positive finite number"):
        config.save_pretrained(tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_head_dim_as_derived_or_of_its_own(tiny_config, tmp_path):
    config = tiny_config(head_dim=8)  # hidden_size 32 / 4 heads: the value an HF-style config.json spells out
    assert config.head_dim == 8
    (tmp_path / "config.json").write_text(json.dumps({**config.to_dict(), "head_dim": 8}))
    assert DCFormerConfig.from_pretrained(tmp_path).head_dim == 8
    own = DCFormerConfig.from_dict({**config.to_dict(), "head_dim": 16})  # Qwen3: heads x head_dim != hidden_size
    assert own.head_dim == 16 and own.hidden_size == 32


@pytest.mark.parametrize(
    "window_type, expected",
    [
        (None, "LGLGLGLG"),
        ("LG", "LGLGLGLG"),
        ("LGLL", "LGLLLGLL"),
        ("LGL6", "LGLLLLLL"),
    ],
)
def test_window_patterns(tiny_config, window_type, expected):
    cfg = tiny_config(num_hidden_layers=8, window_size=3, window_type=window_type)
    got = "".join("L" if t == "sliding_attention" else "G" for t in cfg.layer_types)
    assert got == expected
    if window_type is None:
        assert tiny_config(num_hidden_layers=8).layer_types == ["full_attention"] * 8
    else:  # a pattern without a window would say nothing: refused (it used to be ignored)
        with pytest.raises(ValueError, match="window_type=.* is given without window_size"):
            tiny_config(num_hidden_layers=8, window_type=window_type)


# ------------------------------------------------------------------------------------------------------------
# 3. Loss
# ------------------------------------------------------------------------------------------------------------
def test_loss_is_shifted_cross_entropy_with_ignore_index(tiny_model):
    model = tiny_model(window_size=3)
    ids = rand_ids(3, 10)
    labels = ids.clone()
    labels[0, :4] = -100
    labels[1, 7] = -100
    labels[2, -1] = -100  # the last label never enters the shifted loss anyway
    out = model(ids, labels=labels)
    logits = out.logits
    manual = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    torch.testing.assert_close(out.loss, manual, rtol=1e-6, atol=1e-6)
    # and it is not the unshifted loss, nor the loss that counts ignored labels
    unshifted = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1))
    assert not torch.allclose(out.loss, unshifted, rtol=1e-4, atol=1e-4)
    out.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


# ------------------------------------------------------------------------------------------------------------
# 4. Padding
# ------------------------------------------------------------------------------------------------------------
@body_params
@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_with_mask_matches_rows_alone(tiny_model, body, side):
    model = tiny_model(**BODIES[body])
    ids, mask, rows = lengths_batch([9, 4, 7, 1], side=side)
    with torch.no_grad():
        batched = model(ids, attention_mask=mask).logits
        assert torch.isfinite(batched).all()  # padded query rows see no key at all and must stay finite
        for i, row in enumerate(rows):
            alone = model(row[None]).logits[0]
            torch.testing.assert_close(batched[i, real_slice(mask[i])], alone, rtol=1e-5, atol=1e-5)


@body_params
def test_right_padding_without_mask_is_exact(tiny_model, body):
    """lm-eval style: right-padded rows and no attention_mask; causality alone keeps the real positions exact."""
    model = tiny_model(**BODIES[body])
    ids, mask, rows = lengths_batch([8, 3, 6], side="right", pad_id=5)
    with torch.no_grad():
        batched = model(ids).logits
        for i, row in enumerate(rows):
            alone = model(row[None]).logits[0]
            torch.testing.assert_close(batched[i, : len(row)], alone, rtol=1e-5, atol=1e-5)


def test_padding_mask_actually_masks(tiny_model):
    """Guard for the padding tests: the pad tokens do change the logits when the mask is not given."""
    model = tiny_model(window_size=3)
    ids, mask, rows = lengths_batch([8, 3], side="left")
    with torch.no_grad():
        masked = model(ids, attention_mask=mask).logits[1, -3:]
        unmasked = model(ids).logits[1, -3:]
    assert (masked - unmasked).abs().max() > 1e-3


def test_composition_weights_matter(tiny_model):
    """Guard for every equivalence test: with the randomised dyn_w_proj the composition moves the logits a lot,
    and the key-wise terms alone do too."""
    model = tiny_model(window_size=3)
    ids = rand_ids(2, 10)
    with torch.no_grad():
        ref = model(ids).logits
        scale = ref.abs().max()
        saved = {n: p.clone() for n, p in model.named_parameters() if "dyn_w_proj" in n}
        for n, p in model.named_parameters():
            if n.endswith("dyn_w_proj.dd"):
                p.zero_()
        assert (model(ids).logits - ref).abs().max() > 0.05 * scale
        for n, p in model.named_parameters():
            if n in saved:
                p.copy_(saved[n])
        for n, p in model.named_parameters():  # zero the key slots (1, 3) of the low-rank key terms
            if n.endswith("dyn_w_proj.qkw"):
                p[:, 1::2] = 0
        assert (model(ids).logits - ref).abs().max() > 0.05 * scale


# ------------------------------------------------------------------------------------------------------------
# 5. Cache
# ------------------------------------------------------------------------------------------------------------
CACHE_BODIES = {
    "global-qknorm": dict(use_qk_norm=True),
    "LG-w3-qknorm": dict(window_size=3, window_type="LG", use_qk_norm=True),
    "LGLL-w3-qknorm": dict(window_size=3, window_type="LGLL", num_hidden_layers=4, use_qk_norm=True),
    "LG-w3-querywise": dict(window_size=3, window_type="LG", query_wise=True),
    "plain-global": dict(use_dcmha=False),
    "plain-LG-w3": dict(window_size=3, window_type="LG", use_dcmha=False),
}


def check_cache_layout(cache, config, batch, seen):
    assert isinstance(cache, DCFormerCache)
    assert cache.get_seq_length() == seen
    n = config.num_attention_heads
    for layer_type, layer in zip(config.layer_types, cache.layers):
        kept = layer.keys.shape[-2]
        if layer_type == "sliding_attention":
            assert kept <= config.window_size - 1, f"local layer keeps {kept} keys"
            assert kept == min(seen, config.window_size - 1)
        else:
            assert kept == seen
        assert layer.values.shape[-2] == kept
        terms = layer.key_terms
        if config.query_wise or not config.use_dcmha:
            assert terms is None
            continue
        assert terms.shape[:2] == (batch, kept)
        # factors (w1, w2, diag) of the pre- and post-key slots: 10 N numbers a key, never N x N matrices
        assert terms.numel() == batch * kept * 10 * n
        assert terms.shape[-1] == config.heads_per_group


@pytest.mark.parametrize("body", list(CACHE_BODIES), ids=list(CACHE_BODIES))
@pytest.mark.parametrize("step", [1, 3], ids=["token", "chunk3"])
@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "leftpad"])
def test_cached_decoding_matches_full_forward(tiny_model, body, step, padded):
    model = tiny_model(**CACHE_BODIES[body])
    config = model.config
    if padded:
        ids, mask, _ = lengths_batch([13, 9, 11], side="left")
    else:
        ids, mask = rand_ids(2, 13), None
    B, T = ids.shape
    prefix = 4
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        out = model(ids[:, :prefix], attention_mask=None if mask is None else mask[:, :prefix], use_cache=True)
        pieces = [out.logits]
        cache = out.past_key_values
        check_cache_layout(cache, config, B, prefix)
        for t0 in range(prefix, T, step):
            t1 = min(T, t0 + step)
            out = model(
                ids[:, t0:t1],
                attention_mask=None if mask is None else mask[:, :t1],
                past_key_values=cache,
                use_cache=True,
            )
            assert out.past_key_values is cache
            pieces.append(out.logits)
            check_cache_layout(cache, config, B, t1)
    cached = torch.cat(pieces, dim=1)
    if mask is None:
        torch.testing.assert_close(cached, full, rtol=1e-4, atol=1e-4)
    else:
        for i in range(B):
            sl = real_slice(mask[i])
            torch.testing.assert_close(cached[i, sl], full[i, sl], rtol=1e-4, atol=1e-4)


def test_decoding_with_explicit_empty_cache(tiny_model):
    """A DCFormerCache made by the caller, and the one the model makes itself, give the same result."""
    model = tiny_model(window_size=3)
    ids = rand_ids(2, 6)
    with torch.no_grad():
        full = model(ids).logits
        cache = DCFormerCache(model.config)
        first = model(ids[:, :5], past_key_values=cache, use_cache=True)
        last = model(ids[:, 5:], past_key_values=first.past_key_values, use_cache=True).logits
    torch.testing.assert_close(torch.cat([first.logits, last], 1), full, rtol=1e-4, atol=1e-4)


def test_cache_argument_under_both_names(tiny_model):
    """transformers 5.24 renamed `past_key_values` to `cache`: both names work, and the output carries the cache
    under the installed version's name; both at once is an error."""
    import transformers.modeling_outputs as outputs

    model = tiny_model(window_size=3)
    ids = rand_ids(2, 6)
    name = "cache" if "cache" in outputs.CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
    with torch.no_grad():
        full = model(ids).logits
        for argument in ("cache", "past_key_values"):
            cache = DCFormerCache(model.config)
            first = model(ids[:, :5], use_cache=True, **{argument: cache})
            assert first[name] is cache and cache.get_seq_length() == 5
            last = model(ids[:, 5:], use_cache=True, **{argument: cache}).logits
            torch.testing.assert_close(torch.cat([first.logits, last], 1), full, rtol=1e-4, atol=1e-4)
        with pytest.raises(ValueError, match="not both"):
            model(ids, cache=DCFormerCache(model.config), past_key_values=DCFormerCache(model.config))


def test_prefilled_cache_holds_only_its_own_tensors(tiny_model):
    """The cache keeps K, V and the key factors, not the tensors they were sliced from (the fused q/k/v output,
    all four factor slots): those would stay alive as long as the cache (3x the values' memory)."""
    model = tiny_model()
    with torch.no_grad():
        cache = model(rand_ids(2, 7), use_cache=True).past_key_values
    for layer in cache.layers:
        for tensor in (layer.keys, layer.values, layer.key_terms):
            assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def test_cache_crop_select_and_reset(tiny_model):
    """The generic Cache operations keep the key terms in step with the keys (global layers; local ones refuse)."""
    model = tiny_model(use_qk_norm=True)
    ids = rand_ids(2, 10)
    with torch.no_grad():
        full = model(ids).logits
        cache = model(ids[:, :8], use_cache=True).past_key_values
        cache.crop(-3)  # transformers 5 crops by a negative number of tokens
        assert cache.get_seq_length() == 5
        assert all(layer.keys.shape[-2] == layer.key_terms.shape[1] == 5 for layer in cache.layers)
        torch.testing.assert_close(model(ids[:, 5:], past_key_values=cache).logits, full[:, 5:], rtol=1e-4, atol=1e-4)

        cache = model(ids[:, :8], use_cache=True).past_key_values
        cache.batch_select_indices(torch.tensor([1]))
        assert all(layer.key_terms.shape[0] == 1 for layer in cache.layers)
        torch.testing.assert_close(model(ids[1:, 8:], past_key_values=cache).logits, full[1:, 8:], rtol=1e-4, atol=1e-4)

        cache.reset()
        assert cache.get_seq_length() == 0
        torch.testing.assert_close(model(ids, past_key_values=cache).logits, full, rtol=1e-5, atol=1e-5)

    local = tiny_model(window_size=3)
    with torch.no_grad():
        cache = local(ids[:, :4], use_cache=True).past_key_values
    with pytest.raises(ValueError):
        cache.crop(-1)


def grow_layer(layer, steps, gen, B=2, N=3, Dh=4, terms_shape=(1, 2, 5, 3)):
    """Feeds `layer` steps of the given token counts (random keys, values, key terms); returns each step's returned
    tensors and the concatenation of everything fed so far (the oracle)."""
    fed, out = [[], [], []], []
    for t in steps:
        new = (torch.randn(B, N, t, Dh, generator=gen), torch.randn(B, N, t, Dh, generator=gen),
               torch.randn(B, t, *terms_shape, generator=gen))
        for store, tensor in zip(fed, new):
            store.append(tensor)
        out.append((layer.update_dcmha(*new), [torch.cat(store, dim=2 if i < 2 else 1) for i, store in enumerate(fed)]))
    return out


def test_global_cache_layer_appends_in_place():
    """A global layer writes each step's keys, values and key terms after the others in its storage (room for an
    eighth and 64 more tokens), instead of copying the whole cache at each step as DynamicLayer does: over 160 tokens
    it holds exactly what concatenation gives, after only 3 new storages; the prompt is stored exactly, copied where
    it is a view (which would keep its base alive)."""
    layer, gen = DCFormerCacheLayer(), torch.Generator().manual_seed(0)
    steps = grow_layer(layer, [10] + [1] * 120 + [3] + [1] * 27, gen)
    assert steps[-1][0][0] is layer.keys and steps[-1][0][2] is layer.key_terms
    for returned, expected in steps:  # every step's tensors, the earlier ones too (nothing written over them)
        for got, want in zip(returned, expected):
            assert torch.equal(got, want)
    storages = {returned[0].untyped_storage().data_ptr() for returned, _ in steps}
    assert len(storages) == 4  # the prompt (exact), then room for 76, 150 and 233 tokens
    first, base = DCFormerCacheLayer(), torch.randn(2, 2, 10, 4)
    stored = first.update_dcmha(base[:, :, :5], base[:, :, 5:], None)[:2]  # views of a bigger tensor: copied
    assert all(t.untyped_storage().nbytes() == t.numel() * 4 and torch.equal(t, base[:, :, i * 5 : i * 5 + 5])
               for i, t in enumerate(stored))


def test_global_cache_layer_copies_what_it_did_not_grow(monkeypatch):
    """The other side of in-place appends: after a crop or a batch selection, or with storage the layer did not make
    (a view of a bigger tensor, whose rest belongs to someone else), the tokens are copied to new storage and that
    rest is never written; with autograd recording, or in a traced call (torch.compile), the layer concatenates."""
    gen = torch.Generator().manual_seed(1)
    layer = DCFormerCacheLayer()
    grow_layer(layer, [6, 1, 1], gen)
    layer.crop(-3)
    kept = [t.clone() for t in (layer.keys, layer.values, layer.key_terms)]
    (returned, _), = grow_layer(layer, [2], gen)
    assert torch.equal(returned[0][:, :, :5], kept[0]) and torch.equal(returned[2][:, :5], kept[2])
    layer.batch_select_indices(torch.tensor([1]))
    before = layer.keys.clone()
    (returned, _), = grow_layer(layer, [1], gen, B=1)
    assert torch.equal(returned[0][:, :, :-1], before)

    other = DCFormerCacheLayer()
    grow_layer(other, [4], gen)
    big = torch.zeros(2, 3, 100, 4)
    other.keys = big[:, :, :4].copy_(other.keys)  # room after it, but not the layer's to write
    grow_layer(other, [1, 1], gen)
    assert torch.count_nonzero(big[:, :, 4:]) == 0 and other.keys.shape[2] == 6

    # with autograd recording (training through a cache): concatenated, and each step's gradient reaches its keys
    keys = [torch.randn(1, 2, t, 4, requires_grad=True) for t in (3, 1, 1)]
    grad_layer, loss = DCFormerCacheLayer(), 0
    for key in keys:  # squares: autograd saves each step's keys, which a later in-place write would change
        loss = loss + grad_layer.update_dcmha(key, key.detach(), None)[0].square().sum()
    loss.backward()
    for key, steps in zip(keys, (3, 2, 1)):  # a step's keys are in its own and every later step's cache
        torch.testing.assert_close(key.grad, 2 * steps * key.detach())

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    for returned, expected in grow_layer(DCFormerCacheLayer(), [4, 1, 1], gen):
        assert all(torch.equal(got, want) for got, want in zip(returned, expected))
        assert returned[0].untyped_storage().nbytes() == returned[0].numel() * 4  # concatenated: no room


def test_long_cached_decoding_matches_full_forward(tiny_model):
    """80 single-token steps after a prompt of 5 (past two new storages of the global layers, a local layer beside
    them): the last logits are the full forward's."""
    model = tiny_model(window_size=3, window_type="LG", num_hidden_layers=2)
    ids = rand_ids(2, 85, seed=3)
    with torch.no_grad():
        full = model(ids).logits
        cache = model(ids[:, :5], use_cache=True).past_key_values
        for i in range(5, 85):
            step = model(ids[:, i : i + 1], past_key_values=cache).logits
    torch.testing.assert_close(step[:, -1], full[:, -1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("body", ["global", "LG-w3", "LG-w3-qknorm-groups2-llama"])
def test_static_cache_decoding_matches_full_forward(tiny_model, body):
    """A static cache (buffers of max_cache_len tokens written in place): prefill, then one token at a time, the
    logits of the full forward pass; the buffers are the ones allocated at the first step."""
    model = tiny_model(**BODIES[body])
    ids = rand_ids(2, 9)
    with torch.no_grad():
        full = model(ids).logits
        cache = DCFormerCache(model.config, max_cache_len=12)
        steps = [model(ids[:, :4], past_key_values=cache, use_cache=True).logits]
        buffers = [layer.keys.data_ptr() for layer in cache.layers]
        for t in range(4, 9):
            steps.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-4)
    assert [layer.keys.data_ptr() for layer in cache.layers] == buffers
    assert all(layer.keys.shape[-2] == 12 for layer in cache.layers) and cache.get_seq_length() == 9


def test_static_cache_crop_select_reset_and_overflow(tiny_model):
    model = tiny_model(window_size=3)  # a static local layer keeps every key: it can be cropped
    ids = rand_ids(2, 10)
    with torch.no_grad():
        full = model(ids).logits
        cache = DCFormerCache(model.config, max_cache_len=10)
        model(ids[:, :8], past_key_values=cache)
        cache.crop(-3)
        assert cache.get_seq_length() == 5
        torch.testing.assert_close(model(ids[:, 5:], past_key_values=cache).logits, full[:, 5:], rtol=1e-4, atol=1e-4)
        cache.reset()
        model(ids[:, :8], past_key_values=cache)
        cache.batch_select_indices(torch.tensor([1]))
        torch.testing.assert_close(model(ids[1:, 8:], past_key_values=cache).logits, full[1:, 8:], rtol=1e-4, atol=1e-4)
        with pytest.raises(ValueError, match="max_cache_len=10 tokens; this step would need 11"):
            model(rand_ids(1, 1), past_key_values=cache)
    with pytest.raises(ValueError, match="max_cache_len must be a positive integer"):
        DCFormerCache(model.config, max_cache_len=0)


# ------------------------------------------------------------------------------------------------------------
# 6. generate()
# ------------------------------------------------------------------------------------------------------------
GEN_BODY = dict(window_size=3, window_type="LG", use_qk_norm=True)


def manual_greedy(model, ids, mask, new_tokens):
    for _ in range(new_tokens):
        with torch.no_grad():
            logits = model(ids, attention_mask=mask, use_cache=False).logits[:, -1]
        nxt = logits.argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], 1)
        if mask is not None:
            mask = torch.cat([mask, torch.ones_like(nxt)], 1)
    return ids


def test_greedy_generate_matches_repeated_full_forwards(tiny_model):
    model = tiny_model(**GEN_BODY)
    ids = rand_ids(2, 5)
    with torch.no_grad():
        got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False, use_cache=True)
    assert got.shape == (2, 15)
    assert torch.equal(got, manual_greedy(model, ids, None, 10))


def test_prompt_lookup_decoding_matches_greedy(tiny_model):
    """Assisted (prompt-lookup) decoding needs generate() to start from a cache it can crop: a DCFormerCache."""
    model = tiny_model()  # every layer global: a global cache layer can be cropped
    ids = rand_ids(1, 6).repeat(1, 2)  # repeated n-grams, so candidate tokens are proposed and checked
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=10, do_sample=False, prompt_lookup_num_tokens=3)
    assert torch.equal(got, manual_greedy(model, ids, None, 10))


@pytest.mark.parametrize(
    "decoding",
    [dict(do_sample=False), dict(num_beams=3, do_sample=False), dict(do_sample=True, top_k=5)],
    ids=["greedy", "beam3", "sample"],
)
def test_static_cache_generates_like_the_dynamic_one(tiny_model, decoding):
    """generate(cache_implementation="static"): a left-padded batch, local layers, the same tokens as the default
    (growing) cache; the cache it used holds buffers of the generation's length (transformers' max_cache_len)."""
    model = tiny_model(**GEN_BODY)
    ids, mask = rand_ids(2, 6), torch.ones(2, 6, dtype=torch.long)
    mask[0, :2] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=7, pad_token_id=0, **decoding)
    with torch.no_grad():
        torch.manual_seed(3)
        dynamic = model.generate(ids, **kwargs)
        torch.manual_seed(3)
        static = model.generate(ids, cache_implementation="static", return_dict_in_generate=True, **kwargs)
    assert torch.equal(static.sequences, dynamic)
    layer = static.past_key_values.layers[0]
    assert layer.get_max_length() == layer.keys.shape[-2] == 6 + 7 - 1  # the last token is never fed back


def test_unsupported_cache_implementation_is_a_clear_error(tiny_model):
    model = tiny_model()
    ids = rand_ids(1, 4)
    with pytest.raises(ValueError, match="cache_implementation='offloaded' is not supported by DCFormer"):
        model.generate(ids, max_new_tokens=2, cache_implementation="offloaded")
    with pytest.raises(ValueError, match="not both"):
        model.generate(ids, max_new_tokens=2, cache_implementation="static", past_key_values=DCFormerCache(model.config))


def test_sampling_is_reproducible(tiny_model):
    model = tiny_model(**GEN_BODY)
    ids = rand_ids(2, 4)
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=True, top_k=0, temperature=1.0)
    with torch.no_grad():
        torch.manual_seed(7)
        a = model.generate(ids, **kwargs)
        torch.manual_seed(7)
        b = model.generate(ids, **kwargs)
    assert a.shape == (2, 12)
    assert torch.equal(a, b)
    assert ((a >= 0) & (a < model.config.vocab_size)).all()


def test_beam_search_cache_matches_no_cache(tiny_model):
    model = tiny_model(**GEN_BODY)
    ids = rand_ids(2, 5)
    kwargs = dict(
        attention_mask=torch.ones_like(ids),
        max_new_tokens=6,
        num_beams=3,
        num_return_sequences=2,
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=True,
    )
    with torch.no_grad():
        cached = model.generate(ids, use_cache=True, **kwargs)
        uncached = model.generate(ids, use_cache=False, **kwargs)
    assert cached.sequences.shape == (4, 11)
    assert torch.equal(cached.sequences, uncached.sequences)
    torch.testing.assert_close(cached.sequences_scores, uncached.sequences_scores, rtol=1e-4, atol=1e-4)
    # the best beam of each prompt continues the prompt
    assert torch.equal(cached.sequences[::2, :5], ids)


@pytest.mark.parametrize("body", ["LG-w3", "global"])
def test_batched_left_padded_generate_matches_rows_alone(tiny_model, body):
    model = tiny_model(**BODIES[body], pad_token_id=0)
    ids, mask, rows = lengths_batch([6, 2, 4], side="left", pad_id=0)
    with torch.no_grad():
        batched = model.generate(ids, attention_mask=mask, max_new_tokens=7, do_sample=False, pad_token_id=0)
        new = batched[:, ids.shape[1] :]
        for i, row in enumerate(rows):
            alone = model.generate(row[None], attention_mask=torch.ones_like(row[None]), max_new_tokens=7, do_sample=False)
            assert torch.equal(new[i], alone[0, len(row) :]), f"row {i}"
    # and the manual reference with the padded batch agrees
    assert torch.equal(batched, manual_greedy(model, ids, mask, 7))


# ------------------------------------------------------------------------------------------------------------
# 7. Outputs
# ------------------------------------------------------------------------------------------------------------
def test_hidden_states_and_attentions(tiny_model):
    model = tiny_model(window_size=3, window_type="LGLL", num_hidden_layers=4, attention_chunk_size=3)
    cfg = model.config
    B, T = 2, 7
    ids = rand_ids(B, T)
    with torch.no_grad():
        out = model(ids, output_hidden_states=True, output_attentions=True)
    assert len(out.hidden_states) == cfg.num_hidden_layers + 1
    for h in out.hidden_states:
        assert h.shape == (B, T, cfg.hidden_size) and torch.isfinite(h).all()
    torch.testing.assert_close(out.hidden_states[0], model.model.embed_tokens(ids), rtol=0, atol=0)
    assert len(out.attentions) == cfg.num_hidden_layers
    t = torch.arange(T)
    future = t[None, :] > t[:, None]
    outside = t[None, :] <= t[:, None] - cfg.window_size
    for layer_type, a in zip(cfg.layer_types, out.attentions):
        assert a.shape == (B, cfg.num_attention_heads, T, T)
        assert torch.isfinite(a).all()
        assert (a[..., future] == 0).all()  # causal
        if layer_type == "sliding_attention":
            assert (a[..., outside] == 0).all()  # window
    # without composition they are plain softmax rows
    plain = tiny_model(use_dcmha=False)
    with torch.no_grad():
        att = plain(ids, output_attentions=True).attentions
    for a in att:
        torch.testing.assert_close(a.sum(-1), torch.ones(B, 4, T), rtol=1e-5, atol=1e-5)


def test_return_dict_false_and_logits_to_keep(tiny_model):
    model = tiny_model(window_size=3)
    ids = rand_ids(2, 6)
    with torch.no_grad():
        out = model(ids, labels=ids)
        tup = model(ids, labels=ids, return_dict=False)
        last = model(ids, logits_to_keep=1).logits
    assert isinstance(tup, tuple)
    torch.testing.assert_close(tup[0], out.loss, rtol=0, atol=0)
    torch.testing.assert_close(tup[1], out.logits, rtol=0, atol=0)
    assert last.shape == (2, 1, 100)
    torch.testing.assert_close(last, out.logits[:, -1:], rtol=1e-6, atol=1e-6)
    base = model.model(ids, return_dict=False)
    assert isinstance(base, tuple)


def test_inputs_embeds_equals_input_ids(tiny_model):
    model = tiny_model(window_size=3)
    ids, mask, _ = lengths_batch([6, 3], side="left")
    with torch.no_grad():
        a = model(ids, attention_mask=mask).logits
        b = model(inputs_embeds=model.model.embed_tokens(ids), attention_mask=mask).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError):
        model(ids, inputs_embeds=model.model.embed_tokens(ids))


# ------------------------------------------------------------------------------------------------------------
# 8. Gradient checkpointing
# ------------------------------------------------------------------------------------------------------------
def loss_and_grads(model, ids, labels):
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("method", ["gradient_checkpointing_enable", "activation_checkpointing_enable"])
def test_gradient_checkpointing_same_loss_and_grads(tiny_model, method):
    model = tiny_model(window_size=3, window_type="LG", use_qk_norm=True).train()
    if not hasattr(model, method):
        pytest.skip(f"{method} does not exist in this transformers version")
    ids = rand_ids(2, 9)
    labels = ids.clone()
    labels[0, :3] = -100
    ref_loss, ref_grads = loss_and_grads(model, ids, labels)

    enable_checkpointing(model, method)
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    calls = []
    hook = model.model.layers[0].self_attn.register_forward_hook(lambda *a: calls.append(1))
    try:
        loss, grads = loss_and_grads(model, ids, labels)
    finally:
        hook.remove()
    assert len(calls) == 2, "the checkpointed layer was not recomputed in the backward pass"
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-6, atol=1e-6, msg=name)
    assert any(g.abs().sum() > 0 for n, g in grads.items() if "dyn_w_proj" in n)


# ------------------------------------------------------------------------------------------------------------
# 9. Half precision
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_forward_backward_generate(tiny_model, dtype):
    # dyn_std 0.1, not 0.5: at 0.5 the tiny random model is so ill-conditioned that merely rounding its fp32
    # weights to bf16 moves the logits by ~40% of their range, which says nothing about the half-precision path.
    body = dict(window_size=3, window_type="LG", use_qk_norm=True, dyn_std=0.1)
    ref_model = tiny_model(**body)
    model = tiny_model(**body).to(dtype)
    ids, mask, _ = lengths_batch([8, 5], side="left")
    with torch.no_grad():
        ref = ref_model(ids, attention_mask=mask).logits
        out = model(ids, attention_mask=mask).logits
    assert out.dtype == dtype and torch.isfinite(out).all()
    for i in range(2):
        sl = real_slice(mask[i])
        torch.testing.assert_close(out[i, sl].float(), ref[i, sl], rtol=5e-2, atol=5e-2 * ref.abs().max().item())

    model.train()
    loss = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
    assert torch.isfinite(loss)
    loss.backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == dtype and torch.isfinite(p.grad).all(), n
    model.eval()
    with torch.no_grad():
        gen = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert gen.shape == (2, ids.shape[1] + 4)
    assert ((gen >= 0) & (gen < 100)).all()


# ------------------------------------------------------------------------------------------------------------
# 10. Attention chunking
# ------------------------------------------------------------------------------------------------------------
CHUNK_BODIES = pytest.mark.parametrize("body", ["global", "LG-w3", "LGLL-w3-qknorm-querywise"])


def train_step(model, ids, mask, labels):
    out = model(ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@CHUNK_BODIES
def test_attention_chunk_size_and_recompute_do_not_change_training(tiny_model, body):
    """Forward and backward in train mode are independent of attention_chunk_size, and of attention_recompute
    (each chunk's attention recomputed in the backward pass, active in train mode without output_attentions)."""
    ids, mask, _ = lengths_batch([10, 6], side="left")
    labels = ids.masked_fill(mask == 0, -100)
    results = {}
    for chunk in (1, 3, 512):
        for recompute in (False, True):
            model = tiny_model(**BODIES[body], attention_chunk_size=chunk, attention_recompute=recompute).train()
            results[chunk, recompute] = train_step(model, ids, mask, labels)
    ref_logits, ref_loss, ref_grads = results[512, False]
    for (chunk, recompute), (logits, loss, grads) in results.items():
        # recomputing a chunk replays the same kernels: as good as bit-identical
        same_logits, same_loss, same_grads = results[chunk, False]
        torch.testing.assert_close(logits, same_logits, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(loss, same_loss, rtol=1e-6, atol=1e-6)
        for name in same_grads:
            torch.testing.assert_close(grads[name], same_grads[name], rtol=1e-6, atol=1e-6, msg=name)
        # Chunking is exact (float64 copies of the kernels agree to 1e-15); in fp32 the tiny model with dyn_w_proj
        # at std 0.5 amplifies round-off (~4e-6 on logits, ~1.5e-4 of a gradient's range): tolerances carry that.
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=3e-5)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for name in ref_grads:
            scale = ref_grads[name].abs().max().item()
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-3, atol=1e-3 * scale, msg=name)


def test_attention_recompute_saves_chunk_intermediates(tiny_model):
    """Guard that the recompute path is taken: with it, the attention's backward re-runs the forward of its
    chunks, so fewer tensors are saved for backward during the forward pass ("eager"). The CPU kernel always
    recomputes: without the flag it too saves less than "eager" without it (its inputs, no chunk's scores)."""
    ids = rand_ids(2, 12)

    def saved_numel(recompute, implementation="eager"):
        model = tiny_model(window_size=3, attention_chunk_size=4, attention_recompute=recompute,
                           dcmha_implementation=implementation).train()
        total = [0]

        def pack(t):
            total[0] += t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(ids, labels=ids).loss
        loss.backward()
        return total[0]

    assert saved_numel(True) < saved_numel(False)
    if dcmha_cpu.ensure_built():
        assert saved_numel(False, "cpu") < saved_numel(False)


@CHUNK_BODIES
def test_attention_chunk_size_does_not_change_attentions(tiny_model, body):
    ids, mask, _ = lengths_batch([10, 6], side="left")
    results = {}
    for chunk in (1, 3, 512):
        model = tiny_model(**BODIES[body], attention_chunk_size=chunk)
        with torch.no_grad():
            out = model(ids, attention_mask=mask, output_attentions=True)
        results[chunk] = (out.logits, out.attentions)
    ref_logits, ref_att = results[512]
    for chunk in (1, 3):
        logits, att = results[chunk]
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=3e-5)
        for a, r in zip(att, ref_att):
            # composed probabilities reach tens in magnitude: the tolerance scales with them
            torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5 * max(1.0, r.abs().max().item()))
