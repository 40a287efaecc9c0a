#!/usr/bin/env python3
"""A training step of DCFormer against the Transformer of `examples/compare_small.py --task lm`, on CPU or CUDA.

The shapes are compare_small's language-modelling study (docs/evidence.md): 3 layers, hidden 128/256/512 with 4/8/8
heads, MLP 4x hidden, vocabulary 2048, batch 16 x 128 tokens, the Pythia body (LayerNorm, parallel residual, GELU,
biases, rotary on a quarter of the head). The Transformer is `GPTNeoXForCausalLM` with SDPA, its MLP widened to
DCFormer's parameter count when they differ by more than 2% (compare_small's `--param-match auto`). Both models are
built here from these shapes (this script does not import examples/).

One step = forward with the loss on every token, backward, AdamW step (lr 3e-3, betas 0.9/0.95, weight decay 0.1),
zero_grad. Both models live in one process on `--threads` torch threads (default 1); after `--warmup` steps each,
`--repeats` steps of each run interleaved (A B B A ...), and the medians are compared. Prints, per size, both
medians and DCFormer/Transformer (the time ratio: 2.0 means DCFormer trains at half the Transformer's throughput).
`--profile` prints torch.profiler's top ops of one DCFormer step per size. `--implementation compiled,cpu`
times one DCFormer model with each dcmha_implementation in turn, all interleaved with the Transformer (one column
each). On a GPU, "triton@cN" is "triton" in chunks of N queries and "triton@RxBS" with both kernels' tiles R query
rows x BS keys (`triton_settings`), each for its own column's runs.

    python benchmarks/bench_train_step.py                    # the three sizes
    python benchmarks/bench_train_step.py --implementation compiled,cpu
    python benchmarks/bench_train_step.py --sizes 128/4 --profile
    python benchmarks/bench_train_step.py --device cuda     # fp32 on the GPU (kernels waited for around each step)
    python benchmarks/bench_train_step.py --device cuda --implementation triton,triton@c64,triton@8x32
"""

from __future__ import annotations

import argparse
import contextlib
import re
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from modeling_dcformer import DCFormerConfig, DCFormerForCausalLM
from modeling_dcformer.dcmha import implementation_names

VOCAB, LAYERS, MAX_PARAM_GAP = 2048, 3, 0.02


def configs(hidden: int, heads: int, block: int, dc_overrides: dict) -> tuple[GPTNeoXConfig, DCFormerConfig]:
    """compare_small's `make_configs` + `matched_configs` for the Pythia body (param_match "auto")."""
    common = dict(
        vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=LAYERS, num_attention_heads=heads,
        max_position_embeddings=block, layer_norm_eps=1e-5, hidden_act="gelu", initializer_range=0.02,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    dc = DCFormerConfig(
        **common, intermediate_size=4 * hidden, partial_rotary_factor=0.25, norm_type="layernorm",
        use_parallel_residual=True, use_gated_mlp=False, attention_bias=True, mlp_bias=True, use_dcmha=True,
        use_qk_norm=False, window_size=None, **dc_overrides,
    )  # fmt: skip

    def neox(intermediate: int) -> GPTNeoXConfig:
        cfg = GPTNeoXConfig(
            **common, intermediate_size=intermediate, rotary_pct=0.25, rotary_emb_base=10000,
            use_parallel_residual=True, attention_bias=True, hidden_dropout=0.0, attention_dropout=0.0,
        )  # fmt: skip
        cfg._attn_implementation = "sdpa"
        return cfg

    def count(cls, cfg) -> int:
        with torch.device("meta"):
            return sum(p.numel() for p in cls(cfg).parameters())

    base = neox(4 * hidden)
    n_neox, n_dc = count(GPTNeoXForCausalLM, base), count(DCFormerForCausalLM, dc)
    if abs(n_dc - n_neox) / n_neox > MAX_PARAM_GAP:
        base = neox(4 * hidden + round((n_dc - n_neox) / (LAYERS * (2 * hidden + 1))))
    return base, dc


def make_step(model: torch.nn.Module, ids: torch.Tensor):
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)

    def step():
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def timed(step, device: torch.device | None = None) -> float:
    """Seconds of one call of `step`; on CUDA the queued kernels are waited for before and after."""
    cuda = device is not None and device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    step()
    if cuda:
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def top_ops(step, rows: int, device: torch.device | None = None) -> str:
    """torch.profiler's top ops of one call of `step` by self time: CPU time on a CPU, kernel time on CUDA."""
    cuda = device is not None and device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize(device)
    events = prof.key_averages()

    def self_time(e) -> float:
        return e.self_device_time_total if cuda else e.self_cpu_time_total

    total = sum(self_time(e) for e in events) or 1
    lines = [f"    total {total / 1e3:.1f} ms (self {'CUDA' if cuda else 'CPU'} time of all ops)"]
    for e in sorted(events, key=lambda e: -self_time(e))[:rows]:
        lines.append(f"    {e.key[:60]:<60} {e.count:>6} calls {self_time(e) / 1e3:>9.2f} ms "
                     f"{100 * self_time(e) / total:>5.1f}%")
    return "\n".join(lines)


def where(device: torch.device, threads: int) -> str:
    """The machine a benchmark ran on, for its header line."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    return f"CPU, {threads} thread(s)"


def parse_sizes(text: str) -> list[tuple[int, int]]:
    sizes = []
    for item in text.split(","):
        try:
            hidden, heads = (int(x) for x in item.split("/"))
        except ValueError:
            raise SystemExit(f"--sizes: {item!r} is not HIDDEN/HEADS (e.g. 128/4)") from None
        sizes.append((hidden, heads))
    return sizes


def implementation_list(text: str) -> list[str]:
    """`--implementation`: registered dcmha_implementation names, comma-separated (also profile_shapes.py's), where
    "triton" may carry settings for its own runs (`parse_variant`): "triton@cN" (chunks of N queries) and
    "triton@RxBS" (both kernels' tiles R query rows x BS keys), alone or together ("triton@c256@8x32")."""
    names = text.split(",")
    known = set(implementation_names())
    unknown = [name for name in names if parse_variant(name) is None or parse_variant(name)[0] not in known]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"{', '.join(unknown)}: not a dcmha_implementation (known: {sorted(known)}, and triton@cN for chunks of "
            "N queries, triton@RxBS for tiles of R rows x BS keys: powers of two, keys from 16)"
        )
    return names


def parse_tile(text: str) -> tuple[int, int] | None:
    """(R, BS) of a Triton tile "RxBS" (R query rows x BS keys of a program's block: powers of two, keys from 16,
    as triton_resources.py's --tiles), or None where `text` is not one."""
    match = re.fullmatch(r"(\d+)x(\d+)", text)
    if not match:
        return None
    rows, keys = int(match.group(1)), int(match.group(2))
    power = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    return (rows, keys) if power(rows) and power(keys) and keys >= 16 else None


def parse_variant(name: str) -> tuple[str, dict] | None:
    """(implementation, settings) of an `--implementation` entry: "eager" -> ("eager", {}); "triton@c256@8x32" ->
    ("triton", {"chunk": 256, "tile": (8, 32)}); None where the settings are malformed, repeated or not on
    "triton"."""
    base, *options = name.split("@")
    if options and base != "triton":
        return None
    settings = {}
    for option in options:
        chunk = re.fullmatch(r"c(\d+)", option)
        if chunk and int(chunk.group(1)) > 0 and "chunk" not in settings:
            settings["chunk"] = int(chunk.group(1))
        elif parse_tile(option) is not None and "tile" not in settings:
            settings["tile"] = parse_tile(option)
        else:
            return None
    return base, settings


@contextlib.contextmanager
def triton_settings(chunk: int | None = None, tile: tuple[int, int] | None = None):
    """Inside the block, "triton" runs with chunks of `chunk` queries (a `TritonBackend(chunk_queries=chunk)`
    registered under "triton") and both kernels' tiles (`dcmha_triton.FORWARD_TILE`, `BACKWARD_TILE`, read at every
    launch) set to `tile`; the registered backend and the tiles are restored after it, also when it raises."""
    from modeling_dcformer.dcmha import DCMHA_BACKENDS, DCMHAInterface
    from modeling_dcformer.kernels import dcmha_triton

    backend = DCMHA_BACKENDS.get("triton")
    tiles = dcmha_triton.FORWARD_TILE, dcmha_triton.BACKWARD_TILE
    try:
        if chunk is not None:
            DCMHAInterface.register("triton", dcmha_triton.TritonBackend(chunk_queries=chunk))
        if tile is not None:
            dcmha_triton.FORWARD_TILE = dcmha_triton.BACKWARD_TILE = tuple(tile)
        yield
    finally:
        dcmha_triton.FORWARD_TILE, dcmha_triton.BACKWARD_TILE = tiles
        if chunk is not None:
            DCMHAInterface.register("triton", backend)


def with_implementation(model, implementation: str, step):
    """`step` run with the model's dcmha_implementation set to `implementation` (read at every attention call);
    "triton@cN" and "triton@RxBS" apply their settings for the step (`triton_settings`)."""
    base, settings = parse_variant(implementation)

    def run():
        model.config.dcmha_implementation = base
        if not settings:
            return step()
        with triton_settings(**settings):
            return step()

    return run


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=parse_sizes, default=parse_sizes("128/4,256/8,512/8"), help="HIDDEN/HEADS,...")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu or cuda (fp32 either way)")
    p.add_argument("--dc-overrides", default="", help="DCFormerConfig options, e.g. attention_recompute=false")
    p.add_argument("--implementation", type=implementation_list, default=None,
                   help="dcmha_implementation, or several comma-separated (one model, each timed; default: auto); "
                        "triton@cN: chunks of N queries, triton@RxBS: tiles of R rows x BS keys")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--rows", type=int, default=20)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    overrides = {}
    for item in filter(None, args.dc_overrides.split(",")):
        key, _, value = item.partition("=")
        overrides[key] = {"true": True, "false": False}.get(value.lower(), int(value) if value.isdigit() else value)
    implementations = args.implementation or [overrides.get("dcmha_implementation", "auto")]
    columns = ["DCFormer"] if len(implementations) == 1 else [f"DC[{impl}]" for impl in implementations]
    print(f"training step (fwd+bwd+AdamW), batch {args.batch_size} x {args.block_size} tokens, {LAYERS} layers, "
          f"vocab {VOCAB}, {where(device, args.threads)}, median of {args.repeats} interleaved (shared machine: noisy)"
          f"; dcmha_implementation {', '.join(implementations)}")
    print(f"{'size':>8} {'Transformer ms':>15}" + "".join(f" {c + ' ms':>16} {'DC/T':>6}" for c in columns))
    for hidden, heads in args.sizes:
        neox_cfg, dc_cfg = configs(hidden, heads, args.block_size, overrides)
        torch.manual_seed(0)
        ids = torch.randint(0, VOCAB, (args.batch_size, args.block_size), generator=torch.Generator().manual_seed(1))
        ids = ids.to(device)
        dcformer = DCFormerForCausalLM(dc_cfg).to(device)
        dc_step = make_step(dcformer, ids)
        steps = {"transformer": make_step(GPTNeoXForCausalLM(neox_cfg).to(device), ids)}
        steps.update({c: with_implementation(dcformer, impl, dc_step) for c, impl in zip(columns, implementations)})
        for _ in range(args.warmup):
            for step in steps.values():
                step()
        times = {kind: [] for kind in steps}
        order = list(steps)
        for r in range(args.repeats):
            for kind in order if r % 2 == 0 else order[::-1]:
                times[kind].append(timed(steps[kind], device))
        t = statistics.median(times["transformer"])
        cells = "".join(f" {statistics.median(times[c]) * 1e3:>16.1f} {statistics.median(times[c]) / t:>6.2f}"
                        for c in columns)
        print(f"{hidden:>4}/{heads:<3} {t * 1e3:>15.1f}{cells}", flush=True)
        if args.profile:
            for kind, step in steps.items():
                print(f"  profile of one {kind} step:\n{top_ops(step, args.rows, device)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
