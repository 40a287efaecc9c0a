"""The "compiled" DCMHA backend: the eager chunks with each Compose step's two stages (`dcmha_eager.stage_hidden`,
`stage_apply`: the same Python code) compiled by torch.compile. The matrix products and the softmax stay PyTorch's
own kernels; Inductor writes each stage's result once (one fused kernel re-derived the hidden values for every
output head and the composed scores in every softmax pass, and its softmax was slower than PyTorch's).
"""

from collections.abc import Callable

import torch
import torch.fx.experimental._config

from .dcmha_base import DCMHAInputs, compile_supported
from .dcmha_eager import EagerBackend, stage_apply, stage_hidden


def mark_dynamic(tensor: torch.Tensor | None, *dims: int) -> None:
    """Mark dims of a compiled stage's argument dynamic (batch, query and key lengths: one compilation serves every
    chunk); the others (heads, head size, ranks) stay static, so that the generated loops over them are unrolled
    and vectorised."""
    if tensor is not None:
        for dim in dims:
            torch._dynamo.maybe_mark_dynamic(tensor, dim % tensor.dim())  # a negative dim would be ignored


# The dims of each stage's arguments that are dynamic (argument position -> dims): batch, queries and keys.
# Scores and hidden values [B, G, M or I, c, s]; factors [B, G, 2I+1, M, c or s]; positions [c], [s]; padding [B, s].
DYNAMIC_DIMS = {
    stage_hidden: {0: (0, -2, -1), 1: (0, -1), 2: (0, -1)},
    stage_apply: {0: (0, -2, -1), 1: (0, -1), 2: (0, -1), 3: (0, -2, -1), 4: (0, -2, -1), 5: (0,), 6: (0,), 7: (0, -1)},
}


class CompiledBackend(EagerBackend):
    """"compiled": `EagerBackend`'s chunks with compiled stages. Every graph of a stage must be the one its inputs
    select, in the forward pass and in the recomputation of a checkpointed chunk alike; a later, more general graph
    must never shadow an earlier one. So the lengths are dynamic from the first call, and nothing else becomes
    dynamic later: no automatic dynamic shapes (a new batch size, window or scale gets a graph specialised to it)
    and no duck sizing (a chunk with as many queries as keys gets no graph of its own)."""

    name = "compiled"
    compile_backend = "inductor"  # the tests use "aot_eager" (same tracing and autograd, no C++ to build)

    def __init__(self):
        self._stages: tuple[Callable, Callable] | None = None

    @property
    def stages(self) -> tuple[Callable, Callable]:
        if self._stages is None:
            self._stages = (self._compile(stage_hidden), self._compile(stage_apply))
        return self._stages

    def reset(self, compile_backend: str | None = None) -> None:
        """Forget the compiled stages and any recorded failure (optionally switching torch.compile's backend)."""
        self._stages, self.failure = None, None
        if compile_backend is not None:
            self.compile_backend = compile_backend

    def _compile(self, fn: Callable) -> Callable:
        compiled = torch.compile(fn, backend=self.compile_backend)
        dynamic = DYNAMIC_DIMS[fn]

        def run(*args):
            for position, dims in dynamic.items():
                mark_dynamic(args[position], *dims)
            with (
                torch.fx.experimental._config.patch(use_duck_shape=False),
                torch._dynamo.config.patch(automatic_dynamic_shapes=False, recompile_limit=64),
            ):
                return compiled(*args)

        return run

    def why_not(self, inputs: DCMHAInputs, output_attentions: bool = False) -> str | None:
        if self.failure is not None:
            return self.failure
        if not compile_supported(inputs.query.device):
            return f"torch.compile cannot generate code for {inputs.query.device.type} here"
        return None



COMPILED = CompiledBackend()
