"""The "compiled" DCMHA backend: the eager chunks with each Compose step's two stages (`stage_hidden`, `stage_apply`)
and its written-out gradient (`compose_backward`) compiled by torch.compile; products and softmax stay PyTorch's
(docs/performance.md says why)."""

import functools
from collections.abc import Callable

import torch
import torch.fx.experimental._config

from .dcmha_base import DCMHAInputs, compile_supported, kv_heads_problem, packed, visible_keys
from .dcmha_eager import EagerBackend, stage_apply, stage_hidden

# "auto" compiles an attention call whose chunks compute at least this many scores in all (batch x heads x queries x
# the keys each chunk sees): below it, eager ops are as fast and no compilation is paid.
AUTO_MIN_SCORES = 1 << 20


def compose_backward(grad, raw, query_terms, key_terms, q_pos, k_pos, key_padding_mask, window_size, scale, fill, rank):
    """The gradients of `compose_step` (grad [B, N, c, s]) for raw, query_terms and key_terms, written out per head and
    rank: Inductor makes three passes over the scores where autograd's graph of the stages took ten (performance.md)."""
    B, G, M, c, s = raw.shape
    I, grad = rank, grad.view(B, G, M, c, s)
    if fill is not None:
        grad = grad.masked_fill(~visible_keys(q_pos, k_pos, window_size, key_padding_mask).unsqueeze(1), 0.0)
    x, g = [raw[:, :, n] * scale for n in range(M)], [grad[:, :, m] for m in range(M)]  # [B, G, c, s] each
    sides = [(query_terms, -1)] + ([] if key_terms is None else [(key_terms, -2)])  # factors' time dim in [c, s]
    factor = [lambda row, m, t=terms, d=dim: t[:, :, row, m].unsqueeze(d) for terms, dim in sides]
    hidden = [[sum(x[n] * f(i, n) for n in range(M)) for i in range(I)] for f in factor]
    hidden_grad = [[sum(g[m] * f(I + i, m) for m in range(M)) for i in range(I)] for f in factor]
    raw_grad = [
        g[n] * (1 + sum(f(2 * I, n) for f in factor))
        + sum(gh[i] * f(i, n) for f, gh in zip(factor, hidden_grad) for i in range(I))
        for n in range(M)
    ]
    terms_grad = []
    for (_, dim), h, gh in zip(sides, hidden, hidden_grad):  # sum over the other time dim: rows w1, w2, dd
        rows = [[(gh[i] * x[n]).sum(dim) for n in range(M)] for i in range(I)]
        rows += [[(g[m] * h[i]).sum(dim) for m in range(M)] for i in range(I)]
        rows.append([(g[m] * x[m]).sum(dim) for m in range(M)])
        terms_grad.append(torch.stack([torch.stack(row, dim=2) for row in rows], dim=2))
    return torch.stack(raw_grad, dim=2) * scale, terms_grad[0], terms_grad[1] if key_terms is not None else None


class ComposeStep(torch.autograd.Function):
    """`compose_step` through the compiled stages (hidden, apply, backward); `compose_backward` is its gradient."""

    @staticmethod
    def forward(ctx, stages, raw, query_terms, key_terms, mask, scale, fill, rank):
        hidden_fn, apply_fn, ctx.backward_fn = stages
        # detached (free in forward): the graphs guard on requires_grad, so training and evaluation now share them
        raw, query_terms, key_terms = (None if t is None else t.detach() for t in (raw, query_terms, key_terms))
        ctx.save_for_backward(raw, query_terms, key_terms)
        ctx.args = (*mask, scale, fill, rank)
        hidden = hidden_fn(raw, query_terms, key_terms, scale, rank)
        return apply_fn(raw, query_terms, key_terms, *hidden, *ctx.args)

    @staticmethod
    def backward(ctx, grad):
        grads = ctx.backward_fn(grad.contiguous(), *ctx.saved_tensors, *ctx.args)
        return None, *grads, None, None, None, None


def compiled_step(stages, raw, query_terms, key_terms, mask, scale, fill, rank):
    """`compose_step` through the compiled `stages`, each slot's factors copied to standard strides first: the
    stages see no strides to specialise on."""
    key_terms = None if key_terms is None else packed(key_terms)
    return ComposeStep.apply(stages, raw, packed(query_terms), key_terms, mask, scale, fill, rank)


# The dims of each stage's arguments that are dynamic (argument position -> dims): batch, queries and keys (one graph
# for every chunk); heads and ranks stay static, so that their loops are unrolled and vectorised.
# Scores and hidden values [B, G, M or I, c, s]; factors [B, G, 2I+1, M, c or s]; positions [c], [s]; padding [B, s].
DYNAMIC_DIMS = {
    stage_hidden: {0: (0, -2, -1), 1: (0, -1), 2: (0, -1)},
    stage_apply: {0: (0, -2, -1), 1: (0, -1), 2: (0, -1), 3: (0, -2, -1), 4: (0, -2, -1), 5: (0,), 6: (0,), 7: (0, -1)},
    compose_backward: {0: (0, -2, -1), 1: (0, -2, -1), 2: (0, -1), 3: (0, -1), 4: (0,), 5: (0,), 6: (0, -1)},
}


class CompiledBackend(EagerBackend):
    """"compiled": `EagerBackend`'s chunks with compiled stages. A later, more general graph must never shadow an
    earlier one (forward and checkpoint recomputation must agree): lengths are dynamic from the first call, with no
    automatic dynamic shapes and no duck sizing."""

    name = "compiled"
    auto_rank = 10
    traced_as_eager = True
    compile_backend = "inductor"  # the tests use "aot_eager" (same tracing and autograd, no C++ to build)

    def __init__(self, auto_min_scores: int = AUTO_MIN_SCORES):
        self._stages: tuple[Callable, Callable, Callable] | None = None
        self.auto_min_scores = auto_min_scores

    @property
    def compose_step(self) -> Callable:
        if self._stages is None:
            self._stages = tuple(self._compile(fn) for fn in (stage_hidden, stage_apply, compose_backward))
        return functools.partial(compiled_step, self._stages)

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
                tensor = args[position]
                for dim in dims if tensor is not None else ():
                    torch._dynamo.maybe_mark_dynamic(tensor, dim % tensor.dim())  # a negative dim would be ignored
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
        return kv_heads_problem(inputs)

    def why_not_auto(self, inputs: DCMHAInputs, output_attentions: bool = False) -> str | None:
        if inputs.num_scores < self.auto_min_scores:
            return f"fewer than {self.auto_min_scores} scores: eager ops are as fast, and nothing is compiled"
        return self.why_not(inputs, output_attentions)


COMPILED = CompiledBackend()
