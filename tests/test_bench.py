"""The benchmark scripts: bench_model.py (the training-step sweep, `--sweep --quick` as a subprocess, and its
arguments), profile_shapes.py and bench_train_step.py (several implementations against the baseline, "triton"'s
chunk and tile settings, static-cache decoding), bench_attention.py ("triton" per chunk size beside the cost model's
prediction, the machine's ceilings, the kernel split), cuda_check.sh (its steps parse and fit its budget) and
ab_kernel_source.py. No timing is asserted: only that the reports, tables and JSON are there and well formed."""

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


def test_compile_static_decodes_with_the_static_cache_compiled_by_generate(bench, monkeypatch):
    """--compile-static: generate() compiles each model's decoding step by itself (its CompileConfig, on any
    device), with the static cache; the model's forward stays its own (torch.compile stood in for)."""
    args = bench.parse_args(["--quick", "--compile-static"])
    assert args.phases == ["decode"] and args.cache == "static" and args.compile_static
    assert bench.parse_args(["--compile-static", "--cache", "static"]).cache == "static"
    assert bench.parse_args([]).phases == ["prefill", "train", "decode"]  # unchanged without it
    compiled = []

    def fake_compile(fn, **kwargs):
        compiled.append((type(fn.__self__).__name__, kwargs.get("mode")))
        return fn

    monkeypatch.setattr(bench.torch, "compile", fake_compile)
    dc = bench.dcformer_config(args)
    opts = dict(batch_size=1, decode_prompt=4, decode_new=2, seq_len=8, cache="static", compile_static=True)
    for kind in ("dcformer", "baseline"):
        model = bench.build_model(kind, dc, bench.torch.float32)
        bench.make_step(model, "decode", dc, opts)()
        assert "forward" not in vars(model), kind
    assert compiled == [("DCFormerForCausalLM", "reduce-overhead"), ("GPTNeoXForCausalLM", "reduce-overhead")]


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


def test_triton_variants_set_chunks_and_tiles_for_their_own_runs_only(capsys):
    """`--implementation triton@c64` (chunks of 64 queries) and `triton@8x32` (both kernels' tiles 8 rows x 32 keys),
    the GPU sweep of the "triton" backend: set while the step runs, the registered backend and the module's tiles
    restored after it, also when it fails; malformed settings, or settings on another implementation, are argparse
    errors."""
    from modeling_dcformer.dcmha import DCMHA_BACKENDS
    from modeling_dcformer.kernels import dcmha_triton

    module = load_script("bench_train_step")
    names = ["triton", "triton@c256", "triton@8x32", "triton@c64@4x16"]
    assert module.parse_args(["--implementation", ",".join(names)]).implementation == names
    assert module.parse_variant("triton@c64@4x16") == ("triton", {"chunk": 64, "tile": (4, 16)})
    for bad in ("triton@24x16", "triton@8x8", "eager@c64", "triton@c0", "triton@c", "triton@32", "triton@c64@c128",
                "nope@c64", "triton@16x32x2"):
        with pytest.raises(SystemExit):
            module.parse_args(["--implementation", bad])
        assert f"{bad}: not a dcmha_implementation" in capsys.readouterr().err
    registered = DCMHA_BACKENDS.get("triton")
    tiles = dcmha_triton.FORWARD_TILE, dcmha_triton.BACKWARD_TILE
    model = type("Model", (), {"config": type("Config", (), {"dcmha_implementation": "auto"})()})()
    seen = []

    def look():
        backend = DCMHA_BACKENDS.get("triton")
        seen.append((model.config.dcmha_implementation, backend.chunk_queries, backend is registered,
                     dcmha_triton.FORWARD_TILE, dcmha_triton.BACKWARD_TILE))

    for name in ("triton@8x32", "triton@c64", "triton@c96@4x64", "triton", "eager"):
        module.with_implementation(model, name, look)()
    assert seen == [
        ("triton", registered.chunk_queries, True, (8, 32), (8, 32)),
        ("triton", 64, False, *tiles),
        ("triton", 96, False, (4, 64), (4, 64)),
        ("triton", registered.chunk_queries, True, *tiles),
        ("eager", registered.chunk_queries, True, *tiles),
    ]
    assert isinstance(DCMHA_BACKENDS.get("triton"), dcmha_triton.TritonBackend)

    def fails():
        raise ValueError("the Triton DCMHA kernels do not fit this GPU")

    with pytest.raises(ValueError):
        module.with_implementation(model, "triton@c32@16x64", fails)()
    assert DCMHA_BACKENDS.get("triton") is registered
    assert (dcmha_triton.FORWARD_TILE, dcmha_triton.BACKWARD_TILE) == tiles


def load_script(name: str):
    """benchmarks/NAME.py as a module (benchmarks/ on sys.path for its imports while it loads)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


CUDA_CHECK = ROOT / "benchmarks" / "cuda_check.sh"
OUTDIR = "/tmp/cuda-check-out"


def cuda_check_steps() -> dict[str, tuple[int, list[str]]]:
    """{step name: (its time limit, its command's words)} of benchmarks/cuda_check.sh, its variables filled in (the
    output folder: OUTDIR; the optional pytest options: none)."""
    text = CUDA_CHECK.read_text().replace("\\\n", " ")
    values = dict(re.findall(r'^(\w+)="?([^"\n]*)"?$', text, re.M), out=OUTDIR, per_test="", workers="")
    steps = {}
    for line in text.splitlines():
        if line.startswith("step "):
            line = re.sub(r"\$(\w+)", lambda m: values[m.group(1)], line.split("  #")[0])
            words = shlex.split(line)
            steps[words[1]] = (int(words[2]), words[3:])
    return steps


def test_cuda_check_measures_ceilings_then_tests_and_every_step_parses_within_the_budget():
    """A GPU is lent rarely and briefly: benchmarks/cuda_check.sh must not lose its run to a typo or to a step that
    cannot run. The script is valid bash; its steps are the ceilings, the GPU tests and the Triton kernels' tests
    (right after the ceilings, before any benchmark), then the benchmarks; every benchmark step's arguments parse with
    that benchmark's own parser, on CUDA, writing its JSON under OUTDIR; and the steps' limits add up to no more than
    the default budget of 540 s."""
    subprocess.run(["bash", "-n", str(CUDA_CHECK)], check=True)
    text = CUDA_CHECK.read_text()
    assert re.search(r"^budget=\$\{2:-540\}$", text, re.M)
    steps = cuda_check_steps()
    assert list(steps)[:3] == ["ceilings", "gpu-tests", "triton-tests"], list(steps)
    assert sum(limit for limit, _ in steps.values()) <= 540, {name: limit for name, (limit, _) in steps.items()}
    gpu, triton = steps["gpu-tests"][1], steps["triton-tests"][1]
    assert gpu[:4] == ["python3", "-m", "pytest", "-q"] and gpu[gpu.index("-m", 3) + 1] == "gpu"
    assert gpu[-1] == "tests/test_gpu.py" and triton[-1] == "tests/test_dcmha_triton.py"
    assert "-m" not in triton[3:] and triton[triton.index("-k") + 1] == "not resource_gate"
    assert all((ROOT / words[-1]).is_file() for words in (gpu, triton))
    parsed = {}
    for name, (_, words) in steps.items():
        if name in ("gpu-tests", "triton-tests"):
            continue
        assert words[0] == "python3" and words[1].startswith("benchmarks/"), (name, words)
        args = load_script(Path(words[1]).stem).parse_args(words[2:])  # argparse exits on a bad argument
        assert args.device == "cuda", name
        assert args.json == f"{OUTDIR}/{name}.json", name
        parsed[name] = args
    assert set(parsed) == {"ceilings", "attention", "model-160m", "model-6.9b", "attention-split"}
    assert parsed["ceilings"].measure_ceilings
    attention = parsed["attention"]
    assert attention.implementations == ["triton@c128", "triton@c256", "triton@c512", "triton@cT"]
    assert attention.scope == "attention" and attention.dtype == "bf16" and attention.phases == ["forward", "fwd+bwd"]
    assert [(s["name"], s["batch"], s["seq_lens"], s["heads"], s["hidden"] // s["heads"], s["window"])
            for s in attention.shapes] == [("pythia-160m", 8, [1024], 12, 64, None),
                                           ("dcpythia-6.9b", 1, [2048], 32, 128, None),
                                           ("dcpythia-6.9b@w256", 1, [2048], 32, 128, 256)]  # fmt: skip
    assert attention.ceilings == parsed["attention-split"].ceilings == f"{OUTDIR}/ceilings.json"
    assert parsed["attention-split"].profile and parsed["attention-split"].shapes[0]["name"] == "dcpythia-6.9b"
    for name, preset, layers, batch, tokens in (("model-160m", "dcpythia-pythia-160m", 12, 8, 1024),
                                                ("model-6.9b", "dcpythia-pythia-6.9b", 4, 1, 2048)):  # fmt: skip
        args = parsed[name]
        assert (args.preset, args.layers, args.batch, args.seq_len) == (preset, layers, batch, tokens), name
        assert args.phases.split(",") == ["prefill", "train", "decode", "decode-static"], name
        assert args.implementation == ["triton"] and args.decode_implementation == ["auto"], name


def test_cuda_check_reports_a_failing_step_and_records_it(tmp_path):
    """The step mechanics: a step that fails (here on a machine without CUDA, or passing with one) is reported with
    its exit code on stdout and in OUTDIR/steps.json, its output goes to the log, the steps not asked for do not run."""
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(CUDA_CHECK), str(out), "60", "ceilings"], capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    records = json.loads((out / "steps.json").read_text())
    assert [r["step"] for r in records] == ["ceilings"] and records[0]["limit"] == 25
    rc = records[0]["rc"]
    assert f"rc {rc} in" in proc.stdout and "== done" in proc.stdout, proc.stdout
    assert "== ceilings (limit 25 s)" in (out / "cuda_check.log").read_text()
    assert (out / "ceilings.json").is_file() == (rc == 0)


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
    monkeypatch.setattr(bench, "measure_memory",
                        lambda kind, phase, cfg, opts: dict(peak_bytes=2**20, memory_method="fake"))
    monkeypatch.setattr(bench, "run_in_fresh_process", lambda fn, *args: fn(*args))
    summary = bench.run_benchmark(["--quick", "--phases", "prefill,decode", "--processes", "3"], out=sys.stdout,
                                  log=None)
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
        projections = sum(table[p][column]
                          for p in ("q/k/v projection", "output projection", "dynamic-weight projection"))
        assert table["attention"][column] > projections
        assert table["attention: the rest"][column] == pytest.approx(table["attention"][column] - projections, abs=2e-3)
        assert table["total"][column] > table["attention"][column] + table["MLP"][column]
    for model in built.values():
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


# ---------------------------------------------------------------------------------------------------------------
# bench_attention.py: "triton" per chunk size beside the cost model's prediction, the ceilings, the kernel split
# ---------------------------------------------------------------------------------------------------------------
ATTENTION_COLUMNS = ["shape", "batch x T", "window", "phase", "implementation", "ms", "/ SDPA", "predicted ms",
                     "measured / predicted", "peak MiB"]  # fmt: skip
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on the CPU: Triton's interpreter (conftest.py)


@pytest.fixture
def triton_runs_here():
    from modeling_dcformer.kernels import dcmha_triton

    if not dcmha_triton.available(TRITON_DEVICE):
        pytest.skip(f"the Triton kernels cannot run here: {dcmha_triton.unsupported(torch.device(TRITON_DEVICE), 1)}")
    return dcmha_triton


def markdown_table(text: str, header_first: str) -> tuple[list[str], list[list[str]]]:
    """(header cells, data rows' cells) of the markdown table of `text` whose header starts with `header_first`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {header_first} |"))
    cells = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]  # noqa: E731
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("| "):
            break
        rows.append(cells(line))
    return cells(lines[start]), rows


def tiny_prediction(cost_model, T: int, backward: bool, window=None) -> float:
    """The cost model's own milliseconds for the tiny test shape's attention (its chunks: the memory budget's)."""
    shape = dict(hidden=32, heads=2, mlp=128, groups=1, rank=2, batch=1, tokens=T)
    return sum(w.seconds(cost_model.H200, "fp32") for w in cost_model.attention(shape, "fp32", window, backward)) * 1e3


def test_bench_attention_times_triton_per_chunk_size_beside_the_cost_models_prediction(
        triton_runs_here, tmp_path, capsys, monkeypatch, one_thread_each_test):  # fmt: skip
    """`--chunks 8,T`: one "triton" row per chunk size (the backend really runs chunks of 8 and of all 16 queries),
    each with the cost model's prediction for that chunk size and measured / predicted; the other rows have none;
    the JSON holds the same rows."""
    dcmha_triton = triton_runs_here
    module = load_script("bench_attention")
    chunks = []
    own = dcmha_triton.Call.__init__

    def spy(self, *args, **kwargs):
        own(self, *args, **kwargs)
        chunks.append(self.chunk)

    monkeypatch.setattr(dcmha_triton.Call, "__init__", spy)
    out_json = tmp_path / "attention.json"
    argv = ["--device", TRITON_DEVICE, "--hidden-size", "32", "--heads", "2", "--seq-lens", "16", "--batch-size", "1",
            "--implementations", "eager,triton", "--chunks", "8,T", "--repeats", "1", "--json", str(out_json)]
    assert module.main(argv) == 0
    header, rows = markdown_table(capsys.readouterr().out, "shape")
    assert header == ATTENTION_COLUMNS
    labels = ["SDPA", "eager", "triton@c8", "triton@cT"]
    assert [(r[3], r[4]) for r in rows] == [(phase, label) for phase in ("forward", "fwd+bwd") for label in labels]
    assert set(chunks) == {8, 16}
    for r in rows:
        assert r[:3] == ["32/2", "1 x 16", "-"] and float(r[5]) > 0 and re.fullmatch(r"\d+\.\d\dx", r[6]), r
        if r[4].startswith("triton"):
            assert float(r[7]) > 0 and re.fullmatch(r"\d+\.\d\dx", r[8]), r
        else:
            assert r[7] == r[8] == "-", r
        assert r[9] == ("-" if TRITON_DEVICE == "cpu" else r[9])
    summary = json.loads(out_json.read_text())
    assert summary["scope"] == "layer" and summary["machine"]["name"] == "H200"
    triton_rows = {(r["phase"], r["chunk"]): r for r in summary["rows"] if r["implementation"].startswith("triton")}
    assert sorted(triton_rows) == [("forward", 8), ("forward", 16), ("fwd+bwd", 8), ("fwd+bwd", 16)]
    cost_model = module.cost_model
    for (phase, chunk), r in triton_rows.items():
        assert r["measured_over_predicted"] == pytest.approx(r["ms"] / r["predicted_ms"])
        assert r["predicted_ms"] == r["predicted_h200_ms"]  # no --ceilings: the H200's rates
    for phase in ("forward", "fwd+bwd"):  # the whole call is the budget's chunk at this size: the model's own number
        want = tiny_prediction(cost_model, 16, phase != "forward")
        assert triton_rows[phase, 16]["predicted_ms"] == pytest.approx(want)
        assert triton_rows[phase, 8]["predicted_ms"] > triton_rows[phase, 16]["predicted_ms"]  # twice the launches
    assert [(r["phase"], r["implementation"]) for r in summary["rows"]] == [(r[3], r[4]) for r in rows]


def test_bench_attention_alone_with_a_window_a_tile_and_the_kernel_split(
        triton_runs_here, capsys, monkeypatch, one_thread_each_test):  # fmt: skip
    """`--scope attention --profile` with "triton@4x32" on a local layer: the attention call alone against SDPA, the
    kernels launched at the 4 x 32 tile (restored afterwards), the prediction at that tile, and the profiled run
    split into products, each Triton kernel of the phase and the rest, each part with its prediction."""
    dcmha_triton = triton_runs_here
    module = load_script("bench_attention")
    tiles = []
    launch = dcmha_triton.Chunk.launch

    def spy(self, kernel, tile, *args, **kwargs):
        tiles.append(tile)
        return launch(self, kernel, tile, *args, **kwargs)

    monkeypatch.setattr(dcmha_triton.Chunk, "launch", spy)
    default = dcmha_triton.FORWARD_TILE, dcmha_triton.BACKWARD_TILE
    argv = ["--device", TRITON_DEVICE, "--hidden-size", "32", "--heads", "2", "--seq-lens", "16", "--window", "4",
            "--scope", "attention", "--implementations", "triton@4x32", "--repeats", "1", "--profile"]  # fmt: skip
    assert module.main(argv) == 0
    assert set(tiles) == {(4, 32)} and (dcmha_triton.FORWARD_TILE, dcmha_triton.BACKWARD_TILE) == default
    text = capsys.readouterr().out
    assert "the attention call," in text
    _, rows = markdown_table(text, "shape")
    assert [(r[2], r[3], r[4]) for r in rows] == [("4", ph, impl) for ph in ("forward", "fwd+bwd")
                                                  for impl in ("SDPA", "triton@4x32")]  # fmt: skip
    with module.triton_settings(tile=(4, 32)):
        want = {phase: tiny_prediction(module.cost_model, 16, phase != "forward", window=4)
                for phase in ("forward", "fwd+bwd")}  # fmt: skip
    with module.triton_settings(tile=(16, 16)):  # the tile counts: another one, another prediction
        assert want["forward"] != pytest.approx(tiny_prediction(module.cost_model, 16, False, window=4))
    for r in rows[1::2]:
        assert float(r[7]) == pytest.approx(want[r[3]], abs=1e-3)
    header, split = markdown_table(text, "shape | batch x T | phase | implementation | part")
    assert header[4:] == ["part", "measured ms", "predicted ms", "measured / predicted"]
    parts = {(r[2], r[4]): r for r in split}
    kernels = {"forward": ["_fwd_probs", "_fwd_stats"], "fwd+bwd": ["_bwd_grads", "_bwd_stats", "_fwd_probs",
                                                                     "_fwd_stats"]}  # fmt: skip
    for phase, names in kernels.items():
        got = [part for ph, part in parts if ph == phase]
        assert got[0] == "matrix products (cuBLAS)" and got[1:-2] == names and got[-1] == "total", got
        for part in got[:-2]:
            assert float(parts[phase, part][6]) > 0, parts[phase, part]  # each predicted
        total = parts[phase, "total"]
        assert float(total[5]) == pytest.approx(sum(float(parts[phase, p][5]) for p in got[:-1]), abs=2e-3)
        assert float(total[6]) == pytest.approx(float(next(r for r in rows if r[3] == phase and r[4] != "SDPA")[7]),
                                                abs=1e-3)  # fmt: skip


def test_kernel_names_fall_in_the_parts_of_the_split():
    """torch.profiler's CUDA kernel names: the Triton kernels by name, cuBLAS's products (its gemm kernels and
    Hopper's nvjet ones), SDPA's flash and cuDNN kernels, and everything else; the parts sum to the total."""
    module = load_script("bench_attention")
    names = {
        "_fwd_stats": "_fwd_stats", "_bwd_grads": "_bwd_grads",
        "nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NTN": "matrix products (cuBLAS)",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_cublas": "matrix products (cuBLAS)",
        "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x1_tn_align8>":
            "matrix products (cuBLAS)",
        "aten::bmm": "matrix products (cuBLAS)",
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>": "SDPA kernels",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128": "SDPA kernels",
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": module.OTHER,
        "Memcpy DtoD (Device -> Device)": module.OTHER,
    }  # fmt: skip
    assert {name: module.part_of(name) for name in names} == names
    measured = {"_fwd_stats": 1.0, "nvjet_a": 2.0, "sm90_xmma_gemm_b": 3.0, "fill": 0.5}
    prediction = {"q.k": 1.0, "p.v": 1.5, "_fwd_stats": 0.25, "_fwd_probs": 0.5, "key partials summed": 0.1,
                  "total": 3.35}  # fmt: skip
    assert module.split(measured, prediction) == [
        ("matrix products (cuBLAS)", 5.0, 2.5), ("_fwd_probs", 0.0, 0.5), ("_fwd_stats", 1.0, 0.25),
        (module.OTHER, 0.5, 0.1), ("total", 6.5, 3.35)]  # fmt: skip


def test_ceilings_are_measured_and_scale_the_predictions(tmp_path, capsys, one_thread_each_test):
    """`--measure-ceilings` (here on the CPU, small sizes): the copy and GEMM rates, printed beside the H200's and
    written as JSON; `--ceilings FILE` makes them the cost model's rates, and a missing file keeps the H200's with a
    note."""
    module = load_script("bench_attention")
    out_json = tmp_path / "ceilings.json"
    assert module.main(["--measure-ceilings", "--json", str(out_json)]) == 0
    header, rows = markdown_table(capsys.readouterr().out, "ceiling")
    assert header == ["ceiling", "measured", "the cost model's H200"] and len(rows) == 3
    ceilings = json.loads(out_json.read_text())
    assert ceilings["copy_bytes_per_s"] > 0 and set(ceilings["gemm_flops_per_s"]) == {"bf16", "fp32"}
    assert all(rate > 0 for rate in ceilings["gemm_flops_per_s"].values())
    machine, note = module.machine_from(str(out_json))
    assert machine.hbm == ceilings["copy_bytes_per_s"] and machine.cuda == ceilings["gemm_flops_per_s"]["fp32"]
    assert machine.gemm["bf16"] == machine.gemm["fp16"] == ceilings["gemm_flops_per_s"]["bf16"]
    assert "measured ceilings" in note and machine.l2 == module.cost_model.H200.l2
    spec = module.parse_args(["--shapes", "pythia-160m"]).shapes[0]
    config = module.make_config(spec, module.parse_args([]), True)
    slow = module.predicted(spec, config, 1024, "bf16", "forward", {}, machine)["total"]
    fast = module.predicted(spec, config, 1024, "bf16", "forward", {}, module.cost_model.H200)["total"]
    assert slow > 10 * fast  # a CPU's rates, far below an H200's
    machine, note = module.machine_from(str(tmp_path / "missing.json"))
    assert machine is module.cost_model.H200 and "unreadable" in note


def test_bench_attention_replaces_triton_by_its_chunk_sizes():
    module = load_script("bench_attention")
    args = module.parse_args(["--implementations", "eager,triton,triton@8x32", "--chunks", "64,T"])
    assert args.implementations == ["eager", "triton@c64", "triton@cT", "triton@8x32"]
    assert [module.resolve(label, 512) for label in args.implementations] == [
        ("eager", {}), ("triton", {"chunk": 64}), ("triton", {"chunk": 512}), ("triton", {"tile": (8, 32)})]
    assert module.parse_args(["--implementations", "triton@cT@4x16"]).implementations == ["triton@cT@4x16"]
    assert module.parse_args(["--device", "cuda"]).implementations == ["eager", "compiled", "triton"]


@pytest.mark.parametrize("argv, message", [
    (["--chunks", "128,T"], "--chunks sets triton's chunk sizes"),
    (["--implementations", "triton", "--chunks", "0"], "is not a positive number of queries or T"),
    (["--implementations", "triton", "--chunks", "64,t"], "is not a positive number of queries or T"),
    (["--implementations", "eager@c64"], "unknown 'eager@c64'"),
    (["--shapes", "pythia-7b"], "is not NAME or NAME@wWINDOW"),
    (["--shapes", "pythia-160m@256"], "is not NAME or NAME@wWINDOW"),
])  # fmt: skip
def test_bad_bench_attention_options_are_argparse_errors(argv, message, capsys):
    module = load_script("bench_attention")
    with pytest.raises(SystemExit) as exc:
        module.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# profile_shapes.py: decoding with the static cache through a compiled forward, decoding's own implementations
# ---------------------------------------------------------------------------------------------------------------
def test_profile_shapes_decodes_static_compiled_by_generate_with_its_own_implementations(
        monkeypatch, tmp_path, capsys):  # fmt: skip
    """`--phases prefill,decode-static --implementation eager --decode-implementation auto,eager`: prefill times
    "eager" alone; decode-static times both decoding implementations, each model's generate() compiling its decoding
    step by itself (torch.compile stood in for: compiling takes minutes here) with a static cache, every model's
    forward its own; the JSON holds both phases."""
    module = load_script("profile_shapes")
    compiled, caches, built = [], [], []

    def fake_compile(fn, **kwargs):
        def wrapper(*args, **kw):
            cache = kw.get("past_key_values", kw.get("cache"))
            caches.append((type(cache).__name__, cache.get_max_length()))  # -1 for a growing cache
            return fn(*args, **kw)

        compiled.append(fn.__self__)
        return wrapper

    monkeypatch.setattr(torch, "compile", fake_compile)
    real_build = module.build
    monkeypatch.setattr(module, "build", lambda *a: built.append(real_build(*a)) or built[-1])
    out_json = tmp_path / "model.json"
    argv = ["--preset", "dcpythia-pythia-70m", "--layers", "1", "--vocab", "128", "--dtype", "fp32", "--seq-len", "16",
            "--phases", "prefill,decode-static", "--decode-prompt", "4", "--decode-new", "2", "--repeats", "1",
            "--implementation", "eager", "--decode-implementation", "auto,eager", "--json", str(out_json)]
    assert module.main(argv) == 0
    lines = {line.split(":")[0].strip(): line for line in capsys.readouterr().out.splitlines() if ": NeoX " in line}
    assert re.search(r"NeoX +[\d.]+ ms +DC +[\d.]+ ms +DC/NeoX [\d.]+$", lines["prefill"]), lines
    assert re.search(r"NeoX +[\d.]+ ms +DC\[auto\] +[\d.]+ ms +DC\[eager\] +[\d.]+ ms +DC\[auto\]/NeoX [\d.]+ "
                     r"+DC\[eager\]/NeoX [\d.]+$", lines["decode-static"]), lines  # fmt: skip
    # generate() compiles once per model (DCFormer's two implementations share its compiled call: Dynamo's guards
    # on the config recompile where they differ)
    assert sorted(type(m).__name__ for m in compiled) == ["DCFormerForCausalLM", "GPTNeoXForCausalLM"]
    assert {name for name, _ in caches} == {"StaticCache", "DCFormerCache"}, caches
    assert all(length >= 4 + 2 - 1 for _, length in caches), caches  # static: room for the prompt and the tokens
    assert all("forward" not in vars(model) for model in built)
    summary = json.loads(out_json.read_text())
    assert [p["phase"] for p in summary["phases"]] == ["prefill", "decode-static"]
    assert summary["phases"][1]["implementations"] == {"DC[auto]": "auto", "DC[eager]": "eager"}
    assert set(summary["phases"][1]["ratio"]) == {"DC[auto]", "DC[eager]"}


def test_profile_shapes_refuses_an_unknown_phase(capsys):
    module = load_script("profile_shapes")
    with pytest.raises(SystemExit):
        module.parse_args(["--phases", "prefill,decode-compiled"])
    assert "--phases: unknown decode-compiled" in capsys.readouterr().err
