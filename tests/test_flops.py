"""dcformer_research.flops (the FLOP axis of the comparison, docs/evidence.md "Three axes") checked
against independent counts of the real models: torch.utils.flop_counter.FlopCounterMode on DCFormer and GPT-NeoX
forward and backward passes (matrix products), and a count of the elementwise multiplications and additions the
eager Compose performs (torch's dispatcher sees every op; FlopCounterMode counts only products)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from modeling_dcformer import DCFormerConfig, DCFormerForCausalLM
from modeling_dcformer.dcmha_eager import compose
from dcformer_research import flops

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

SHAPE = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=80)
BATCH, T = 3, 24  # T below attention_chunk_size: the eager DCMHA scores the full T x T square in one chunk


def dc_config(**overrides) -> DCFormerConfig:
    return DCFormerConfig(
        **SHAPE, max_position_embeddings=64, dcmha_implementation="eager", attention_recompute=False, **overrides
    )


def counted(model, ids, train: bool) -> int:
    with FlopCounterMode(display=False) as counter:
        if train:
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        else:
            with torch.no_grad():
                model(input_ids=ids, use_cache=False)
    return counter.get_total_flops()


@pytest.mark.parametrize("overrides", [{}, {"query_wise": True}, {"num_head_groups": 2, "dynamic_rank": 1}])
def test_dcformer_matrix_products_match_flop_counter(overrides):
    """Dense, attention and DCMHA projection terms equal FlopCounterMode's count exactly, forward and training
    (backward = 2 x forward); Compose is elementwise, which FlopCounterMode does not count."""
    config = dc_config(**overrides)
    torch.manual_seed(0)
    model = DCFormerForCausalLM(config)
    ids = torch.randint(0, SHAPE["vocab_size"], (BATCH, T))
    terms = flops.forward_flops(config.to_dict(), T, attention="full")
    products = terms["total"] - terms["dcmha_compose"]
    assert terms["dcmha_projection"] > 0 and terms["dcmha_compose"] > 0
    assert counted(model, ids, train=False) == BATCH * products
    model.train()
    assert counted(model, ids, train=True) == 3 * BATCH * products


def test_transformer_matches_flop_counter():
    config = GPTNeoXConfig(**SHAPE, max_position_embeddings=64, attn_implementation="eager")
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(config)
    ids = torch.randint(0, SHAPE["vocab_size"], (BATCH, T))
    terms = flops.forward_flops(config.to_dict(), T, attention="full")
    assert terms["dcmha_projection"] == terms["dcmha_compose"] == 0
    assert counted(model, ids, train=False) == BATCH * terms["total"]
    model.train()
    assert counted(model, ids, train=True) == flops.training_flops(config.to_dict(), BATCH * T, T, attention="full")


class ElementwiseCounter(TorchDispatchMode):
    """Elements written by multiplications and additions: one FLOP each."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mul, torch.ops.aten.add):
            self.count += out.numel()
        return out


@pytest.mark.parametrize("query_wise", [False, True])
def test_compose_term_matches_the_eager_compose(query_wise):
    """The Compose term per (query, key) pair against the multiplications and additions the eager `compose`
    executes. The formula counts the spec's operations; the code saves a little, and the gap is exact: per pair,
    the first of the M products of each hidden value needs no addition (I G per side), and the query-wise
    diagonal is folded into the identity (A (1 + qdd): N additions fewer per pair, B G M T additions more).
    The gap is under 20% of the term here (3 heads a group; less with more heads a group)."""
    B, G, M, I, S = 2, 2, 3, 2, 40
    config = dict(SHAPE, num_attention_heads=G * M, num_head_groups=G, dynamic_rank=I, dynamic_hidden_size=8)
    config.update(model_type="dcformer", query_wise=query_wise, layer_types=["full_attention"] * 2)
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(B, G, M, S, S, generator=gen)
    query_terms = torch.randn(B, G, 2 * I + 1, M, S, generator=gen)
    key_terms = None if query_wise else torch.randn(B, G, 2 * I + 1, M, S, generator=gen)
    with ElementwiseCounter() as counter:
        compose(scores, query_terms, key_terms, I)
    sides, N, pairs = (1 if query_wise else 2), G * M, B * S * S
    # one Compose is one slot pair (pre or post) of one layer: the formula's term covers 2 phases x 2 layers
    per_compose = B * flops.forward_flops(config, S, attention="full")["dcmha_compose"] / 4
    assert per_compose == pairs * sides * (4 * I + 2) * N
    gap = pairs * (sides * I * G + N) - B * G * M * S
    assert counter.count == per_compose - gap
    assert counter.count == pytest.approx(per_compose, rel=0.20)


def test_attention_pairs_causal_full_and_window():
    assert flops.attention_pairs(5, mode="full") == 25
    assert flops.attention_pairs(5) == 15 == sum(t + 1 for t in range(5))
    assert flops.attention_pairs(6, window=2) == sum(min(t + 1, 2) for t in range(6))
    assert flops.attention_pairs(4, window=8) == 10  # a window longer than the sequence: global
    with pytest.raises(ValueError, match="attention mode"):
        flops.attention_pairs(4, mode="half")


def test_local_layers_and_static_ablation():
    """A local layer scores fewer pairs; the static ablation has Compose but no projections; more tokens scale
    the training count linearly."""
    local = dc_config(window_size=4, window_type="LG").to_dict()
    glob = dc_config().to_dict()
    assert flops.forward_flops(local, T)["attention"] < flops.forward_flops(glob, T)["attention"]
    static = flops.forward_flops(glob, T, kind="static")
    assert static["dcmha_projection"] == 0 and static["dcmha_compose"] == flops.forward_flops(glob, T)["dcmha_compose"]
    assert flops.training_flops(glob, 2000, T) == pytest.approx(2 * flops.training_flops(glob, 1000, T))
    with pytest.raises(ValueError, match="seq_len"):
        flops.forward_flops(glob, 0)
