"""torch.export and torch.compile(fullgraph=True) of the whole causal LM with a padding mask.

The forward pass has no Python branch on tensor values: an exported program, with static or dynamic batch and
length, gives the eager model's logits, and those of the float64 oracle on each row alone; a fullgraph compile
traces every DCMHA implementation that can run on a CPU ("auto", "compiled" and "cpu" trace the eager chunks).
"""

import pytest
import torch

from helpers import VOCAB, WINDOW, assert_close, assert_rows_match_oracle, build_model, make_config, padded_batch
from modeling_dcformer import DCFormerForCausalLM

pytestmark = pytest.mark.usefixtures("one_thread_per_module")


def export_model(**overrides) -> DCFormerForCausalLM:
    """Two layers (local, global), several query chunks, qk-norm, two head groups; no cache in the outputs."""
    config = make_config(
        num_hidden_layers=2, window_size=WINDOW, attention_chunk_size=4, use_qk_norm=True, num_head_groups=2,
        use_cache=False, **overrides,
    )  # fmt: skip
    return build_model(config).eval()


def other_padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Another batch size and length than `padded_batch` (3 rows of 9): what a dynamic export must also take."""
    input_ids = torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :2] = 0  # left padding
    mask[2, -4:] = 0  # right padding
    return input_ids, mask


def eager_logits(model, input_ids, mask) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids, attention_mask=mask).logits


def test_export_with_a_padding_mask_matches_eager_and_the_oracle():
    model = export_model()
    input_ids, mask = padded_batch()
    program = torch.export.export(model, (), {"input_ids": input_ids, "attention_mask": mask})
    with torch.no_grad():
        logits = program.module()(input_ids=input_ids, attention_mask=mask).logits
    assert_close(logits, eager_logits(model, input_ids, mask))
    assert_rows_match_oracle(model, logits, input_ids, mask)


def test_export_with_dynamic_batch_and_length_matches_eager_and_the_oracle():
    model = export_model()
    input_ids, mask = padded_batch()
    batch, length = torch.export.Dim("batch", max=16), torch.export.Dim("length", max=64)
    dims = {0: batch, 1: length}
    program = torch.export.export(
        model, (), {"input_ids": input_ids, "attention_mask": mask},
        dynamic_shapes={"input_ids": dims, "attention_mask": dims},
    )  # fmt: skip
    exported = program.module()
    for ids, pad in (padded_batch(), other_padded_batch()):
        with torch.no_grad():
            logits = exported(input_ids=ids, attention_mask=pad).logits
        assert logits.shape == (*ids.shape, VOCAB)
        assert_close(logits, eager_logits(model, ids, pad))
        assert_rows_match_oracle(model, logits, ids, pad)


@pytest.mark.parametrize("implementation", ["auto", "compiled", "cpu"])
def test_compile_fullgraph_with_a_padding_mask_matches_eager(implementation):
    model = export_model(dcmha_implementation="eager")
    input_ids, mask = padded_batch()
    expected = eager_logits(model, input_ids, mask)
    model.config.dcmha_implementation = implementation
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        with torch.no_grad():
            logits = compiled(input_ids, attention_mask=mask).logits
    finally:
        torch._dynamo.reset()
    assert_close(logits, expected)
    assert_rows_match_oracle(model, logits, input_ids, mask)
    assert DCFormerForCausalLM._can_compile_fullgraph  # what transformers reads: now true
