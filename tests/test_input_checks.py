"""Token ids outside the vocabulary are one clear error naming the id and the vocabulary size:
the embedding alone says "IndexError: index out of range in self". The legitimate neighbours (ids 0 and
vocab_size - 1, an empty batch, inputs_embeds, a resized vocabulary) still run."""

import pytest
import torch

from helpers import VOCAB, build_model, make_config


@pytest.fixture(scope="module")
def model():
    return build_model(make_config(num_hidden_layers=1))


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 7, -1])
def test_a_token_id_outside_the_vocabulary_is_named(model, bad):
    ids = torch.tensor([[1, 2, bad, 3]])
    with pytest.raises(ValueError, match=rf"token id {bad}, outside the model's vocabulary of {VOCAB} tokens"):
        model(input_ids=ids)
    with pytest.raises(ValueError, match=rf"token id {bad}\b"):
        model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)


def test_the_first_and_last_ids_are_accepted(model):
    ids = torch.tensor([[0, VOCAB - 1, 5]])
    assert model(input_ids=ids).logits.shape == (1, 3, VOCAB)
    embeds = model.get_input_embeddings()(ids)
    torch.testing.assert_close(model(inputs_embeds=embeds).logits, model(input_ids=ids).logits)


def test_the_check_follows_a_resized_vocabulary():
    model = build_model(make_config(num_hidden_layers=1))
    model.resize_token_embeddings(VOCAB + 8)
    assert model(input_ids=torch.tensor([[VOCAB + 7]])).logits.shape[-1] == VOCAB + 8
    with pytest.raises(ValueError, match=rf"token id {VOCAB + 8}, outside the model's vocabulary of {VOCAB + 8}"):
        model(input_ids=torch.tensor([[VOCAB + 8]]))


def test_the_check_is_left_out_of_compiled_graphs(model):
    """Under torch.compile the check is skipped (a value-dependent branch would break the graph): fullgraph holds."""
    torch._dynamo.reset()
    compiled = torch.compile(model.model, backend="eager", fullgraph=True)
    out = compiled(input_ids=torch.tensor([[0, VOCAB - 1]]), use_cache=False)
    assert out.last_hidden_state.shape == (1, 2, 32)


def test_an_attention_mask_of_the_wrong_shape_is_named(model):
    """A padding mask must be [batch, past + new tokens]: a 1D mask, a 3D one and one of the wrong length are each a
    ValueError naming both shapes; the right one (also after a cache of 3 tokens) runs."""
    ids = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
    for bad in (torch.ones(5, dtype=torch.long), torch.ones(2, 1, 5, dtype=torch.long), torch.ones(2, 4)):
        with pytest.raises(ValueError, match=r"attention_mask has shape .* 2D padding mask .*here \[2, 0 \+ 5\]"):
            model(ids, attention_mask=bad)
    with torch.no_grad():
        cache = model(ids[:, :3], attention_mask=torch.ones(2, 3), use_cache=True).past_key_values
        with pytest.raises(ValueError, match=r"here \[2, 3 \+ 2\]"):
            model(ids[:, 3:], attention_mask=torch.ones(2, 2), past_key_values=cache)
        model(ids[:, 3:], attention_mask=torch.ones(2, 5), past_key_values=cache)
