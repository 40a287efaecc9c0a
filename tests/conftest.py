"""Shared fixtures: tiny DCFormer configs and models whose composition weights actually matter."""

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Without a GPU the Triton kernels run in Triton's CPU interpreter: it is read when the kernels are defined, so
# before the package is imported (test_dcmha_triton.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import modeling_dcformer  # noqa: E402,F401  (registers model_type "dcformer" with the Auto classes)
from modeling_dcformer import DCFormerConfig, DCFormerForCausalLM  # noqa: E402

# The CPU kernel built with extra compiler flags (before anything loads it): test_dcmha_cpu.py's
# test_the_8_wide_build_matches_the_oracle_too runs the oracle tests with "-mno-avx512f" on an AVX-512 CPU, so that
# the AVX2 CPUs' build is tested on the machines whose native build is the AVX-512 one.
if os.environ.get("DCFORMER_TEST_KERNEL_CFLAGS"):
    from modeling_dcformer.kernels import dcmha_cpu

    dcmha_cpu.CPU.library.cflags += os.environ["DCFORMER_TEST_KERNEL_CFLAGS"].split()

TINY = dict(
    vocab_size=100,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=128,
    eos_token_id=None,  # generation runs to max_new_tokens unless a test asks otherwise
)


def _one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Tiny models gain nothing from intra-op threads, and on a busy 2-core machine spinning OpenMP workers make them
# 20-50x slower; one thread also makes the fp32 logits of two processes bit-identical (test_hub). A module takes
# one of these with `pytestmark = pytest.mark.usefixtures(...)`; the previous count is restored afterwards.
one_thread_per_module = pytest.fixture(scope="module", name="one_thread_per_module")(_one_torch_thread)
one_thread_each_test = pytest.fixture(name="one_thread_each_test")(_one_torch_thread)  # for tests that set threads


def randomize_dyn_w(model: torch.nn.Module, std: float = 0.5, seed: int = 1234) -> torch.nn.Module:
    """Overwrite every DCMHA dynamic-weight parameter (dw1, qkw, dd) with N(0, std^2): the default init is so
    small that a caching or padding bug in the composition terms would hide under the tolerances."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "dyn_w_proj" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * std)
    return model


@pytest.fixture
def tiny_config():
    """Factory: `tiny_config(**overrides)` -> a DCFormerConfig of a tiny model (hidden 32, 4 heads, vocab 100)."""

    def make(**overrides) -> DCFormerConfig:
        return DCFormerConfig(**{**TINY, **overrides})

    return make


@pytest.fixture
def tiny_model(tiny_config):
    """Factory: `tiny_model(seed=0, dyn_std=0.5, **config_overrides)` -> an fp32 DCFormerForCausalLM in eval mode
    with randomised dynamic-weight projections (`dyn_std=None` keeps the default init)."""

    def make(seed: int = 0, dyn_std: float | None = 0.5, **overrides) -> DCFormerForCausalLM:
        torch.manual_seed(seed)
        model = DCFormerForCausalLM(tiny_config(**overrides)).eval()
        if dyn_std is not None:
            randomize_dyn_w(model, std=dyn_std, seed=seed + 1)
        return model

    return make


@pytest.fixture(scope="module")
def aot_eager_compile():
    """"compiled" through torch.compile's `aot_eager` backend for a module's tests: the same tracing, dynamic shapes
    and autograd as with Inductor, without generating C++ (seconds instead of a minute). Once for the module: the
    stages' graphs serve every test (their lengths are dynamic); Inductor again afterwards. A module takes it with
    `pytestmark = pytest.mark.usefixtures("aot_eager_compile")`, a test by naming it."""
    from modeling_dcformer.dcmha_compiled import COMPILED

    torch._dynamo.reset()
    COMPILED.reset("aot_eager")
    yield
    COMPILED.reset("inductor")
    torch._dynamo.reset()

