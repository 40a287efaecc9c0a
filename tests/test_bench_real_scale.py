"""benchmarks/bench_real_scale.py: the end-to-end pipeline (write a random GPT-NeoX checkpoint shard by shard,
convert it with dcformer-convert-pythia, load each model in bf16 and time load, prefill and decode), smoke-tested on
a tiny shape. No timing is asserted; the full-shape run's numbers are in docs/benchmarks.md."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_real_scale.py"
TINY = ["--override", "hidden_size=64", "--override", "num_attention_heads=4", "--override", "intermediate_size=128",
        "--override", "vocab_size=256"]


@pytest.fixture(scope="module")
def real_scale():
    spec = importlib.util.spec_from_file_location("bench_real_scale", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_full_shape_counts_pythia_6_9b_parameters(real_scale):
    args = real_scale.parse_args(["--workdir", "x"])
    assert real_scale.parameter_count(real_scale.neox_shape(args)) == 6_857_302_016  # EleutherAI/pythia-6.9b
    assert real_scale.neox_shape(real_scale.parse_args(["--workdir", "x", "--layers", "3"]))["num_hidden_layers"] == 3


def test_a_shape_that_does_not_fit_is_refused_before_anything_is_written(real_scale, tmp_path):
    work = tmp_path / "work"
    with pytest.raises(SystemExit) as exc:
        real_scale.main(["--workdir", str(work), "--layers", "200000"])
    message = str(exc.value)
    assert "not enough resources" in message and f"--workdir {work}" in message and "GB free" in message, message
    assert "\n" not in message and not work.exists()


@pytest.mark.parametrize("argv, message", [
    (["--override", "hidden=64"], "unknown key 'hidden'"),
    (["--override", "hidden_size"], "is not KEY=VALUE"),
    (["--layers", "0"], "--layers must be at least 1"),
    (["--decode-steps", "0"], "--decode-steps must be at least 1"),
])
def test_bad_options_are_argparse_errors(real_scale, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        real_scale.parse_args(["--workdir", "x", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.expensive  # a minute and more of CPU: pytest -m expensive
def test_tiny_end_to_end_run_reports_every_phase_and_leaves_nothing_behind(tmp_path):
    work, out_json = tmp_path / "work", tmp_path / "rs.json"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--workdir", str(work), "--layers", "2", *TINY, "--prefill-tokens", "8",
         "--decode-steps", "2", "--json", str(out_json)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for row in ("write random GPT-NeoX checkpoint", "dcformer-convert-pythia", "from_pretrained (s)",
                "prefill 8 tokens", "decode (2 steps"):
        assert row in proc.stdout, proc.stdout
    summary = json.loads(out_json.read_text())
    results = summary["results"]
    assert results["write"]["parameters"] < results["dcformer"]["parameters"]  # DCMHA's projections added
    assert results["gpt-neox"]["parameters"] == results["write"]["parameters"]
    for kind in ("gpt-neox", "dcformer"):
        r = results[kind]
        assert len(r["decode_step_s"]) == 2 and len(r["tokens"]) == 2 and r["prefill_s"] > 0
        assert r["peak_kib"] >= r["rss_loaded_kib"] > 0
    assert results["convert"]["peak_kib"] > 0 and results["convert"]["bytes"] > results["write"]["bytes"]
    assert os.listdir(work) == []  # both checkpoints deleted (no --keep)
