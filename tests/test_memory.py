"""Memory behaviour of the DCMHA attention, measured deterministically: the bytes autograd saves for the
backward pass (saved-tensor hooks), and the largest tensor the attention creates for a local layer."""

import pytest
import torch

from modeling_dcformer import DCFormerConfig, DCFormerForCausalLM
from modeling_dcformer import dcmha_eager


def make_model(**overrides):
    kwargs = dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        attention_chunk_size=16,
        dcmha_implementation="eager",  # what autograd saves is the eager path's; "auto" may compile at T=512
    )
    kwargs.update(overrides)
    torch.manual_seed(0)
    model = DCFormerForCausalLM(DCFormerConfig(**kwargs))
    for name, p in model.named_parameters():
        if "dyn_w_proj" in name:
            torch.nn.init.normal_(p, std=0.5)
    return model


def attention_saved_bytes(model, ids):
    """Bytes of the storages autograd keeps for backward while the attention layer runs (views of one
    storage, such as the key slices of each query chunk, count once)."""
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    attn = model.model.layers[0].self_attn
    orig_forward = attn.forward

    def forward(*args, **kwargs):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return orig_forward(*args, **kwargs)

    attn.forward = forward
    model.train()
    model(ids, labels=ids).loss.backward()
    attn.forward = orig_forward
    return sum(saved.values())


def test_recompute_saves_no_heads_by_queries_by_keys_tensor():
    T = 512
    ids = torch.randint(0, 64, (1, T))
    heads_t_s = 4 * T * T * 4  # one [N, T, S] fp32 tensor
    plain = attention_saved_bytes(make_model(attention_recompute=False, attention_chunk_size=64), ids)
    recomputed = attention_saved_bytes(make_model(attention_recompute=True, attention_chunk_size=64), ids)
    assert plain > 2 * heads_t_s  # the plain path keeps several N x T x S intermediates (so the test can fail)
    assert recomputed < heads_t_s / 2  # only O(T x hidden) inputs remain


@pytest.mark.parametrize("use_cache", [False, True])
def test_recompute_keeps_no_view_of_the_qkv_projection(use_cache):
    """The values handed to the attention are their own tensor: a view of the q/k/v projection's output, saved
    as a chunk's input for the recomputation, would keep all three projections alive until the backward pass
    (6 MiB a layer more at the Pythia-160M shape, T=1024)."""
    model = make_model(attention_recompute=True)
    projected = []
    model.model.layers[0].self_attn.qkv_proj.register_forward_hook(
        lambda module, args, out: projected.append(out)  # held: its address cannot be reused by a later tensor
    )
    saved = set()

    def pack(t):
        saved.add(t.untyped_storage().data_ptr())
        return t

    model.train()
    ids = torch.randint(0, 64, (1, 64))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids, use_cache=use_cache).loss
    assert len(projected) == 1 and saved  # the hooks saw the forward pass (so the test can fail)
    assert projected[0].untyped_storage().data_ptr() not in saved
    loss.backward()


def test_recompute_gives_the_same_gradients():
    ids = torch.randint(0, 64, (2, 40))
    grads = []
    for recompute in (False, True):
        model = make_model(attention_recompute=recompute, window_size=8).train()
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("window", [4, 8])
def test_local_layer_never_builds_a_full_sequence_tensor(window, monkeypatch):
    """On a local layer every chunk sees at most chunk + window - 1 keys: no [T, S] mask or score tensor."""
    T, chunk = 96, 16
    widths = []
    real = dcmha_eager.attend_chunk

    def spy(chunk, stages):
        widths.append((chunk.key.shape[2], chunk.key_pos.shape[0]))  # the keys and the mask's width (from key_pos)
        return real(chunk, stages)

    monkeypatch.setattr(dcmha_eager, "attend_chunk", spy)
    model = make_model(
        window_size=window, window_type="L", attention_chunk_size=chunk, dcmha_implementation="eager"
    ).eval()
    with torch.no_grad():
        model(torch.randint(0, 64, (1, T)))
    assert len(widths) == T // chunk
    assert max(max(w) for w in widths) <= chunk + window - 1


def test_local_layer_chunks_stay_near_the_window_band(monkeypatch):
    """A local layer takes chunks of at most max(64, window // 2) queries whatever attention_chunk_size says, so the
    scores it computes stay within 1.5x of the window band (512-query chunks against a 200-key window: 3.5x)."""
    T, window = 300, 200
    shapes = []
    real = dcmha_eager.attend_chunk

    def spy(chunk, stages):
        shapes.append((chunk.query.shape[2], chunk.key.shape[2]))
        return real(chunk, stages)

    monkeypatch.setattr(dcmha_eager, "attend_chunk", spy)
    model = make_model(
        window_size=window, window_type="LG", num_hidden_layers=2, attention_chunk_size=512,
        dcmha_implementation="eager",
    ).eval()
    with torch.no_grad():
        model(torch.randint(0, 64, (1, T)))
    local, global_ = shapes[:3], shapes[3:]
    assert [c for c, _ in local] == [100, 100, 100]
    assert max(s for _, s in local) == 100 + window - 1
    assert global_ == [(T, T)]  # the global layer keeps one 300-query chunk
