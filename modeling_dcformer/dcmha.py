"""DCMHA: one interface for every implementation of the attention (`DCFormerConfig.dcmha_implementation`).

A call is a `DCMHAInputs`; an implementation is a `DCMHABackend` in the registry `DCMHA_BACKENDS` (a
`DCMHAInterface`, like transformers' `AttentionInterface`):

    backend(inputs, *, output_attentions, recompute) -> (output [B, T, N, Dh], probabilities [B, N, T, S] or None)
    backend.why_not(inputs, output_attentions) -> None if it can compute this call, else the reason

Here: "eager" (the reference) and "compiled". The installed package registers its kernels, "cpu" and "triton"
(`modeling_dcformer/kernels`), which a save's remote code does not carry. `DCMHAInterface.register("name", backend)`
adds one. "auto" is not a backend but a rule, `choose_auto`: of the registered backends, the one of highest
`auto_rank` that accepts the call.
"""

import warnings

import torch
from transformers.utils import logging
from transformers.utils.generic import GeneralInterface

from .dcmha_base import (  # noqa: F401  (re-exported: the interface's public names)
    LOCAL_CHUNK_MIN, DCMHABackend, DCMHAChunk, DCMHAInputs, compile_supported, join_chunks, packed, time_last,
    token_positions, visible_keys,
)
from .dcmha_compiled import COMPILED
from .dcmha_eager import EAGER

logger = logging.get_logger(__name__)

# The built-in implementations, in the order the docs list them. "cpu" and "triton" are the installed package's
# kernels: valid names everywhere, registered only where the package is (a save's remote code runs without them).
BUILT_IN_IMPLEMENTATIONS = ("eager", "compiled", "cpu", "triton")
# Old names, accepted with a FutureWarning: name -> the implementation it is now.
RENAMED_IMPLEMENTATIONS = {"kernel": "cpu"}


class FunctionBackend(DCMHABackend):
    """A backend registered as a plain function `fn(inputs, *, output_attentions=False, recompute=False)`: it takes
    every call it is named for, and "auto" never chooses it."""

    def __init__(self, name: str, function):
        self.name, self.function = name, function

    def __call__(self, inputs, *, output_attentions=False, recompute=False):
        return self.function(inputs, output_attentions=output_attentions, recompute=recompute)


class DCMHAInterface(GeneralInterface):
    """The registry of DCMHA implementations: name -> `DCMHABackend`. `DCMHAInterface.register(name, backend)` adds
    one for every model of the process (a plain function is wrapped in a `FunctionBackend`): the name becomes a valid
    `dcmha_implementation` (`implementation_names`), and a backend with an `auto_rank` takes part in "auto"."""

    _global_mapping: dict = {"eager": EAGER, "compiled": COMPILED}
    _auto_order: tuple = ()  # the registered backends with an auto_rank, highest first (kept by register)

    @classmethod
    def register(cls, key: str, value) -> None:
        if key == "auto" or key in RENAMED_IMPLEMENTATIONS:
            raise ValueError(f'"{key}" is not a name a backend can take: register under another name')
        super().register(key, value if isinstance(value, DCMHABackend) else FunctionBackend(key, value))
        cls._auto_order = auto_order(cls._global_mapping.values())

    @classmethod
    def unregister(cls, key: str) -> None:
        """Remove a registered backend (not "eager": "auto" and plain attention fall back to it)."""
        if key == "eager":
            raise ValueError('"eager" is the reference every other path falls back to: it cannot be removed')
        cls._global_mapping.pop(key, None)
        cls._auto_order = auto_order(cls._global_mapping.values())


def auto_order(backends) -> tuple:
    """`backends` that "auto" may choose (an `auto_rank`), from the highest rank down."""
    ranked = [b for b in backends if getattr(b, "auto_rank", None) is not None]
    return tuple(sorted(ranked, key=lambda backend: -backend.auto_rank))


DCMHAInterface._auto_order = auto_order(DCMHAInterface._global_mapping.values())
DCMHA_BACKENDS = DCMHAInterface()


def implementation_names() -> tuple[str, ...]:
    """The valid values of `dcmha_implementation`: "auto", the built-ins, then the names registered since."""
    registered = [name for name in DCMHAInterface._global_mapping if name not in BUILT_IN_IMPLEMENTATIONS]
    return ("auto", *BUILT_IN_IMPLEMENTATIONS, *registered)


def current_name(name: str) -> str:
    """`name`, or the implementation an old name stands for now (with a FutureWarning)."""
    if name in RENAMED_IMPLEMENTATIONS:
        new = RENAMED_IMPLEMENTATIONS[name]
        warnings.warn(f'dcmha_implementation="{name}" is now called "{new}"; "{name}" will stop being accepted',
                      FutureWarning, stacklevel=3)
        return new
    return name


def choose_auto(inputs: DCMHAInputs, output_attentions: bool = False, backends=None) -> DCMHABackend:
    """"auto": of `backends` (default: the registered ones), the one of highest `auto_rank` that has not failed here
    and whose `why_not_auto` accepts the call; "eager" when none does. Built in, from the top: "cpu" wherever it can
    compute the call; "triton" for large calls on CUDA GPUs from Ampere on; "compiled" for large calls where
    torch.compile generates code; "eager"."""
    for backend in DCMHAInterface._auto_order if backends is None else auto_order(backends):
        if backend.failure is None and backend.why_not_auto(inputs, output_attentions) is None:
            return backend
    return EAGER


def named_backend(name: str) -> DCMHABackend:
    """The registered backend `name`, or a ValueError saying why there is none."""
    backend = DCMHAInterface._global_mapping.get(name)
    if backend is not None:
        return backend
    if name in BUILT_IN_IMPLEMENTATIONS:  # a kernel, where only a save's remote code is here
        raise ValueError(f'dcmha_implementation="{name}" is unavailable here: it comes with the installed package '
                         "(pip install modeling-dcformer); 'auto' uses 'compiled' or 'eager' without it")
    raise ValueError(f"dcmha_implementation={name!r} is not registered; choose one of {list(implementation_names())}")


def dcmha_attention(inputs: DCMHAInputs, implementation: str = "auto", *, output_attentions: bool = False,
                    recompute: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """DCMHA with the implementation named `implementation` ("auto": `choose_auto`): the output [B, T, N, Dh] and,
    with `output_attentions`, the composed probabilities [B, N, T, S] (fp32). Plain attention always runs "eager"
    (SDPA); so do traced calls of a backend that is `traced_as_eager`, and output_attentions calls of a backend
    that cannot return the probabilities ("triton"), with a warning once."""
    if not inputs.composed:
        return EAGER(inputs, output_attentions=output_attentions, recompute=recompute)
    name = current_name(implementation)
    if name == "auto":
        return auto_attention(inputs, output_attentions=output_attentions, recompute=recompute)
    backend = named_backend(name)
    if backend.traced_as_eager and torch.compiler.is_compiling():
        return EAGER(inputs, output_attentions=output_attentions, recompute=recompute)
    problem = backend.why_not(inputs, output_attentions)
    if problem is not None and output_attentions:  # what it lacks may be the probabilities alone
        if backend.why_not(inputs, False) is None:
            logger.warning_once(f'dcmha_implementation="{name}": {problem}; calls with output_attentions=True run '
                                '"eager" instead (the same numbers)')
            return EAGER(inputs, output_attentions=output_attentions, recompute=recompute)
        problem = backend.why_not(inputs, False)
    if problem is None:
        try:
            backend.prepare()
        except Exception as err:  # noqa: BLE001  (a build that failed here: its reason)
            backend.record_failure(err)
            problem = backend.failure
    if problem is not None:
        raise ValueError(f'dcmha_implementation="{name}" cannot compute this attention: {problem}. Use "auto" (the '
                         'CPU kernel where it applies, "compiled" or "eager" elsewhere).')
    return backend(inputs, output_attentions=output_attentions, recompute=recompute)


def auto_attention(inputs: DCMHAInputs, *, output_attentions: bool = False, recompute: bool = False):
    """"auto": the backend `choose_auto` gives, prepared first; a backend that fails to build or to run is recorded
    (`DCMHABackend.failure`) and the call goes on without it."""
    tracing = torch.compiler.is_compiling()
    while (backend := choose_auto(inputs, output_attentions)) is not EAGER and not tracing:
        try:
            backend.prepare()
        except Exception as err:  # noqa: BLE001  (any build failure: recorded, and "auto" chooses again)
            backend.record_failure(err)
            continue
        try:
            return backend(inputs, output_attentions=output_attentions, recompute=recompute)
        except Exception as err:  # noqa: BLE001  (a machine where the backend cannot run its code)
            backend.record_failure(err)
            break
    return EAGER(inputs, output_attentions=output_attentions, recompute=recompute)


def project_dynamic_weights(implementation: str, x: torch.Tensor, dw1: torch.Tensor, qkw: torch.Tensor,
                            dd: torch.Tensor, rank: int, eps: float) -> torch.Tensor | None:
    """The dynamic-weight projection by a backend's own code (`DCMHABackend.project`): the named backend's, or with
    "auto" the first in "auto"'s order that takes the call; None: the model computes it with PyTorch ops."""
    if implementation == "auto":
        backends = DCMHAInterface._auto_order
    else:
        backend = DCMHAInterface._global_mapping.get(RENAMED_IMPLEMENTATIONS.get(implementation, implementation))
        backends = () if backend is None else (backend,)
    for backend in backends:
        if backend.failure is None and (terms := backend.project(x, dw1, qkw, dd, rank, eps)) is not None:
            return terms
    return None


__all__ = ["DCMHA_BACKENDS", "DCMHABackend", "DCMHAInputs", "DCMHAInterface", "choose_auto", "dcmha_attention",
           "implementation_names", "project_dynamic_weights"]
