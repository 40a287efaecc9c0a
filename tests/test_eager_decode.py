"""An "eager" decode step in few ops: on a GPU each ATen op is at least one kernel launch, and a decoding step of a
small batch is launch-bound.

- The ATen ops of one decode step (torch.profiler on the CPU, counted as `benchmarks/profile_shapes.py --ops` counts
  them: ops called from Python that can launch a kernel) at DCPythia-6.9B's head structure (32 heads) and
  Pythia-160M's (12 heads), in fp32 and bf16, against transformers' GPT-NeoX of the same shape: at most 1.5x.
- Chunks of few queries (a decode step, assisted decoding's drafts) are composed batched over the heads, longer ones
  with the loop over heads and ranks: both against the float64 oracle, with padding and a window; a decode step
  without padding builds no mask.
"""

import ast
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache, GPTNeoXConfig, GPTNeoXForCausalLM

from modeling_dcformer import DCFormerCache, DCFormerConfig, DCFormerForCausalLM, dcmha_eager
from modeling_dcformer.dcmha import DCMHAInputs, dcmha_attention
from modeling_dcformer.modeling_dcformer import CACHE_NAME
from oracle import oracle_attention

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

PROFILE_SHAPES = Path(__file__).resolve().parents[1] / "benchmarks" / "profile_shapes.py"
# preset -> hidden size of the tiny model: the preset's heads, 8 or 16 dimensions each (rotary on a quarter)
PRESETS = {"dcpythia-pythia-6.9b": 256, "dcpythia-pythia-160m": 192}
MAX_RATIO = 1.5


def no_launch_ops() -> set[str]:
    """The ops `profile_shapes.py --ops` leaves out (views, metadata, allocation), read from the script."""
    for node in ast.parse(PROFILE_SHAPES.read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "NO_LAUNCH":
            return ast.literal_eval(node.value)
    raise AssertionError(f"no NO_LAUNCH set in {PROFILE_SHAPES}")


def launches(step, skip: set[str]) -> list[str]:
    """The ATen ops of one call of `step` that can launch a kernel: called from Python, not from another ATen op."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    nested = lambda e: e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")  # noqa: E731
    return [e.name for e in prof.events() if e.name.startswith("aten::") and not nested(e) and e.name not in skip]


def tiny_models(preset: str, dtype: torch.dtype):
    hidden = PRESETS[preset]
    dc = DCFormerConfig.from_preset(preset, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                                    vocab_size=64, dcmha_implementation="eager")
    neox = GPTNeoXConfig(
        vocab_size=dc.vocab_size, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=dc.num_attention_heads,
        intermediate_size=dc.intermediate_size, hidden_act=dc.hidden_act, attention_bias=dc.attention_bias,
        use_parallel_residual=dc.use_parallel_residual, partial_rotary_factor=dc.partial_rotary_factor,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    models = DCFormerForCausalLM(dc), GPTNeoXForCausalLM._from_config(neox, attn_implementation="sdpa")
    return [model.to(dtype).eval() for model in models]


def decode_step_ops(model, skip: set[str]) -> list[str]:
    """The ops of one single-token step after a prompt of 8 tokens and one step (the cache's storage settled)."""
    cache = DCFormerCache(model.config) if isinstance(model, DCFormerForCausalLM) else DynamicCache(config=model.config)
    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(0))

    def step(t):
        with torch.inference_mode():
            model(input_ids=ids[:, t : t + 1], use_cache=True, **{CACHE_NAME: cache})

    with torch.inference_mode():
        model(input_ids=ids[:, :8], use_cache=True, **{CACHE_NAME: cache})
    step(8)
    return launches(lambda: step(9), skip)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("preset", list(PRESETS))
def test_a_decode_step_launches_at_most_one_and_a_half_times_gpt_neox_ops(preset, dtype):
    skip = no_launch_ops()
    dc, neox = tiny_models(preset, dtype)
    dc_ops, neox_ops = decode_step_ops(dc, skip), decode_step_ops(neox, skip)
    assert "aten::scaled_dot_product_attention" in neox_ops and "aten::softmax" in dc_ops  # both attended
    ratio = len(dc_ops) / len(neox_ops)
    assert ratio <= MAX_RATIO, f"DCFormer {len(dc_ops)} ops, GPT-NeoX {len(neox_ops)}: {sorted(dc_ops)}"


def attention_inputs(T: int, S: int, key_wise: bool, window: int | None, padded: bool, chunk: int):
    """fp32 inputs of one call (the DCPythia-6.9B group shape, 32 heads, rank 2) of T queries, the last T of S keys."""
    B, N, G, I, Dh = 2, 32, 1, 2, 8
    gen = torch.Generator().manual_seed(T + S)
    q, k, v = (torch.randn(B, N, t, Dh, generator=gen) for t in (T, S, S))
    qt = torch.randn(B, T, G, 2, 2 * I + 1, 32, generator=gen) * 0.3
    kt = torch.randn(B, S, G, 2, 2 * I + 1, 32, generator=gen) * 0.3 if key_wise else None
    pad = None
    if padded:
        pad = torch.ones(B, S, dtype=torch.bool)
        pad[0, :3] = False  # left padding of the first row
    return DCMHAInputs(q, k, v, qt, kt, S - T, 0, pad, window, I, G, chunk)


def oracle_of(inputs: DCMHAInputs) -> torch.Tensor:
    args = (inputs.query, inputs.key, inputs.value, inputs.query_terms, inputs.key_terms)
    return oracle_attention(*(None if t is None else t.double() for t in args), inputs.key_padding_mask,
                            inputs.query_start, inputs.key_start, inputs.window_size, inputs.rank)


@pytest.mark.parametrize("padded", [False, True], ids=["no-padding", "padding"])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("key_wise", [True, False])
def test_few_and_many_query_chunks_match_the_oracle(key_wise, window, padded, monkeypatch):
    """40 queries after 5 cached keys in chunks of 32 and 8, then drafts of 3 and a decode step: each chunk of at
    most BATCHED_MAX_QUERIES queries is composed batched, the others with the loops; every output is the oracle's."""
    batched = []
    real = dcmha_eager.few_query_probabilities

    def spy(chunk, scale):
        batched.append(chunk.query.shape[2])
        return real(chunk, scale)

    monkeypatch.setattr(dcmha_eager, "few_query_probabilities", spy)
    for T, chunk, expected in ((40, 32, [8]), (40, 8, [8] * 5), (3, 32, [3]), (1, 32, [1])):
        batched.clear()
        inputs = attention_inputs(T, 45, key_wise, window, padded, chunk)
        with torch.no_grad():
            out, _ = dcmha_attention(inputs, "eager")
        torch.testing.assert_close(out.double(), oracle_of(inputs), atol=2e-5, rtol=1e-4)
        assert batched == expected, (T, chunk, batched)  # 40 in chunks of 32: one of 32 with the loops, then 8


def test_a_decode_step_without_padding_builds_no_mask(monkeypatch):
    """A step's one query sees every key of a global layer: no positions, no mask, no masked_fill."""
    chunks = []
    real = dcmha_eager.attend_chunk

    def spy(chunk, stages):
        chunks.append(chunk)
        return real(chunk, stages)

    monkeypatch.setattr(dcmha_eager, "attend_chunk", spy)
    inputs = attention_inputs(1, 45, True, None, False, 128)
    with torch.no_grad():
        out, _ = dcmha_attention(inputs, "eager")
    torch.testing.assert_close(out.double(), oracle_of(inputs), atol=2e-5, rtol=1e-4)
    (chunk,) = chunks
    assert not chunk.masked and chunk.query_pos is None and chunk.key_pos is None
    padded = attention_inputs(1, 45, True, None, True, 128)  # padding: the mask is built from the positions
    chunk = padded.chunk(padded.chunk_spans()[0])
    assert chunk.masked and chunk.query_pos.tolist() == [44] and chunk.key_pos.tolist() == list(range(45))
