"""benchmarks/bench_model.py: the training-step sweep (`--sweep --quick`, as a subprocess) and its arguments.
No timing is asserted: only that the report, the table file, the JSON and the plot are there and well formed."""

import argparse
import importlib.util
import json
import os
import re
import shlex
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_model.py"
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


@pytest.fixture(scope="module")
def bench():
    """benchmarks/bench_model.py as a module (for its argument parser)."""
    spec = importlib.util.spec_from_file_location("bench_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def table_rows(text: str) -> dict[int, list[str]]:
    """{T: cells} of the sweep table's data rows."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0].isdigit():
            rows[int(cells[0])] = cells
    return rows


def check_png(path: Path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    length, kind, width, height = struct.unpack(">I4sII", data[8:24])
    assert kind == b"IHDR" and length == 13 and width > 0 and height > 0
    assert data[-12:] == b"\x00\x00\x00\x00IEND\xaeB`\x82", "PNG does not end with IEND"


def test_quick_sweep_table_json_and_png(tmp_path):
    out_json = tmp_path / "sweep.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--sweep", "--out-dir", str(tmp_path), "--json", str(out_json)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    header = next(line for line in proc.stdout.splitlines() if line.startswith("| T |"))
    for model in ("GPT-NeoX", "DCFormer"):
        assert f"step time {model}" in header and f"peak MiB {model}" in header, header
    rows = table_rows(proc.stdout)
    assert sorted(rows) == [32, 64], proc.stdout
    for cells in rows.values():
        assert len(cells) == 7, cells
        for i in (1, 2, 4, 5):  # step times and peaks of both models
            float(cells[i])
        assert re.fullmatch(r"\d+\.\d\dx", cells[3]), cells  # time ratio
        # memory ratio: "n/a" only where the baseline's peak was 0 MiB (the tiny model can fit in held memory)
        expected = r"n/a" if float(cells[4]) == 0 else r"\d+\.\d\dx"
        assert re.fullmatch(expected, cells[6]), cells

    table_file = tmp_path / "train_sweep_dcformer-tiny.md"
    assert table_rows(table_file.read_text()) == rows

    summary = json.loads(out_json.read_text())
    points = summary["sweep"]["points"]
    assert [pt["seq_len"] for pt in points] == [32, 64]
    for pt in points:
        assert pt["time_ratio"] > 0 and pt["baseline"]["step_s"] > 0 and pt["dcformer"]["step_s"] > 0
        assert pt["dcformer"]["peak_mib"] >= 0 and pt["baseline"]["peak_mib"] >= 0

    png = tmp_path / "train_sweep_dcformer-tiny.png"
    if HAS_MATPLOTLIB:
        check_png(png)
        assert summary["sweep"]["plot"] == str(png)
        assert "![" in table_file.read_text()  # the table file embeds the plot
    else:
        assert not png.exists() and summary["sweep"]["plot"] is None


@pytest.mark.parametrize("value, message", [
    ("0,abc", "must be at least 1"),
    ("512,abc", "'abc' is not an integer"),
    ("1024,-8", "must be at least 1"),
    ("", "'' is not an integer"),
])
def test_bad_sweep_seq_lens_is_an_argparse_error(bench, capsys, value, message):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(["--sweep-seq-lens", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --sweep-seq-lens" in err and message in err, err


def test_sweep_seq_lens_parsed_and_imply_sweep(bench):
    args = bench.parse_args(["--sweep-seq-lens", "2048, 512,512"])
    assert args.sweep and args.sweep_seq_lens == [512, 2048]
    args = bench.parse_args(["--quick", "--sweep"])
    assert args.sweep_seq_lens == [32, 64] and args.shape == "dcformer-tiny"
    assert bench.parse_args(["--sweep"]).shape == "pythia-70m"  # the sweep's default shape
    assert bench.parse_args(["--sweep", "--shape", "pythia-160m"]).shape == "pythia-160m"
    assert not bench.parse_args([]).sweep and bench.parse_args([]).shape == "pythia-160m"


# ---------------------------------------------------------------------------------------------------------------
# --layers, --vocab-size, --dtype, --compile-static (DCPythia-6.9B's layer shape, half precision)
# ---------------------------------------------------------------------------------------------------------------
def test_a_slice_of_the_6_9b_shape_with_its_gpt_neox_twin(bench):
    """`--shape pythia-6.9b --layers 2 --vocab-size 1024`: DCPythia-6.9B's layers at their real width, and a
    GPT-NeoX config of the same shape (configs only: nothing of that size is built here)."""
    args = bench.parse_args(["--shape", "pythia-6.9b", "--layers", "2", "--vocab-size", "1024", "--dtype", "bf16"])
    dc = bench.dcformer_config(args)
    expected = bench.DCFormerConfig.from_preset("dcpythia-pythia-6.9b", num_hidden_layers=2, vocab_size=1024)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
                "partial_rotary_factor", "rope_theta", "use_parallel_residual", "window_size", "use_qk_norm"):
        assert getattr(dc, key) == getattr(expected, key), key
    assert (dc.hidden_size, dc.num_hidden_layers, dc.vocab_size) == (4096, 2, 1024)
    assert len(dc.layer_types) == 2
    name, neox = bench.baseline_config(dc)
    assert name == "GPT-NeoX"
    assert (neox.hidden_size, neox.num_hidden_layers, neox.num_attention_heads, neox.intermediate_size,
            neox.vocab_size) == (4096, 2, 32, 16384, 1024)
    assert bench.DTYPES[args.dtype] == bench.torch.bfloat16


def test_layers_keep_a_local_pattern_of_the_right_length(bench):
    args = bench.parse_args(["--shape", "dcformer-tiny", "--layers", "3", "--window", "4"])
    dc = bench.dcformer_config(args)
    assert dc.num_hidden_layers == 3 and len(dc.layer_types) == 3 and "sliding_attention" in dc.layer_types


@pytest.mark.parametrize("argv, message", [
    (["--layers", "0"], "--layers must be at least 1"),
    (["--vocab-size", "-3"], "--vocab-size must be at least 1"),
    (["--compile-static", "--phases", "prefill,decode"], "--compile-static measures decoding"),
    (["--compile-static", "--cache", "dynamic"], "drop --cache dynamic"),
])
def test_bad_layer_vocab_and_compile_options_are_argparse_errors(bench, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_compile_static_decodes_with_the_static_cache_through_a_compiled_forward(bench):
    args = bench.parse_args(["--quick", "--compile-static"])
    assert args.phases == ["decode"] and args.cache == "static" and args.compile_static
    assert bench.parse_args(["--compile-static", "--cache", "static"]).cache == "static"
    assert bench.parse_args([]).phases == ["prefill", "train", "decode"]  # unchanged without it
    dc = bench.dcformer_config(args)
    opts = dict(batch_size=1, decode_prompt=4, decode_new=2, seq_len=8, cache="static", compile_static=True)
    for kind in ("dcformer", "baseline"):
        model = bench.build_model(kind, dc, bench.torch.float32)
        plain = model.forward
        bench.make_step(model, "decode", dc, opts)  # not run: compiling takes minutes here
        assert model.forward is not plain and hasattr(model.forward, "_torchdynamo_orig_callable"), kind


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_precision_models_are_built_in_that_dtype(bench, dtype):
    args = bench.parse_args(["--quick", "--layers", "1", "--vocab-size", "96", "--dtype", dtype])
    dc = bench.dcformer_config(args)
    for kind in ("dcformer", "baseline"):
        model = bench.build_model(kind, dc, bench.DTYPES[dtype])
        assert {p.dtype for p in model.parameters()} == {bench.DTYPES[dtype]}, kind
        assert model.config.num_hidden_layers == 1 and model.config.vocab_size == 96


def test_quick_run_of_a_layer_slice_in_bf16_reports_prefill_decode_and_memory(tmp_path):
    out_json = tmp_path / "bench.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    argv = ["--quick", "--layers", "1", "--vocab-size", "128", "--dtype", "bf16", "--phases", "prefill,decode",
            "--seq-len", "16", "--decode-prompt", "4", "--decode-new", "3", "--repeats", "1", "--json", str(out_json)]
    proc = subprocess.run([sys.executable, str(SCRIPT), *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "1 layers" in proc.stdout and "vocab 128" in proc.stdout and "bf16" in proc.stdout, proc.stdout
    summary = json.loads(out_json.read_text())
    assert summary["dtype"] == "bf16" and summary["layers"] == 1 and summary["vocab_size"] == 128
    assert set(summary["ratios"]) == {"prefill", "decode"} and set(summary["memory_ratios"]) == {"prefill", "decode"}
    assert all(r > 0 for r in summary["ratios"].values())
    labels = [row["metric"] for row in summary["rows"]]
    assert any(label.startswith("prefill 1x16") for label in labels)
    assert any(label.startswith("decode 4+3") for label in labels)
    assert any(label.startswith("peak memory, decode") for label in labels)


def test_profile_shapes_times_each_implementation_against_neox(monkeypatch, capsys):
    """benchmarks/profile_shapes.py with several implementations: one DCFormer model, each implementation set for its
    own runs, every one timed against GPT-NeoX in the same phase line."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # it imports its timer from bench_train_step
    spec = importlib.util.spec_from_file_location("profile_shapes", ROOT / "benchmarks" / "profile_shapes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    seen = []
    model = type("Model", (), {"config": type("Config", (), {"dcmha_implementation": "auto"})()})()
    module.with_implementation(model, "eager", lambda: seen.append(model.config.dcmha_implementation))()
    assert seen == ["eager"]

    argv = ["--preset", "dcpythia-pythia-70m", "--layers", "1", "--vocab", "128", "--dtype", "fp32", "--seq-len", "16",
            "--phases", "prefill,train", "--repeats", "1", "--implementation", "eager,auto"]  # fmt: skip
    assert module.main(argv) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith(("prefill", "train"))]
    assert len(lines) == 2
    for line in lines:
        assert re.search(r"NeoX +[\d.]+ ms +DC\[eager\] +[\d.]+ ms +DC\[auto\] +[\d.]+ ms +DC\[eager\]/NeoX [\d.]+ "
                         r"+DC\[auto\]/NeoX [\d.]+$", line), line  # fmt: skip


def test_profile_shapes_leaves_out_an_implementation_that_fails_and_times_the_rest(monkeypatch, capsys):
    """A sweep (say, of Triton tiles on a GPU) must not lose its other columns to one that cannot run: the failing
    implementation is named with its error and left out; a failing GPT-NeoX still stops the run."""
    from modeling_dcformer.dcmha import DCMHABackend, DCMHAInterface

    class Broken(DCMHABackend):
        name = "broken"

        def __call__(self, inputs, *, output_attentions=False, recompute=False):
            raise ValueError("the Triton DCMHA kernels do not fit this GPU")

    monkeypatch.setitem(DCMHAInterface._global_mapping, "broken", Broken())
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("profile_shapes", ROOT / "benchmarks" / "profile_shapes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = ["--preset", "dcpythia-pythia-70m", "--layers", "1", "--vocab", "128", "--dtype", "fp32", "--seq-len", "16",
            "--phases", "prefill", "--repeats", "1", "--implementation", "broken,eager"]  # fmt: skip
    assert module.main(argv) == 0
    out = capsys.readouterr().out
    assert "prefill: DC[broken] failed, left out: ValueError: the Triton DCMHA kernels do not fit this GPU" in out
    line = next(line for line in out.splitlines() if line.strip().startswith("prefill") and "NeoX " in line)
    assert re.search(r"NeoX +[\d.]+ ms +DC\[eager\] +[\d.]+ ms +DC\[eager\]/NeoX [\d.]+$", line), line


def test_profile_shapes_times_single_decode_steps_against_a_cache(monkeypatch, capsys):
    """The "step" phase: one-token forward calls against the prompt's cache, cropped back after each, so every run
    sees the same cache (the cache's length is checked after the runs)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("profile_shapes", ROOT / "benchmarks" / "profile_shapes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    caches = []
    real = module.make_step

    def recording(model, phase, args, vocab):
        step = real(model, phase, args, vocab)
        caches.append(step.cache)
        return step

    monkeypatch.setattr(module, "make_step", recording)
    argv = ["--preset", "dcpythia-pythia-70m", "--layers", "1", "--vocab", "128", "--dtype", "fp32", "--phases",
            "step", "--decode-prompt", "9", "--decode-new", "3", "--repeats", "2"]  # fmt: skip
    assert module.main(argv) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("step"))
    assert re.search(r"NeoX +[\d.]+ ms +DC +[\d.]+ ms +DC/NeoX [\d.]+$", line), line
    assert sorted(type(c).__name__ for c in caches) == ["DCFormerCache", "DynamicCache"]
    assert all(c.get_seq_length() == 9 for c in caches)  # cropped back after every step


def test_bench_train_step_times_each_implementation_against_the_transformer(monkeypatch, capsys):
    """`bench_train_step.py --implementation a,b`: one column per dcmha_implementation, each with its ratio; a name that
    is not registered is an argparse error."""
    spec = importlib.util.spec_from_file_location("bench_train_step", ROOT / "benchmarks" / "bench_train_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = ["--sizes", "32/2", "--batch-size", "2", "--block-size", "8", "--warmup", "0", "--repeats", "1",
            "--implementation", "eager,auto"]  # fmt: skip
    assert module.main(argv) == 0
    out = capsys.readouterr().out
    assert "dcmha_implementation eager, auto" in out
    assert re.search(r"^ +32/2 +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+$", out, re.M), out
    with pytest.raises(SystemExit):
        module.parse_args(["--implementation", "eager,nope"])
    assert "nope: not a dcmha_implementation" in capsys.readouterr().err


def test_triton_at_tiles_sets_the_kernels_tiles_for_its_own_runs_only(capsys):
    """`--implementation triton@32x16` (a GPU sweep of the Triton kernels' tiles): "triton" with BLOCK_T x BLOCK_S
    = 32 x 16 while its step runs, the defaults restored after it, also when it fails; tiles that are not powers of
    two from 16, or on another implementation, are argparse errors."""
    from modeling_dcformer.kernels import dcmha_triton

    spec = importlib.util.spec_from_file_location("bench_train_step", ROOT / "benchmarks" / "bench_train_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.parse_args(["--implementation", "triton,triton@32x16"]).implementation == ["triton", "triton@32x16"]
    for bad in ("triton@24x16", "triton@8x16", "eager@32x16", "triton@32"):
        with pytest.raises(SystemExit):
            module.parse_args(["--implementation", bad])
        assert f"{bad}: not a dcmha_implementation" in capsys.readouterr().err
    defaults = dcmha_triton.BLOCK_T, dcmha_triton.BLOCK_S
    model = type("Model", (), {"config": type("Config", (), {"dcmha_implementation": "auto"})()})()
    seen = []
    module.with_implementation(model, "triton@32x64", lambda: seen.append(
        (model.config.dcmha_implementation, dcmha_triton.BLOCK_T, dcmha_triton.BLOCK_S)))()
    module.with_implementation(model, "triton", lambda: seen.append(
        (model.config.dcmha_implementation, dcmha_triton.BLOCK_T, dcmha_triton.BLOCK_S)))()
    assert seen == [("triton", 32, 64), ("triton", *defaults)]

    def fails():
        raise ValueError("the Triton DCMHA kernels do not fit this GPU")

    with pytest.raises(ValueError):
        module.with_implementation(model, "triton@64x64", fails)()
    assert (dcmha_triton.BLOCK_T, dcmha_triton.BLOCK_S) == defaults


def cuda_check_steps() -> dict[str, list[str]]:
    """{step name: its command's words} of benchmarks/cuda_check.sh, its variables ($bench, $dc) filled in."""
    text = (ROOT / "benchmarks" / "cuda_check.sh").read_text().replace("\\\n", " ")
    values = {"bench": "benchmarks", "dc": re.search(r'^dc="([^"]*)"', text, re.M).group(1), "per_test": "", "workers": ""}
    steps = {}
    for line in text.splitlines():
        if line.startswith("step "):
            line = re.sub(r"\$(\w+)", lambda m: values[m.group(1)], line.split("  #")[0])
            words = shlex.split(line)
            steps[words[1]] = words[3:]
    return steps


def test_cuda_check_runs_the_gpu_tests_first_and_every_benchmark_step_parses(monkeypatch):
    """A GPU is lent rarely and briefly: benchmarks/cuda_check.sh must not lose its run to a typo. The script is valid
    bash, its first step after `env` runs the GPU tests, and every benchmark step's arguments (implementation names
    included) parse with that benchmark's own parser."""
    subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "cuda_check.sh")], check=True)
    steps = cuda_check_steps()
    assert list(steps)[:2] == ["env", "gpu-tests"]
    assert steps["gpu-tests"][:4] == ["python3", "-m", "pytest", "-q"] and "gpu" in steps["gpu-tests"]
    assert (ROOT / steps["gpu-tests"][-1]).is_file()
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    scripts = set()
    for name, words in steps.items():
        if name in ("env", "gpu-tests"):
            continue
        assert words[0] == "python3" and words[1].startswith("benchmarks/"), (name, words)
        path = ROOT / words[1]
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        args = module.parse_args(words[2:])  # argparse exits on a bad argument
        assert args.device == "cuda", name
        scripts.add(path.name)
    assert scripts == {"bench_attention.py", "profile_shapes.py", "bench_train_step.py"}


@pytest.fixture(scope="module")
def ab_kernel():
    """benchmarks/ab_kernel_source.py as a module."""
    spec = importlib.util.spec_from_file_location("ab_kernel_source", ROOT / "benchmarks" / "ab_kernel_source.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ab_kernel_source_renames_every_registration_and_parses_shapes(ab_kernel):
    """Each variant's operators go to their own namespace (all three registration macros, nothing else); a source
    without the dcformer library and a malformed shape are clear errors."""
    text = (ROOT / "modeling_dcformer" / "kernels" / "csrc" / "dcmha_cpu.cpp").read_text()
    renamed = ab_kernel.renamed_source(text, "dcformer_ab_x")
    assert "TORCH_LIBRARY(dcformer_ab_x," in renamed and "TORCH_LIBRARY_IMPL(dcformer_ab_x, CPU" in renamed
    assert not re.search(r"TORCH_LIBRARY\w*\(dcformer\b", renamed)
    assert ab_kernel.renamed_source("TORCH_LIBRARY_FRAGMENT(dcformer, m) {}", "n") == "TORCH_LIBRARY_FRAGMENT(n, m) {}"
    with pytest.raises(ValueError, match="no operator in the dcformer namespace"):
        ab_kernel.renamed_source("TORCH_LIBRARY(dcformerx, m) {}", "n")
    assert ab_kernel.parse_shapes("1x2x3x4,5x6x7x8") == [(1, 2, 3, 4), (5, 6, 7, 8)]
    for bad in ("1x2x3", "1x2x0x4", "1x2x5x4", "ax2x3x4"):
        with pytest.raises(argparse.ArgumentTypeError):
            ab_kernel.parse_shapes(bad)
    with pytest.raises(FileNotFoundError, match="no kernel source"):
        ab_kernel.build("/nonexistent/dcmha_cpu.cpp:-O2", Path("/tmp"))
    assert ab_kernel.split_layout("a@b.cpp:-O2@contiguous") == ("a@b.cpp:-O2", "contiguous")
    assert ab_kernel.split_layout("a.cpp:-O2") == ("a.cpp:-O2", None)
    assert ab_kernel.split_layout("dir@2/a.cpp") == ("dir@2/a.cpp", None)  # not a layout: part of the path
    assert ab_kernel.split_layout("a.cpp@staggered136") == ("a.cpp", "staggered136")
    for not_a_layout in ("a.cpp@staggered0", "a.cpp@staggered1024", "a.cpp@staggeredx"):
        assert ab_kernel.split_layout(not_a_layout) == (not_a_layout, None)
    with pytest.raises(FileNotFoundError, match="a.cpp@transposed"):
        ab_kernel.build(ab_kernel.split_layout("/nonexistent/a.cpp@transposed")[0], Path("/tmp"))


def test_ab_kernel_source_times_variants_and_flags_one_that_computes_something_else(ab_kernel, capsys):
    """compare(): a row per shape and variant with times, ratios to the first and the outputs' difference, 0 for the
    same operators; a variant whose backward operator leaves the gradients alone shows a large difference."""
    from modeling_dcformer.kernels import dcmha_cpu

    if not dcmha_cpu.ensure_built():
        pytest.skip(f"the CPU kernel cannot be built here: {dcmha_cpu.CPU.failure}")
    ops = torch.ops.dcformer

    class NoBackward:  # the forward operator as is; a backward operator that does nothing
        compose_softmax_compose_ = ops.compose_softmax_compose_

        @staticmethod
        def compose_softmax_compose_backward_(*args):
            return None

    rows = ab_kernel.compare([("a", ops), ("b", ops), ("broken", NoBackward)], [(1, 2, 3, 20), (2, 4, 8, 8)], 2)
    assert [(r["shape"], r["variant"]) for r in rows] == [
        ("1x2x3x20", "a"), ("1x2x3x20", "b"), ("1x2x3x20", "broken"), ("2x4x8x8", "a"), ("2x4x8x8", "b"),
        ("2x4x8x8", "broken")]  # fmt: skip
    for row in rows:
        assert row["forward_ns"] > 0 and row["backward_ns"] > 0 and row["backward_ratio"] > 0
        assert row["forward_difference"] == 0.0
        assert (row["backward_difference"] > 0.1) == (row["variant"] == "broken"), row
    assert all(r["forward_ratio"] == 1.0 and r["backward_ratio"] == 1.0 for r in rows if r["variant"] == "a")
    # the forward operator's scores in the model's layout or contiguous: the same numbers
    both = ab_kernel.compare([("model", ops), ("contiguous", ops, "contiguous"), ("other", ops, "staggered136")],
                             [(1, 3, 4, 40)], 1)  # fmt: skip
    assert [r["forward_difference"] for r in both] == [0.0, 0.0, 0.0]
    raw = torch.randn(2, 3, 4, 40)
    other = ab_kernel.laid_out(raw, "staggered136")
    assert torch.equal(other, raw) and other.stride(1) % 1024 == 136 and other.stride(3) == 1
    ab_kernel.print_rows(rows)
    out = capsys.readouterr().out
    assert out.count("\n| 1x2x3x20 |") == 3 and "| `broken` |" in out


def test_several_timing_processes_report_the_median_of_their_ratios(bench, monkeypatch, capsys):
    """`--processes 3`: three timing processes per phase; the table's time ratio is the median of the processes'
    ratios (not the ratio of pooled medians), each process's ratio is printed and in the JSON; decode's are in
    tokens/s (the inverse). Synthetic timings: no model is built."""
    per_process = iter([(1.0, 1.30), (2.0, 2.10), (1.0, 1.20),  # prefill: ratios 1.30, 1.05, 1.20
                        (1.0, 1.25), (1.0, 1.00), (2.0, 2.00)])  # decode times: ratios 1.25, 1.00, 1.00
    calls = []

    def fake_time(phase, dc_cfg, opts):
        base, dc = next(per_process)
        calls.append(phase)
        info = dict(params=1, weight_bytes=4, attn_implementation="sdpa", torch_threads=1)
        return {"baseline": dict(info, times=[base], median=base), "dcformer": dict(info, times=[dc], median=dc)}

    monkeypatch.setattr(bench, "measure_time", fake_time)
    monkeypatch.setattr(bench, "measure_memory", lambda kind, phase, cfg, opts: dict(peak_bytes=2**20, memory_method="fake"))
    monkeypatch.setattr(bench, "run_in_fresh_process", lambda fn, *args: fn(*args))
    summary = bench.run_benchmark(["--quick", "--phases", "prefill,decode", "--processes", "3"], out=sys.stdout, log=None)
    out = capsys.readouterr().out
    assert calls == ["prefill"] * 3 + ["decode"] * 3
    assert summary["processes"] == 3
    assert summary["process_ratios"]["prefill"] == pytest.approx([1.30, 1.05, 1.20])
    assert summary["process_ratios"]["decode"] == pytest.approx([0.8, 1.0, 1.0])
    assert summary["ratios"]["prefill"] == pytest.approx(1.20)  # the medians of the medians: 1.30 / 1.0
    assert summary["ratios"]["decode"] == pytest.approx(1.0)
    assert "prefill: 1.300, 1.050, 1.200; decode: 0.800, 1.000, 1.000" in out, out
    assert "median of the processes' ratios" in out
    row = next(line for line in out.splitlines() if line.startswith("| prefill"))
    assert row.rstrip().endswith("| 1.20x |"), row


def test_processes_must_be_positive_and_apply_to_the_phase_table(bench, capsys):
    assert bench.parse_args([]).processes == 1
    for argv, message in ((["--processes", "0"], "--processes must be at least 1"),
                          (["--sweep", "--processes", "2"], "--processes applies to the phase table")):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
        assert message in capsys.readouterr().err


def test_profile_shapes_parts_split_each_models_forward_time_by_layer_part(monkeypatch, capsys):
    """`--parts`: forward hooks time each layer's attention, its projections and MLP during the timed runs; the parts
    nest (the attention holds its projections, the run holds both), DCFormer alone has a dynamic-weight projection,
    and the hooks are gone afterwards."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("profile_shapes", ROOT / "benchmarks" / "profile_shapes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    built = {}
    real_build = module.build

    def recording(kind, dc, dtype, device):
        built[kind] = real_build(kind, dc, dtype, device)
        return built[kind]

    monkeypatch.setattr(module, "build", recording)
    argv = ["--preset", "dcpythia-pythia-70m", "--layers", "2", "--vocab", "128", "--dtype", "fp32", "--seq-len", "32",
            "--phases", "prefill", "--repeats", "2", "--parts"]  # fmt: skip
    assert module.main(argv) == 0
    out = capsys.readouterr().out
    table = {}
    for line in out.splitlines():
        match = re.match(r"\s{4}(\S.*?)\s+(-?[\d.]+)\s+(-?[\d.]+)\s+([+-][\d.]+)$", line)
        if match:
            table[match[1]] = [float(x) for x in match.group(2, 3, 4)]
    assert set(table) == {"attention", "q/k/v projection", "output projection", "dynamic-weight projection",
                          "attention: the rest", "MLP", "outside (embedding, norms, head, Python)", "total"}, out
    for part, (neox, dc, diff) in table.items():
        assert diff == pytest.approx(dc - neox, abs=2e-3), part
        if part != "dynamic-weight projection":
            assert neox > 0 and dc > 0, (part, out)
    assert table["dynamic-weight projection"][0] == 0 and table["dynamic-weight projection"][1] > 0
    for column in (0, 1):
        projections = sum(table[p][column] for p in ("q/k/v projection", "output projection", "dynamic-weight projection"))
        assert table["attention"][column] > projections
        assert table["attention: the rest"][column] == pytest.approx(table["attention"][column] - projections, abs=2e-3)
        assert table["total"][column] > table["attention"][column] + table["MLP"][column]
    for model in built.values():
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
