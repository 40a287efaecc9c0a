"""The initialisation of DCMHA's dynamic projections (`DCFormerConfig.dynamic_init`): the sample standard deviation
of dw1, qkw and dd against the formulas of the authors' training code (written out here from the spec, not read
from the package), the old N(0, initializer_range) option, and that loading a checkpoint is not affected."""

import math

import pytest
import torch

from modeling_dcformer import DCFormerConfig, DCFormerForCausalLM

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

# big enough for a tight check: dw1 has D*G*C*K >= 65k entries, qkw >= 8k, dd >= 32k
BIG = dict(vocab_size=64, hidden_size=512, num_hidden_layers=1, num_attention_heads=16, intermediate_size=64)


def authors_stds(D, N, G, I, K=None):
    M = N // G
    K = 4 * M if K is None else K
    return {
        "dw1": math.sqrt(2.0 / (D + K)),
        "qkw": math.sqrt(1.0 / K) * 2.0 / (M + I) * 0.01,
        "dd": math.sqrt(2.0 / (D + M)) * 0.005,
    }


def sample_stds(model):
    proj = model.model.layers[0].self_attn.dyn_w_proj
    return {name: getattr(proj, name).detach().double() for name in ("dw1", "qkw", "dd")}


@pytest.mark.parametrize(
    "overrides",
    [{}, {"num_head_groups": 2}, {"query_wise": True}, {"dynamic_rank": 1, "dynamic_hidden_size": 48}],
    ids=["default", "two-groups", "query-wise", "rank1-k48"],
)
def test_authors_init_has_the_authors_scales(overrides):
    config = DCFormerConfig(**BIG, **overrides)
    assert config.dynamic_init == "authors"  # the default for a model built from its config
    torch.manual_seed(0)
    model = DCFormerForCausalLM(config)
    groups, rank = overrides.get("num_head_groups", 1), overrides.get("dynamic_rank", 2)
    expected = authors_stds(512, 16, groups, rank, overrides.get("dynamic_hidden_size"))
    for name, tensor in sample_stds(model).items():
        # relative standard error of a sample std is 1/sqrt(2n) <= 0.8% here; 4% is > 5 standard errors
        assert tensor.mean().abs().item() < 4 * expected[name] / math.sqrt(tensor.numel()), name
        assert tensor.std().item() == pytest.approx(expected[name], rel=0.04), name


def test_normal_init_is_initializer_range():
    config = DCFormerConfig(**BIG, dynamic_init="normal", initializer_range=0.2)
    torch.manual_seed(0)
    normal = sample_stds(DCFormerForCausalLM(config))
    torch.manual_seed(0)
    authors = sample_stds(DCFormerForCausalLM(DCFormerConfig(**BIG, initializer_range=0.2)))
    for name, tensor in normal.items():
        assert tensor.std().item() == pytest.approx(0.2, rel=0.04), name
        assert authors[name].std().item() != pytest.approx(0.2, rel=0.5), name  # the option changes the init


def test_loading_a_checkpoint_keeps_its_dynamic_weights(tmp_path):
    small = dict(vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=32)
    torch.manual_seed(0)
    model = DCFormerForCausalLM(DCFormerConfig(**small, dynamic_init="normal"))
    model.save_pretrained(tmp_path)
    torch.manual_seed(1)
    fresh = DCFormerForCausalLM(DCFormerConfig(**small))  # built from its config: the authors' init
    assert sample_stds(fresh)["dw1"].std().item() == pytest.approx(authors_stds(32, 4, 1, 2)["dw1"], rel=0.1)
    for init_name in ("authors", "normal"):
        torch.manual_seed(1)
        loaded = DCFormerForCausalLM.from_pretrained(tmp_path, dynamic_init=init_name)
        assert loaded.config.dynamic_init == init_name
        for name, tensor in sample_stds(loaded).items():
            assert torch.equal(tensor, sample_stds(model)[name]), name


def test_unknown_dynamic_init_is_refused():
    with pytest.raises(ValueError, match="dynamic_init must be one of"):
        DCFormerConfig(**BIG, dynamic_init="xavier")
