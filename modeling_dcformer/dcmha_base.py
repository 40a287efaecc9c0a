"""What every DCMHA backend shares: the inputs of a call (`DCMHAInputs`) and of a chunk (`DCMHAChunk`), the backend
base class (`DCMHABackend`) and the chunk and mask helpers. It imports no backend; `dcmha.py` holds the registry, the
"auto" rule and the dispatch."""

import importlib.util
import os
import shutil
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)

# Local layers take chunks of at most max(LOCAL_CHUNK_MIN, window // 2) queries: a chunk of c queries touches
# c + window - 1 keys, so the scores computed are within 1.5x of the window band (3x with c = 512, window 256).
LOCAL_CHUNK_MIN = 64


class DCMHAChunk(NamedTuple):
    """One chunk of queries against the keys it may see (`dcmha_eager.attend_chunk`); a NamedTuple of plain tensors.
    query [B, N, c, Dh]; key, value [B, Nkv, s, Dh] (value None where only the probabilities are wanted; Nkv divides
    N, query head n uses key/value head n // (N / Nkv));
    query_terms [B, G, 2, 2I+1, M, c], key_terms [B, G, 2, 2I+1, M, s] (slots pre, post; time last) or None;
    query_pos [c], key_pos [s]: absolute positions, only where the chunk is masked (else None); key_padding_mask
    [B, s] bool or None; masked: whether some query of the chunk cannot see some key (False for a decode step without
    padding: no mask is applied, none is built)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor | None
    query_terms: torch.Tensor | None
    key_terms: torch.Tensor | None
    query_pos: torch.Tensor | None
    key_pos: torch.Tensor | None
    key_padding_mask: torch.Tensor | None
    window_size: int | None
    masked: bool
    rank: int
    num_groups: int


@dataclass
class DCMHAInputs:
    """One causal (optionally windowed) DCMHA call.

    query [B, N, T, Dh]; key, value [B, Nkv, S, Dh]: Nkv key/value heads (Nkv divides N; Nkv == N is plain
        multi-head attention), query head n with key/value head n // (N / Nkv) (transformers' `repeat_kv`). A backend
        reads Nkv as `key.shape[1]`, and need not copy K/V per query head: with query contiguous, its [B, N, T, Dh]
        is [B, Nkv, N/Nkv * T, Dh] (`dcmha_eager.grouped_matmul`).
    query_terms [B, T, G, 2, 2I+1, M]: the queries' factors of the slots (pre, post), rows w1, w2, dd
        (`DynamicWeightProjection`'s packing), or None: plain multi-head attention (use_dcmha=False).
    key_terms [B, S, G, 2, 2I+1, M] or None (query-wise or plain).
    query_start, key_start: absolute token index (past tokens included) of the first query and the first key: ints,
        or a 0-dim tensor for the queries of a static cache under torch.compile (its length, as transformers' static
        layers keep it: one graph for every step), read as symbolic (one chunk, masked). The queries are consecutive
        tokens, and so are the keys. A query at index i sees a key at index j when j <= i,
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
        """(B, N, T, S, Dh); the key/value heads are `key.shape[1]`."""
        B, N, T, Dh = self.query.shape
        return B, N, T, self.key.shape[2], Dh

    @property
    def composed(self) -> bool:
        return self.query_terms is not None

    @property
    def plain_causal(self) -> bool:
        """Every query sees exactly the keys up to itself (no window, no padding, queries are the keys or one query
        after its keys): plain causal attention needs no mask."""
        _, _, T, S, _ = self.shapes
        unmasked = self.window_size is None and self.key_padding_mask is None
        if not unmasked or isinstance(self.query_start, torch.Tensor):  # a static cache's buffers hold unfilled keys
            return False
        ends_at_query = self.key_start + S == self.query_start + 1  # one query: the last key is its own
        return (T == 1 and ends_at_query) or (T == S and self.query_start == self.key_start)

    @property
    def queries_per_chunk(self) -> int:
        if self.window_size is None:
            return self.chunk_size
        return min(self.chunk_size, max(LOCAL_CHUNK_MIN, self.window_size // 2))

    @property
    def num_scores(self) -> int:
        """Scores the call's chunks compute in all (batch x heads x queries x keys each chunk sees): what "auto"
        weighs. The batch counts: a training batch of 16 short rows is as much elementwise work as one long row."""
        B, N, T, S, _ = self.shapes
        keys = S if self.window_size is None else min(S, self.queries_per_chunk + self.window_size - 1)
        return B * N * T * keys

    @property
    def symbolic_lengths(self) -> bool:
        """Whether the lengths or start indices are symbolic (torch.export's dynamic dims, torch.compile's dynamic
        shapes, a static cache's length as a tensor): then the number of chunks cannot depend on them."""
        _, _, T, S, _ = self.shapes
        return not all(isinstance(n, int) for n in (T, S, self.query_start, self.key_start))

    def chunk_spans(self, max_queries: int | None = None,
                    queries: int | None = None) -> list[tuple[int, int, int, int]]:  # fmt: skip
        """(t0, t1, s0, s1) per chunk of queries_per_chunk (at most max_queries) queries, or of `queries` queries
        where a backend sizes its chunks itself: queries [t0, t1), the keys [s0, s1) they can see (indices into the
        call's). With symbolic lengths, one chunk: all against all, masked."""
        _, _, T, S, _ = self.shapes
        if self.symbolic_lengths:
            return [(0, T, 0, S)]
        step = queries or min(self.queries_per_chunk, max_queries or self.queries_per_chunk)
        spans = []
        for t0 in range(0, T, step):
            t1 = min(T, t0 + step)
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
        """The factors with time last and contiguous: [B, G, 2, 2I+1, M, T] and [B, G, 2, 2I+1, M, S] (or None). Once
        per call (a plain attribute, not functools.cached_property, whose lock torch.compile cannot trace)."""
        if self._time_last is None:
            self._time_last = (time_last(self.query_terms), time_last(self.key_terms))
        return self._time_last

    def chunk(self, span: tuple[int, int, int, int], with_values: bool = True) -> DCMHAChunk:
        """The chunk `span` = (t0, t1, s0, s1) of `chunk_spans`: queries [t0, t1) against keys [s0, s1)."""
        t0, t1, s0, s1 = span
        device = self.query.device
        qt, kt = self.time_last_terms()
        pad = self.key_padding_mask
        masked = self.chunk_is_masked(t0, t1, s0, s1)
        return DCMHAChunk(
            query=self.query[:, :, t0:t1], key=self.key[:, :, s0:s1],
            value=self.value[:, :, s0:s1] if with_values else None,
            query_terms=None if qt is None else qt[..., t0:t1], key_terms=None if kt is None else kt[..., s0:s1],
            query_pos=token_positions(self.query_start, t0, t1, device) if masked else None,
            key_pos=token_positions(self.key_start, s0, s1, device) if masked else None,
            key_padding_mask=None if pad is None else packed(pad[:, s0:s1]), window_size=self.window_size,
            masked=masked, rank=self.rank, num_groups=self.num_groups,
        )


def token_positions(start, lo: int, hi: int, device: torch.device) -> torch.Tensor:
    """The absolute positions start + lo .. start + hi - 1 ([hi - lo]); `start` an int, or a tensor (a static cache's
    length under torch.compile)."""
    if isinstance(start, int):
        return torch.arange(start + lo, start + hi, device=device)
    return torch.arange(lo, hi, device=device) + start


def time_last(terms: torch.Tensor | None) -> torch.Tensor | None:
    """Composition factors [B, T, G, C, 2I+1, M] laid out time-last, [B, G, C, 2I+1, M, T] (contiguous)."""
    return None if terms is None else terms.permute(0, 2, 3, 4, 5, 1).contiguous()


def visible_keys(q_pos: torch.Tensor, k_pos: torch.Tensor, window_size: int | None,
                 key_padding_mask: torch.Tensor | None) -> torch.Tensor:
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


def kv_heads_problem(inputs: DCMHAInputs) -> str | None:
    """Why the call's key/value heads do not fit its query heads (None: they do: Nkv divides N, keys and values
    alike)."""
    N, Nkv = inputs.query.shape[1], inputs.key.shape[1]
    if Nkv < 1 or N % Nkv or inputs.value.shape[:3] != inputs.key.shape[:3]:
        return (f"its keys {tuple(inputs.key.shape)} and values {tuple(inputs.value.shape)} need a number of heads "
                f"that divides the queries' {N} (grouped-query attention), the same for both")
    return None


class DCMHABackend:
    """One implementation of DCMHA, as the registry (`dcmha.DCMHAInterface`) holds it.

    name        its `dcmha_implementation` value
    auto_rank   where "auto" tries it: the highest rank first (`dcmha.choose_auto`); None: used only when named
    traced_as_eager  under torch.compile or torch.export it runs the eager chunks instead (the tracer records PyTorch
                ops, which the enclosing compiler fuses; an exported program then needs none of its code)
    failure     why it cannot run here, once building or compiling its code failed: from then on "auto" does without
                it, and naming it is an error that says why

    A subclass implements `__call__` and extends what applies: `why_not` (what it cannot compute; cheap: it never
    builds anything), `why_not_auto` (what "auto" should not give it although it could compute it, such as calls too
    small to pay for a compilation), `prepare` (builds or loads its code: slow, once) and `project` (the
    dynamic-weight projection, where it has its own)."""

    name: str = "?"
    auto_rank: int | None = None
    traced_as_eager: bool = False
    failure: str | None = None

    def why_not(self, inputs: DCMHAInputs, output_attentions: bool = False) -> str | None:
        """Why it cannot compute the call `inputs` (None: it can)."""
        return self.failure or kv_heads_problem(inputs)

    def why_not_auto(self, inputs: DCMHAInputs, output_attentions: bool = False) -> str | None:
        """Why "auto" should not choose it for the call `inputs` (None: it may)."""
        return self.why_not(inputs, output_attentions)

    def prepare(self) -> None:
        """Build or load what it runs (a no-op where nothing is built); raises with the reason, recorded in
        `failure`."""
        if self.failure is not None:
            raise RuntimeError(self.failure)

    def project(self, x: torch.Tensor, dw1: torch.Tensor, qkw: torch.Tensor, dd: torch.Tensor, rank: int,
                eps: float) -> torch.Tensor | None:
        """The dynamic-weight projection of x [B, T, D] (`DynamicWeightProjection`: the factors [B*T, G, C, 2I+1, M])
        where this backend has its own for this call; None: the model computes it with PyTorch ops."""
        return None

    def __call__(self, inputs: DCMHAInputs, *, output_attentions: bool = False, recompute: bool = False):
        raise NotImplementedError

    def record_failure(self, err: BaseException) -> None:
        """Remember that building or running its code failed here (said once, as a warning)."""
        if self.failure is None:
            self.failure = f"it failed to build here ({type(err).__name__}: {str(err)[:300]})"
            logger.warning(f'DCMHA "{self.name}" {self.failure}; dcmha_implementation="auto" does without it')


def compile_supported(device: torch.device) -> bool:
    """Whether torch.compile's default backend can generate code for `device` here."""
    if device.type == "cpu":
        return any(shutil.which(cxx) for cxx in (os.environ.get("CXX", "g++"), "g++", "c++", "clang++"))
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None
