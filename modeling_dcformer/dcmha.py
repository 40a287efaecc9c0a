"""DCMHA: one interface for every implementation of the attention (`DCFormerConfig.dcmha_implementation`).

An attention call is a `DCMHAInputs`; an implementation is a backend in the registry `DCMHA_BACKENDS`
(`DCMHAInterface`, in the style of transformers' `AttentionInterface`):

    backend(inputs, *, output_attentions, recompute) -> (output [B, T, N, Dh], probabilities [B, N, T, S] or None)
    backend.why_not(inputs, output_attentions) -> None if it can compute this call, else the reason

Built in: "eager" (the reference, `dcmha_eager.py`), "compiled" (`dcmha_compiled.py`), "kernel" (the CPU C++
kernel, `cpu_kernel.py`) and "triton" (`triton_kernel.py`). The kernels are imported on first use and are not part
of the remote code a saved model carries: there they are unavailable, and "auto" does without them. "auto" is
`choose_auto`. A user registers a backend of their own with `DCMHAInterface.register("name", backend)`, where
`backend` is a `DCMHABackend` or any function with the call signature above, and then sets
`config.dcmha_implementation = "name"`.
"""

import importlib
import importlib.util
import os
import shutil
from dataclasses import dataclass, field

import torch
from transformers.utils import logging
from transformers.utils.generic import GeneralInterface

from . import configuration_dcformer

logger = logging.get_logger(__name__)

# "auto" compiles an attention call whose chunks compute at least this many scores in all (heads x queries x keys
# each chunk sees): below it, eager ops are as fast and no compilation is paid.
AUTO_COMPILE_MIN_SCORES = 1 << 20
# Local layers take chunks of at most max(LOCAL_CHUNK_MIN, window // 2) queries: a chunk of c queries touches
# c + window - 1 keys, so the scores computed are within 1.5x of the window band (3x with c = 512, window 256).
LOCAL_CHUNK_MIN = 64


@dataclass
class DCMHAInputs:
    """One causal (optionally windowed) DCMHA call.

    query [B, N, T, Dh]; key, value [B, N, S, Dh].
    query_terms [B, T, G, 2, 2I+1, M]: the queries' factors of the slots (pre, post), rows w1, w2, dd
        (`DynamicWeightProjection`'s packing), or None: plain multi-head attention (use_dcmha=False).
    key_terms [B, S, G, 2, 2I+1, M] or None (query-wise or plain).
    query_start, key_start: absolute token index (past tokens included) of the first query and the first key; the
        queries are consecutive tokens, and so are the keys. A query at index i sees a key at index j when j <= i,
        j > i - window_size on a local layer, and the key is not padding (key_padding_mask [B, S] bool, True for
        real tokens, or None).
    chunk_size: queries per chunk for the backends that work in chunks (local layers use smaller ones).
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    query_terms: torch.Tensor | None
    key_terms: torch.Tensor | None
    query_start: int
    key_start: int
    key_padding_mask: torch.Tensor | None
    window_size: int | None
    rank: int
    num_groups: int
    chunk_size: int
    _time_last: tuple | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def shapes(self) -> tuple[int, int, int, int, int]:
        """(B, N, T, S, Dh)."""
        B, N, T, Dh = self.query.shape
        return B, N, T, self.key.shape[2], Dh

    @property
    def composed(self) -> bool:
        return self.query_terms is not None

    @property
    def plain_causal(self) -> bool:
        """Every query sees exactly the keys up to itself (no window, no padding, queries are the keys or one query):
        plain causal attention needs no mask."""
        _, _, T, S, _ = self.shapes
        if self.window_size is not None or self.key_padding_mask is not None:
            return False
        return T == 1 or (T == S and self.query_start == self.key_start)

    @property
    def queries_per_chunk(self) -> int:
        if self.window_size is None:
            return self.chunk_size
        return min(self.chunk_size, max(LOCAL_CHUNK_MIN, self.window_size // 2))

    @property
    def num_scores(self) -> int:
        """Scores the call's chunks compute in all (heads x queries x keys each chunk sees): what "auto" weighs."""
        _, N, T, S, _ = self.shapes
        keys = S if self.window_size is None else min(S, self.queries_per_chunk + self.window_size - 1)
        return N * T * keys

    def tensors(self) -> tuple:
        return (self.query, self.key, self.value, self.query_terms, self.key_terms)

    def needs_grad(self) -> bool:
        """Whether autograd records this call (some input requires a gradient and grad mode is on)."""
        return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in self.tensors())

    @property
    def symbolic_lengths(self) -> bool:
        """Whether the lengths or start indices are symbolic (torch.export's dynamic dims, torch.compile's dynamic
        shapes): then the number of chunks cannot depend on them."""
        _, _, T, S, _ = self.shapes
        return not all(isinstance(n, int) for n in (T, S, self.query_start, self.key_start))

    def chunk_spans(self) -> list[tuple[int, int, int, int]]:
        """(t0, t1, s0, s1) for each chunk of queries: queries [t0, t1) and the keys [s0, s1) they can see (indices
        into the call's queries and keys). With symbolic lengths, one chunk: every query against every key, masked."""
        _, _, T, S, _ = self.shapes
        if self.symbolic_lengths:
            return [(0, T, 0, S)]
        spans = []
        for t0 in range(0, T, self.queries_per_chunk):
            t1 = min(T, t0 + self.queries_per_chunk)
            first, last = self.query_start + t0, self.query_start + t1 - 1  # absolute indices of the queries
            s1 = min(S, last - self.key_start + 1)
            s0 = 0 if self.window_size is None else max(0, first - self.window_size + 1 - self.key_start)
            spans.append((t0, t1, s0, s1))
        return spans

    def chunk_is_masked(self, t0: int, t1: int, s0: int, s1: int) -> bool:
        """Whether some query of the chunk cannot see some key of [s0, s1) (padding counts; with symbolic lengths,
        always: the chunk is the whole call)."""
        if self.key_padding_mask is not None or self.symbolic_lengths:
            return True
        first, last = self.query_start + t0, self.query_start + t1 - 1
        sees_all = self.key_start + s1 - 1 <= first and (
            self.window_size is None or self.key_start + s0 > last - self.window_size
        )
        return not sees_all

    def time_last_terms(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The factors with time last and contiguous: [B, G, 2, 2I+1, M, T] and [B, G, 2, 2I+1, M, S] (or None).
        Computed once per call (a plain attribute, not functools.cached_property, whose lock torch.compile cannot
        trace)."""
        if self._time_last is None:
            self._time_last = (time_last(self.query_terms), time_last(self.key_terms))
        return self._time_last


def time_last(terms: torch.Tensor | None) -> torch.Tensor | None:
    """Composition factors [B, T, G, C, 2I+1, M] laid out time-last, [B, G, C, 2I+1, M, T] (contiguous)."""
    return None if terms is None else terms.permute(0, 2, 3, 4, 5, 1).contiguous()


def visible_keys(
    q_pos: torch.Tensor, k_pos: torch.Tensor, window_size: int | None, key_padding_mask: torch.Tensor | None
) -> torch.Tensor:
    """[1 or B, 1, c, s] bool: the query at absolute position q_pos[t] sees the key at k_pos[s] (causal, within the
    window, and the key is a real token where key_padding_mask [B, s] is given)."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window_size is not None:
        allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window_size)
    allowed = allowed[None, None]
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask[:, None, None, :]
    return allowed


def packed(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` with standard (row-major) strides (`.contiguous()` keeps odd strides on size-1 dims)."""
    return tensor.clone(memory_format=torch.contiguous_format)


def join_chunks(outputs: list[torch.Tensor]) -> torch.Tensor:
    """The chunks' outputs [B, c, N, Dh] along the queries; a single chunk (a decode step) is returned as it is."""
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)


class DCMHABackend:
    """One implementation of DCMHA. Subclasses set `name`, implement `__call__`, and extend `why_not` with what they
    cannot compute. A backend whose build or compilation fails records it with `record_failure`: from then on
    `why_not` gives that reason, and "auto" does without it."""

    name: str = "?"
    failure: str | None = None

    def why_not(self, inputs: DCMHAInputs, output_attentions: bool = False) -> str | None:
        return self.failure

    def __call__(self, inputs: DCMHAInputs, *, output_attentions: bool = False, recompute: bool = False):
        raise NotImplementedError

    def record_failure(self, err: BaseException) -> None:
        self.failure = f"it failed to build here ({type(err).__name__}: {str(err)[:300]})"
        logger.warning(f'DCMHA "{self.name}" {self.failure}; dcmha_implementation="auto" does without it')


class UnavailableBackend(DCMHABackend):
    """A built-in backend whose module cannot be imported here (the kernels are not shipped as remote code)."""

    def __init__(self, name: str, reason: str):
        self.name, self.failure = name, reason

    def __call__(self, inputs, *, output_attentions=False, recompute=False):
        raise ValueError(f'dcmha_implementation="{self.name}" is unavailable: {self.failure}')


class LazyBackend(DCMHABackend):
    """A built-in backend imported from `module` (a sibling of this file) on first use."""

    def __init__(self, name: str, module: str, attribute: str):
        self.name, self._module, self._attribute = name, module, attribute
        self._backend: DCMHABackend | None = None

    @property
    def backend(self) -> DCMHABackend:
        if self._backend is None:
            try:
                module = importlib.import_module(f".{self._module}", __package__)
                self._backend = getattr(module, self._attribute)
            except ImportError as err:  # remote code: the kernels stay in the installed package
                self._backend = UnavailableBackend(
                    self.name, f"its module is not here ({err}); `pip install modeling-dcformer` provides it"
                )
                logger.info(f'DCMHA "{self.name}" is unavailable: {self._backend.failure}')
        return self._backend

    def why_not(self, inputs, output_attentions=False):
        return self.backend.why_not(inputs, output_attentions)

    def __call__(self, inputs, *, output_attentions=False, recompute=False):
        return self.backend(inputs, output_attentions=output_attentions, recompute=recompute)

    def record_failure(self, err):
        self.backend.record_failure(err)


class DCMHAInterface(GeneralInterface):
    """The registry of DCMHA implementations: name -> backend. `DCMHAInterface.register(name, backend)` adds one
    for every model of the process (the name becomes a valid `dcmha_implementation`)."""

    _global_mapping: dict = {}

    @classmethod
    def register(cls, key: str, value) -> None:
        if key == "auto":
            raise ValueError('"auto" is the selection rule, not a backend: register under another name')
        super().register(key, value)
        configuration_dcformer.REGISTERED_IMPLEMENTATIONS.add(key)


def choose_auto(inputs: DCMHAInputs, output_attentions: bool = False):
    """"auto": the CPU kernel wherever it can compute the call (CPU, no gradient needed); else "compiled" for calls
    big enough to pay for compilation (`AUTO_COMPILE_MIN_SCORES`) where torch.compile can generate code; else
    "eager". (Under torch.compile or torch.export, `dcmha_attention` runs "eager" without asking.)"""
    backends = DCMHA_BACKENDS
    if backends["kernel"].why_not(inputs, output_attentions) is None:
        return backends["kernel"]
    if inputs.num_scores >= AUTO_COMPILE_MIN_SCORES and backends["compiled"].why_not(inputs, output_attentions) is None:
        return backends["compiled"]
    return backends["eager"]


# Under torch.compile or torch.export these run the eager chunks: the tracer records PyTorch ops, which the enclosing
# compiler fuses (an exported program holds them, and needs neither the CPU kernel nor a compiler to run).
TRACED_AS_EAGER = ("auto", "compiled", "kernel")


def dcmha_attention(
    inputs: DCMHAInputs, implementation: str = "auto", *, output_attentions: bool = False, recompute: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """DCMHA with the implementation named `implementation` ("auto": `choose_auto`). Returns the output
    [B, T, N, Dh] and, with `output_attentions`, the composed probabilities [B, N, T, S] (fp32) it was computed from.
    Plain attention (no composition terms) always runs "eager" (SDPA): the implementations differ only in Compose.
    Under torch.compile or torch.export, "auto", "compiled" and "kernel" run "eager" (`TRACED_AS_EAGER`). A backend
    that can compute the call but cannot return the probabilities ("triton") leaves an output_attentions call to
    "eager", with a warning once."""
    eager = DCMHA_BACKENDS["eager"]
    if not inputs.composed or (torch.compiler.is_compiling() and implementation in TRACED_AS_EAGER):
        return eager(inputs, output_attentions=output_attentions, recompute=recompute)
    if implementation == "auto":
        backend = choose_auto(inputs, output_attentions)
    else:
        if implementation not in DCMHA_BACKENDS:
            raise ValueError(
                f"dcmha_implementation={implementation!r} is not registered; choose one of "
                f"{['auto', *DCMHA_BACKENDS]}"
            )
        backend = DCMHA_BACKENDS[implementation]
        why_not = getattr(backend, "why_not", lambda inputs, output_attentions: None)
        problem = why_not(inputs, output_attentions)
        if problem is not None and output_attentions:
            problem_without = why_not(inputs, False)
            if problem_without is None:
                logger.warning_once(
                    f'dcmha_implementation="{implementation}": {problem}; calls with output_attentions=True run '
                    '"eager" instead (the same numbers)'
                )
                backend = eager
            problem = problem_without
        if problem is not None:
            raise ValueError(
                f'dcmha_implementation="{implementation}" cannot compute this attention: {problem}. '
                'Use "auto" (the CPU kernel where it applies, "compiled" or "eager" elsewhere).'
            )
    if implementation != "auto" or backend is eager:
        return backend(inputs, output_attentions=output_attentions, recompute=recompute)
    try:
        return backend(inputs, output_attentions=output_attentions, recompute=recompute)
    except Exception as err:  # "auto" only: a machine where the backend cannot build its code
        backend.record_failure(err)
        return eager(inputs, output_attentions=output_attentions, recompute=recompute)


def compile_supported(device: torch.device) -> bool:
    """Whether torch.compile's default backend can generate code for `device` here."""
    if device.type == "cpu":
        return any(shutil.which(cxx) for cxx in (os.environ.get("CXX", "g++"), "g++", "c++", "clang++"))
    if device.type == "cuda":
        return importlib.util.find_spec("triton") is not None
    return False


from .dcmha_compiled import COMPILED  # noqa: E402  (the backends import the helpers above)
from .dcmha_eager import EagerBackend  # noqa: E402

DCMHAInterface._global_mapping.update(
    {
        "eager": EagerBackend(),
        "compiled": COMPILED,
        "kernel": LazyBackend("kernel", "cpu_kernel", "KERNEL"),
        "triton": LazyBackend("triton", "triton_kernel", "TRITON"),
    }
)
DCMHA_BACKENDS = DCMHAInterface()
