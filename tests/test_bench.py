"""benchmarks/bench_model.py: the training-step sweep (`--sweep --quick`, as a subprocess) and its arguments.
No timing is asserted: only that the report, the table file, the JSON and the plot are there and well formed."""

import importlib.util
import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

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
