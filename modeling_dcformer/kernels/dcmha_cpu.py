"""The "cpu" DCMHA backend: Compose, mask, softmax and Compose again in one C++ operator that works in place on a
chunk's raw q.k scores, a few query rows at a time, so that each row's scores stay in the core's cache between the
steps and no [heads, chunk, keys] tensor is allocated between the two matrix products.

The operators are `csrc/dcmha_cpu.cpp` (package data), built on first use (`build.OperatorLibrary`: the compiler,
the cache folder, the stamp and the lock). `torch.ops.dcformer.compose_softmax_compose_` is the forward operator; it
has a fake (meta) implementation, so torch.compile and export see it, and its tiles run on PyTorch's intra-op thread
pool (`at::parallel_for`). Training goes through `KernelAttention`: its backward pass recomputes each chunk's products
and probabilities and runs the second operator, `torch.ops.dcformer.compose_softmax_compose_backward_` (the
gradients of the products and of the composition factors, 16 query rows against blocks of 64 keys at a time), so
"auto" uses it for training on CPU too. Two more operators serve inference: `torch.ops.dcformer.dynamic_terms`, the
dynamic-weight projection in one call (`CPUBackend.project`), and `torch.ops.dcformer.dcmha_decode`, a few queries'
whole attention in one call (`decode_attention`: a decode step). A save's remote code does not carry this file.

Grouped-query attention: the keys and values have Nkv heads (Nkv dividing the N query heads), and query head n reads
key/value head n // (N / Nkv). No path copies them per query head: the products take the query heads that share a
key/value head as one batch entry (`kv_groups`), and the decode operator indexes the key/value head itself.
"""

import contextlib
import os
from pathlib import Path
from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable
from transformers.utils import logging

from ..dcmha_base import DCMHABackend, DCMHAInputs, join_chunks, kv_heads_problem
from .build import OperatorLibrary

logger = logging.get_logger(__name__)

MAX_RANK = 8  # dynamic_rank supported by the kernel (its per-block buffers are sized by it)
MAX_HEADS_BACKWARD = 256  # heads per group its backward pass supports (MAX_HEADS in the source)
SOURCE = Path(__file__).with_name("csrc") / "dcmha_cpu.cpp"
# below this many scores a chunk runs on the calling thread: waking the pool costs more than a decode step's work
PARALLEL_MIN_SCORES = 1 << 18
# calls with at most this many queries (a decode step, assisted decoding's drafts) go to one operator call
DECODE_MAX_QUERIES = 16
# the kernel's chunks hold at most this many queries (fewer where attention_chunk_size says so): a causal chunk of c
# queries computes about c / 2 masked products a row, so 64 instead of 128 computes 25% fewer scores at 128 tokens
# and 6% fewer at 1,024 (a training step 0.93-1.04x, median 0.99: docs/performance.md)
CHUNK_QUERIES = 64
# a chunk's scores are laid out so that one head's rows start this many floats after the previous head's, modulo
# 4 KiB (1,024 floats): the operator's block stride (STRIDE in csrc/dcmha_cpu.cpp), where its Compose works on the
# scores in place instead of on copies (`score_layout`)
HEAD_STAGGER = 144
_parallel_pid: int | None = None  # the process whose thread pool the kernel has used


def needs_grad(inputs: DCMHAInputs) -> bool:
    """Whether autograd records the call `inputs` (some input requires a gradient and grad mode is on)."""
    tensors = (inputs.query, inputs.key, inputs.value, inputs.query_terms, inputs.key_terms)
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def runs_parallel(num_scores: int) -> bool:
    """Whether a chunk of `num_scores` scores spreads its tiles over PyTorch's intra-op threads: big chunks, with more
    than one thread, and never in a process forked after the kernel ran in parallel (GNU OpenMP, PyTorch's pool
    here, is not fork-safe: the child would wait forever for its parent's threads; PyTorch's own parallel ops hang
    there too unless the child calls `torch.set_num_threads(1)`)."""
    global _parallel_pid
    if num_scores < PARALLEL_MIN_SCORES or torch.get_num_threads() < 2:
        return False
    if _parallel_pid is None:
        _parallel_pid = os.getpid()
    return _parallel_pid == os.getpid()


def score_layout(B: int, N: int, c: int, s: int, stagger: int = HEAD_STAGGER) -> tuple[int, tuple[int, int, int, int]]:
    """How `kernel_forward` lays out a chunk's scores [B, N, c, s]: each head's c rows of s keys contiguous, the heads
    `stagger` (HEAD_STAGGER) floats apart modulo 4 KiB (rows of contiguous heads at 1,024 keys would lie a multiple
    of 4 KiB apart, in the same few L1 cache sets, and the operator would work on copies). Returns the floats the
    chunk needs and its strides."""
    head = -(-c * s // 1024) * 1024 + stagger
    return B * N * head, (N * head, head, s, 1)


def kv_groups(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """x [B, N, L, X] as [B * Nkv, N / Nkv, L, X]: batch entry b * Nkv + h holds the query heads that read key/value
    head h (a view where x allows one, else a copy)."""
    B, N, L, X = x.shape
    return x.reshape(B * kv_heads, N // kv_heads, L, X)


def chunk_rows(x: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
    """The rows [t0, t1) of `kv_groups`'s x [B * Nkv, rep, L, X] as one matrix per batch entry, [B * Nkv, rep * c, X]
    (rep heads of c rows): the operand of a product that sums over a key/value head's query heads. A view where
    rep == 1 or the rows are all of x's, else a copy (of c rows a head: far fewer floats than the chunk's scores)."""
    BK, rep, _, X = x.shape
    return x[:, :, t0:t1].reshape(BK, rep * (t1 - t0), X)


def rows_per_tile(num_heads_per_group: int, keys: int, budget_floats: int = 1 << 18) -> int:
    """Query rows per tile: a tile's scores (rows x heads x keys) fill about 1 MiB, one core's L2 cache."""
    return max(1, min(64, budget_floats // max(1, num_heads_per_group * keys)))


class CPUBackend(DCMHABackend):
    """"cpu": per chunk, q.k into one buffer reused by every chunk, the operator in place on it, then @ v; with
    gradients, `KernelAttention` (which recomputes each chunk in the backward pass, whatever `recompute` says: it
    keeps nothing of a chunk). "auto" takes it first wherever it can compute the call."""

    name = "cpu"
    auto_rank = 30
    traced_as_eager = True

    def __init__(self, library: OperatorLibrary | None = None):
        self.library = library if library is not None else OperatorLibrary(SOURCE)
        self.failure: str | None = None

    def prepare(self) -> None:
        """Build (once per machine) and load the operators; a RuntimeError with the reason where that fails."""
        if not self.library.loaded:
            self.library.load()
            register_fake()

    def record_failure(self, err: BaseException) -> None:
        if self.failure is None:  # the library's reason where it could not be built, else what failed
            self.failure = self.library.failure or f"it failed here ({type(err).__name__}: {str(err)[:300]})"
            logger.warning(f'DCMHA "cpu": {self.failure}; dcmha_implementation="auto" does without it')

    # -- the interface -------------------------------------------------------------------------------------------
    def project(self, x: torch.Tensor, dw1: torch.Tensor, qkw: torch.Tensor, dd: torch.Tensor, rank: int,
                eps: float) -> torch.Tensor | None:
        """The dynamic-weight projection of x [B, T, D] with the parameters dw1 [D, G, C, K], qkw [G, C, K, 2I, M], dd
        [D, G, C*M] by `dynamic_terms` (the factors [B*T, G, C, 2I+1, M]) where it may run: at most
        DECODE_MAX_QUERIES rows (batch x time), no gradient recorded (the operator has none), all float32 on CPU, not
        under autocast (whose products are in half precision), nothing being traced, and the operators built here
        (or building now); else None. Its checks are few and cheap: it runs at every layer of every decode step,
        where each Python call costs microseconds (docs/performance.md)."""
        D = x.shape[-1]
        if x.numel() > DECODE_MAX_QUERIES * D or not x.is_cpu or x.dtype != torch.float32:
            return None  # more rows: ATen's batched products beat the operator's loop per row (docs/performance.md)
        if dw1.dtype != torch.float32 or qkw.dtype != torch.float32 or dd.dtype != torch.float32:
            return None
        if torch.is_grad_enabled() and (x.requires_grad or dw1.requires_grad or qkw.requires_grad or dd.requires_grad):
            return None
        if torch.is_autocast_enabled("cpu") or torch.compiler.is_compiling():
            return None
        try:
            self.prepare()  # returns at once when built; a failed build is remembered and raises at once
        except RuntimeError as err:
            self.record_failure(err)
            return None
        return dynamic_terms(x, dw1, dd, qkw, rank, eps)  # the operator views them 2-D itself

    def why_not(self, inputs: DCMHAInputs, output_attentions: bool = False) -> str | None:
        if not inputs.composed:
            return "no composition (use_dcmha=False)"
        if not inputs.query.is_cpu:
            return f"it runs on CPU, not on {inputs.query.device.type}"
        if needs_grad(inputs) and output_attentions:
            return "it returns no gradient through the attention probabilities (output_attentions in training)"
        if inputs.rank > MAX_RANK:
            return f"it supports dynamic_rank <= {MAX_RANK}"
        if needs_grad(inputs) and inputs.query.shape[1] // inputs.num_groups > MAX_HEADS_BACKWARD:
            return f"its backward pass supports up to {MAX_HEADS_BACKWARD} heads a group"
        problem = kv_heads_problem(inputs)
        if problem is not None:
            return problem
        return self.failure or self.library.unavailable()

    def __call__(self, inputs: DCMHAInputs, *, output_attentions: bool = False, recompute: bool = False):
        B, N, T, S, Dh = inputs.shapes
        if is_decode_call(inputs, output_attentions):
            return decode_attention(inputs), None
        qt, kt = (None if t is None else t.float() for t in inputs.time_last_terms())
        pad = None if inputs.key_padding_mask is None else inputs.key_padding_mask.to(torch.uint8).contiguous()
        spans = inputs.chunk_spans(CHUNK_QUERIES)
        if not spans:
            probs = inputs.query.new_zeros(B, N, 0, S, dtype=torch.float32) if output_attentions else None
            return inputs.query.new_zeros(B, 0, N, Dh), probs
        call = KernelCall(spans, pad, inputs.query_start, inputs.key_start, inputs.window_size, Dh**-0.5, inputs.rank,
                          inputs.num_groups)
        if needs_grad(inputs):  # the forward pass keeps only its inputs; the backward pass recomputes each chunk
            return KernelAttention.apply(call, inputs.query, inputs.key, inputs.value, qt, kt), None
        return kernel_forward(call, inputs.query, inputs.key, inputs.value, qt, kt, output_attentions)


def is_decode_call(inputs: DCMHAInputs, output_attentions: bool = False) -> bool:
    """Whether the call goes to `decode_attention`: at most DECODE_MAX_QUERIES queries with at least one key,
    fp32, no gradient, no probabilities returned."""
    _, _, T, S, _ = inputs.shapes
    fp32 = inputs.query.dtype == inputs.key.dtype == inputs.value.dtype == torch.float32
    return (0 < T <= DECODE_MAX_QUERIES and S > 0 and fp32 and not output_attentions and not inputs.symbolic_lengths
            and not needs_grad(inputs))


def decode_attention(inputs: DCMHAInputs) -> torch.Tensor:
    """A few queries (a decode step, or a few draft tokens) in one operator call, `torch.ops.dcformer.dcmha_decode`:
    the same arithmetic as the chunked path (q.k, then the operator of `compose_softmax_compose`, then times the
    values), with the factors read where the model and its cache keep them, and each query head's key/value head
    read where it is (no copy per query head). Returns the output [B, T, N, Dh]."""
    CPU.prepare()
    B, N, T, S, Dh = inputs.shapes
    pad = inputs.key_padding_mask
    pad = None if pad is None else pad.to(torch.uint8).contiguous()
    try:
        return torch.ops.dcformer.dcmha_decode(
            inputs.query, inputs.key, inputs.value, inputs.query_terms, inputs.key_terms, pad, inputs.query_start,
            inputs.key_start, inputs.window_size or 0, Dh**-0.5, inputs.rank, inputs.num_groups,
            runs_parallel(B * N * T * S) and B * inputs.num_groups > 1,
        )  # fmt: skip
    except RuntimeError as err:
        raise operator_error(err) from err


class KernelCall(NamedTuple):
    """What a kernel call needs besides its tensors: the chunks (`DCMHAInputs.chunk_spans`), the keys' padding
    ([B, S] uint8 or None), the absolute index of the first query and key, the window, the scale, rank and groups."""

    spans: list
    pad: torch.Tensor | None
    query_start: int
    key_start: int
    window_size: int | None
    scale: float
    rank: int
    num_groups: int


def kernel_forward(call: KernelCall, query, key, value, query_terms, key_terms, output_attentions: bool = False,
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per chunk: q.k into one buffer reused by every chunk (laid out by `score_layout`), the operator in place on
    it, then @ v. Returns the output [B, T, N, Dh] and, with `output_attentions`, the probabilities [B, N, T, S].
    key, value [B, Nkv, S, Dh]: the rep = N / Nkv query heads of a key/value head are products of their own (one
    batched product per r < rep, over the B * Nkv key/value heads), written into the staggered layout, which a
    single product of a group's rep * c rows could not write."""
    B, N, T, Dh = query.shape
    Nkv, S = key.shape[1], key.shape[2]
    rep = N // Nkv
    q = kv_groups(query, Nkv)  # views where they can be (batch 1): the products take strides
    k = key.reshape(B * Nkv, S, Dh)
    v = value.reshape(B * Nkv, S, Dh)
    probs_all = q.new_zeros(B, N, T, S, dtype=torch.float32) if output_attentions else None
    layouts = [score_layout(B, N, t1 - t0, s1 - s0) for t0, t1, s0, s1 in call.spans]
    buffer = torch.empty(max(size for size, _ in layouts), dtype=torch.float32)
    outputs = []
    for (t0, t1, s0, s1), (_, strides) in zip(call.spans, layouts):
        c, s = t1 - t0, s1 - s0
        scores = buffer.as_strided((B, N, c, s), strides)  # the products write into the layout
        heads = scores.view(B * Nkv, rep, c, s)
        out = v.new_empty(B * Nkv, rep, c, Dh)
        k_t = k[:, s0:s1].transpose(1, 2)
        for r in range(rep):
            if q.dtype == torch.float32:
                torch.bmm(q[:, r, t0:t1], k_t, out=heads[:, r])
            else:  # products in the model's dtype, then fp32, as in the eager chunks
                heads[:, r].copy_(torch.bmm(q[:, r, t0:t1], k_t))
        chunk_probabilities(call, scores, query_terms, key_terms, t0, s0)
        for r in range(rep):
            torch.bmm(heads[:, r].to(v.dtype), v[:, s0:s1], out=out[:, r])
        outputs.append(out.view(B, N, c, Dh).transpose(1, 2))
        if probs_all is not None:
            probs_all[:, :, t0:t1, s0:s1] = scores
    return join_chunks(outputs), probs_all


def chunk_probabilities(call: KernelCall, scores, query_terms, key_terms, t0: int, s0: int) -> torch.Tensor:
    """The operator on one chunk's raw q.k products `scores` [B, N, c, s] (in place): its probabilities."""
    return compose_softmax_compose(
        scores, query_terms, t0, key_terms, s0, call.pad, call.query_start + t0, call.key_start + s0,
        call.window_size, call.scale, call.rank, call.num_groups,
    )  # fmt: skip


class KernelAttention(torch.autograd.Function):
    """`kernel_forward` with its gradient. The forward pass saves only its inputs (like `attention_recompute`, at no
    extra cost: nothing of a chunk is kept); the backward pass recomputes each chunk's q.k products and probabilities
    (fp32), then the backward operator gives the gradients of the products and of the factors, and the products'
    gradients give those of q, k and v. With grouped keys and values (Nkv heads) each product takes a key/value
    head's rep query heads as one matrix of rep * c rows (`chunk_rows`), so the products of dk and dv sum over them
    themselves."""

    @staticmethod
    def forward(ctx, call: KernelCall, query, key, value, query_terms, key_terms):
        ctx.call = call
        ctx.save_for_backward(query, key, value, query_terms, key_terms)
        return kernel_forward(call, query, key, value, query_terms, key_terms)[0]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        call = ctx.call
        query, key, value, query_terms, key_terms = ctx.saved_tensors
        B, N, T, Dh = query.shape
        Nkv, S = key.shape[1], key.shape[2]
        q = kv_groups(query, Nkv).float()  # [B * Nkv, rep, T, Dh]
        k, v = (x.reshape(B * Nkv, S, Dh).float() for x in (key, value))
        grad = kv_groups(grad_output.transpose(1, 2), Nkv).float()  # [B, T, N, Dh] -> [B * Nkv, rep, T, Dh]
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)  # the chunks cover every query
        dqt = torch.zeros_like(query_terms)
        dkt = None if key_terms is None else torch.zeros_like(key_terms)
        for t0, t1, s0, s1 in call.spans:
            c, s = t1 - t0, s1 - s0
            qc, g = chunk_rows(q, t0, t1), chunk_rows(grad, t0, t1)  # [B * Nkv, rep * c, Dh]
            scores = torch.bmm(qc, k[:, s0:s1].transpose(1, 2))  # the products, then the probabilities
            dscores = torch.bmm(g, v[:, s0:s1].transpose(1, 2))  # the probabilities' gradient, then the products'
            compose_softmax_compose_backward(
                scores.view(B, N, c, s), dscores.view(B, N, c, s), query_terms, t0, key_terms, s0, call.pad,
                call.query_start + t0, call.key_start + s0, call.window_size, call.scale, call.rank,
                call.num_groups, dqt, dkt,
            )  # fmt: skip
            # the products write into (or add to) the gradients' rows in place: no temporary, no extra pass (but for
            # dq's rows of a chunk of grouped heads, which are no one matrix: a copy of c rows a head)
            dv[:, s0:s1].baddbmm_(scores.transpose(1, 2), g)
            if dq.shape[1] == 1 or (t0, t1) == (0, T):
                torch.bmm(dscores, k[:, s0:s1], out=dq[:, :, t0:t1].view(dscores.shape[0], -1, Dh))
            else:
                dq[:, :, t0:t1] = torch.bmm(dscores, k[:, s0:s1]).view(-1, dq.shape[1], c, Dh)
            dk[:, s0:s1].baddbmm_(dscores.transpose(1, 2), qc)
        shaped = (x.view(t.shape).to(t.dtype) for x, t in ((dq, query), (dk, key), (dv, value)))
        return None, *shaped, dqt, dkt


def register_fake() -> None:
    """The operator's fake (meta) implementation, for torch.compile and export: it only writes into `scores`."""
    if getattr(register_fake, "done", False):
        return

    @torch.library.register_fake("dcformer::compose_softmax_compose_")
    def _(scores, query_terms, t0, key_terms, s0, key_padding_mask, query_pos0, key_pos0, window, scale, rank,
          num_groups, rows, parallel):  # fmt: skip
        return None

    @torch.library.register_fake("dcformer::compose_softmax_compose_backward_")
    def _(raw, grad, query_terms, t0, key_terms, s0, key_padding_mask, query_pos0, key_pos0, window, scale, rank,
          num_groups, query_terms_grad, key_terms_grad, parallel):  # fmt: skip
        return None

    @torch.library.register_fake("dcformer::dcmha_decode")
    def _(query, key, value, query_terms, key_terms, key_padding_mask, query_pos0, key_pos0, window, scale, rank,
          num_groups, parallel):  # fmt: skip
        return query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])

    @torch.library.register_fake("dcformer::dynamic_terms")
    def _(x, dw1, dd, qkw, rank, eps, parallel):
        G, C, _, _, M = qkw.shape
        return x.new_empty(x.numel() // x.shape[-1], G, C, 2 * rank + 1, M)

    register_fake.done = True


CPU = CPUBackend()


def ensure_built() -> bool:
    """Build the operators if need be (about 30 s, once per machine) and say whether they run here. For the cheap
    question, without building, ask `CPU.why_not(inputs)`."""
    try:
        CPU.prepare()
        return True
    except RuntimeError:
        return False


def vector_width() -> int:
    """The floats the kernel's Compose works on at once: 16 where it was built for AVX-512 (`-march=native` on such a
    CPU), 8 otherwise (builds it if need be)."""
    CPU.prepare()
    return int(torch.ops.dcformer.vector_width())


def block_stride() -> int:
    """The head stagger (floats, modulo 4 KiB) at which the forward operator composes the scores in place (STRIDE in
    csrc/dcmha_cpu.cpp); HEAD_STAGGER must equal it (builds the kernel if need be)."""
    CPU.prepare()
    return int(torch.ops.dcformer.block_stride())


def checked_operands(rank: int, key_padding_mask: torch.Tensor | None, **tensors: torch.Tensor | None):
    """What both operators' wrappers do before calling them: load the kernel, check the tensors (named by their
    keywords) and the rank with clear errors, and return the padding mask as the operators take it (uint8)."""
    CPU.prepare()
    for name, tensor in tensors.items():
        if tensor is not None and (tensor.dtype != torch.float32 or not tensor.is_contiguous() or tensor.is_cuda):
            raise ValueError(f"the DCMHA CPU kernel takes contiguous float32 CPU tensors; {name} is not")
    if rank > MAX_RANK:
        raise ValueError(f"the DCMHA CPU kernel supports dynamic_rank <= {MAX_RANK}, got {rank}")
    return None if key_padding_mask is None else key_padding_mask.to(torch.uint8).contiguous()


@contextlib.contextmanager
def operator_errors():
    """The operators' own argument checks (RuntimeError from C++) as a ValueError with their first line."""
    try:
        yield
    except RuntimeError as err:
        raise operator_error(err) from err


def operator_error(err: RuntimeError) -> ValueError:
    """An operator's RuntimeError as `operator_errors` raises it (the inference operators, called at every decode
    step, catch it themselves: a context manager is two more Python calls)."""
    return ValueError(f"DCMHA CPU kernel: {str(err).splitlines()[0]}")


def compose_softmax_compose(
    scores: torch.Tensor,
    query_terms: torch.Tensor,
    t0: int,
    key_terms: torch.Tensor | None,
    s0: int,
    key_padding_mask: torch.Tensor | None,
    query_pos0: int,
    key_pos0: int,
    window_size: int | None,
    scale: float,
    rank: int,
    num_groups: int,
) -> torch.Tensor:
    """In place on `scores` ([B, N, c, s] fp32, the raw q.k products of one chunk; contiguous, or any layout of rows
    of contiguous keys that do not overlap, such as `score_layout`'s): Compose (of
    `scores * scale`) with the pre slots, mask, softmax, Compose with the post slots, masked keys set to 0.
    query_terms: [B, G, 2, 2I+1, M, T] and key_terms [B, G, 2, 2I+1, M, S] or None (fp32, contiguous, time last;
    the chunk's queries start at index t0, its keys at s0); key_padding_mask: [B, S] bool/uint8 or None. The
    chunk's query r sits at absolute position query_pos0 + r, its key j at key_pos0 + j. Returns `scores`."""
    if scores.dtype != torch.float32 or scores.device.type != "cpu" or scores.dim() != 4 or scores.stride(-1) != 1:
        raise ValueError("the DCMHA CPU kernel takes float32 CPU scores [B, N, c, s] whose keys are contiguous")
    pad = checked_operands(rank, key_padding_mask, query_terms=query_terms, key_terms=key_terms)
    B, N, c, s = scores.shape
    with operator_errors():
        torch.ops.dcformer.compose_softmax_compose_(
            scores, query_terms, t0, key_terms, s0, pad, query_pos0, key_pos0, window_size or 0, scale, rank,
            num_groups, rows_per_tile(N // num_groups, s), runs_parallel(scores.numel()),
        )  # fmt: skip
    return scores


def compose_softmax_compose_backward(
    raw: torch.Tensor,
    grad: torch.Tensor,
    query_terms: torch.Tensor,
    t0: int,
    key_terms: torch.Tensor | None,
    s0: int,
    key_padding_mask: torch.Tensor | None,
    query_pos0: int,
    key_pos0: int,
    window_size: int | None,
    scale: float,
    rank: int,
    num_groups: int,
    query_terms_grad: torch.Tensor,
    key_terms_grad: torch.Tensor | None,
) -> torch.Tensor:
    """The gradient of `compose_softmax_compose` for one chunk. raw: the chunk's q.k products [B, N, c, s] (as the
    forward pass got them), overwritten with the probabilities (what `compose_softmax_compose` returns: the values'
    gradient needs them); grad: the gradient of the probabilities, overwritten with the gradient of raw (returned).
    The factors' gradients are added to query_terms_grad and key_terms_grad (laid out like the factors;
    key_terms_grad None exactly when key_terms is). Other arguments as `compose_softmax_compose`."""
    pad = checked_operands(rank, key_padding_mask, raw=raw, grad=grad, query_terms=query_terms, key_terms=key_terms,
                           query_terms_grad=query_terms_grad, key_terms_grad=key_terms_grad)
    B = raw.shape[0]
    with operator_errors():
        torch.ops.dcformer.compose_softmax_compose_backward_(
            raw, grad, query_terms, t0, key_terms, s0, pad, query_pos0, key_pos0, window_size or 0, scale, rank,
            num_groups, query_terms_grad, key_terms_grad, runs_parallel(raw.numel()) and B * num_groups > 1,
        )  # fmt: skip
    return grad


def dynamic_terms(x: torch.Tensor, dw1: torch.Tensor, dd: torch.Tensor, qkw: torch.Tensor, rank: int,
                  eps: float) -> torch.Tensor:
    """The dynamic-weight projection in one operator (inference: no gradient): x [..., D] (fp32, R = batch x time
    rows), dw1 [D, G*C*K], dd [D, G*C*M] (or the parameters as they are, [D, G, C, K] and [D, G, C*M]) and qkw
    [G, C, K, 2I, M] give the factors [R, G, C, 2I+1, M] exactly as `DynamicWeightProjection.forward` packs them (w1
    RMS-normalised with `eps`, w2, tanh of the diagonal)."""
    CPU.prepare()
    parallel = runs_parallel(x.numel() // x.shape[-1] * qkw.numel())  # rows (batch x time, x may be 3-D) x weights
    try:  # the operator checks its operands (fp32 CPU tensors of matching shapes)
        return torch.ops.dcformer.dynamic_terms(x, dw1, dd, qkw, rank, eps, parallel)
    except RuntimeError as err:
        raise operator_error(err) from err
