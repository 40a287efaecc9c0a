"""DCMHA: one interface for every implementation of the attention (`DCFormerConfig.dcmha_implementation`).

A call is a `DCMHAInputs`; an implementation is a backend in the registry `DCMHA_BACKENDS` (a `DCMHAInterface`,
like transformers' `AttentionInterface`):

    backend(inputs, *, output_attentions, recompute) -> (output [B, T, N, Dh], probabilities [B, N, T, S] or None)
    backend.why_not(inputs, output_attentions) -> None if it can compute this call, else the reason

Built in: "eager" (the reference), "compiled", and the kernels "kernel" (CPU) and "triton", imported on first use
(not in a save's remote code). `DCMHAInterface.register("name", backend)` adds one; `dcmha_base.py` holds the rest.
"""

import importlib

import torch
from transformers.utils import logging

from .dcmha_base import (  # noqa: F401  (re-exported: the interface's public names)
    BUILT_IN_IMPLEMENTATIONS, LOCAL_CHUNK_MIN, DCMHABackend, DCMHAChunk, DCMHAInputs, DCMHAInterface,
    compile_supported, implementation_names, join_chunks, packed, time_last, visible_keys,
)
from .dcmha_compiled import COMPILED
from .dcmha_eager import EAGER

logger = logging.get_logger(__name__)

# "auto" compiles (on CUDA: "triton") an attention call whose chunks compute at least this many scores in all (batch x
# heads x queries x keys each chunk sees): below it, eager ops are as fast and no compilation is paid.
AUTO_COMPILE_MIN_SCORES = 1 << 20
AUTO_TRITON_MIN_CAPABILITY = (8, 0)  # "auto" runs "triton" on CUDA GPUs from Ampere on (tested: Hopper)


class LazyBackend(DCMHABackend):
    """A built-in backend imported from `module` (a sibling of this file) on first use; where that module is not
    there (remote code: the kernels stay in the installed package), unavailable, saying why."""

    def __init__(self, name: str, module: str, attribute: str):
        self.name, self._module, self._attribute = name, module, attribute
        self._backend: DCMHABackend | None = None

    @property
    def backend(self) -> DCMHABackend:
        if self._backend is None and self.failure is None:
            try:
                self._backend = getattr(importlib.import_module(f".{self._module}", __package__), self._attribute)
            except ImportError as err:
                self.failure = f"its module is not here ({err}); `pip install modeling-dcformer` provides it"
                logger.info(f'DCMHA "{self.name}" is unavailable: {self.failure}')
        return self._backend or self

    def why_not(self, inputs, output_attentions=False):
        return self.failure if self.backend is self else self.backend.why_not(inputs, output_attentions)

    def __call__(self, inputs, *, output_attentions=False, recompute=False):
        if self.backend is self:
            raise ValueError(f'dcmha_implementation="{self.name}" is unavailable: {self.failure}')
        return self.backend(inputs, output_attentions=output_attentions, recompute=recompute)

    def record_failure(self, err):
        (super() if self.backend is self else self.backend).record_failure(err)


def choose_auto(inputs: DCMHAInputs, output_attentions: bool = False):
    """"auto": the CPU kernel where it can compute the call (inference and training on CPU); for calls of at least
    AUTO_COMPILE_MIN_SCORES scores, "triton" on a CUDA GPU of AUTO_TRITON_MIN_CAPABILITY (chunked "compiled" is
    launch-bound there: docs/benchmarks.md), else "compiled" where torch.compile can generate code; else "eager"."""
    big, device = inputs.num_scores >= AUTO_COMPILE_MIN_SCORES, inputs.query.device
    on_gpu = big and device.type == "cuda" and torch.cuda.get_device_capability(device) >= AUTO_TRITON_MIN_CAPABILITY
    for name, wanted in (("kernel", True), ("triton", on_gpu), ("compiled", big)):
        if wanted and DCMHA_BACKENDS[name].why_not(inputs, output_attentions) is None:
            return DCMHA_BACKENDS[name]
    return DCMHA_BACKENDS["eager"]


# Under torch.compile or torch.export these run the eager chunks: the tracer records PyTorch ops, which the enclosing
# compiler fuses (an exported program holds them, and needs neither the CPU kernel nor a compiler to run).
TRACED_AS_EAGER = ("auto", "compiled", "kernel")


def dcmha_attention(inputs: DCMHAInputs, implementation: str = "auto", *, output_attentions: bool = False,
                    recompute: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """DCMHA with the implementation named `implementation` ("auto": `choose_auto`): the output [B, T, N, Dh] and,
    with `output_attentions`, the composed probabilities [B, N, T, S] (fp32). Plain attention always runs "eager"
    (SDPA); so do traced calls (`TRACED_AS_EAGER`), and output_attentions calls of a backend that cannot return the
    probabilities ("triton"), with a warning once."""
    eager = DCMHA_BACKENDS["eager"]
    if not inputs.composed or (torch.compiler.is_compiling() and implementation in TRACED_AS_EAGER):
        return eager(inputs, output_attentions=output_attentions, recompute=recompute)
    if implementation == "auto":
        backend = choose_auto(inputs, output_attentions)
    else:
        if implementation not in DCMHA_BACKENDS:
            known = list(implementation_names())
            raise ValueError(f"dcmha_implementation={implementation!r} is not registered; choose one of {known}")
        backend = DCMHA_BACKENDS[implementation]
        why_not = getattr(backend, "why_not", lambda inputs, output_attentions: None)
        problem = why_not(inputs, output_attentions)
        if problem is not None and output_attentions:
            problem_without = why_not(inputs, False)
            if problem_without is None:
                logger.warning_once(f'dcmha_implementation="{implementation}": {problem}; calls with '
                                    'output_attentions=True run "eager" instead (the same numbers)')
                backend = eager
            problem = problem_without
        if problem is not None:
            raise ValueError(f'dcmha_implementation="{implementation}" cannot compute this attention: {problem}. '
                             'Use "auto" (the CPU kernel where it applies, "compiled" or "eager" elsewhere).')
    if implementation != "auto" or backend is eager:
        return backend(inputs, output_attentions=output_attentions, recompute=recompute)
    try:
        return backend(inputs, output_attentions=output_attentions, recompute=recompute)
    except Exception as err:  # "auto" only: a machine where the backend cannot build its code
        backend.record_failure(err)
        return eager(inputs, output_attentions=output_attentions, recompute=recompute)


def projection_kernel(implementation: str, x: torch.Tensor, *arguments):
    """The dynamic-weight projection by the CPU kernel's one operator (cpu_kernel's `projection`: x, dw1, qkw, dd,
    rank, eps) where allowed: the factors [B*T, G, C, 2I+1, M]; else None."""
    kernel = DCMHA_BACKENDS["kernel"] if implementation in ("auto", "kernel") else None
    project = getattr(kernel.backend, "projection", None) if isinstance(kernel, LazyBackend) else None
    return None if project is None else project(x, *arguments)


DCMHAInterface._global_mapping.update(eager=EAGER, compiled=COMPILED,
                                      kernel=LazyBackend("kernel", "cpu_kernel", "KERNEL"),
                                      triton=LazyBackend("triton", "triton_kernel", "TRITON"))
DCMHA_BACKENDS = DCMHAInterface()
