"""The comparison on three axes: every run reported against training tokens, training
FLOPs (`dcformer_research.flops`) and training seconds; `--report-only` rebuilds the tables and the
three-axis plots from results.json, also from the JSON of older versions (seconds estimated from the median step
time, or n/a); the GPU command of docs/evidence.md parses, and `--device cuda` without CUDA is one clear error."""

import json
import shlex
from pathlib import Path

import pytest
import torch

from dcformer_research import compare, flops

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "examples" / "data" / "harbour_train.txt"
PNG = b"\x89PNG\r\n\x1a\n"


def tiny_corpus(folder: Path) -> Path:
    lines = FIXTURE.read_text(encoding="utf-8").splitlines()
    folder.mkdir(parents=True)
    for i in range(8):
        (folder / f"doc{i}.txt").write_text("\n".join(lines[i * 20 :][:20]) + "\n", encoding="utf-8")
    return folder


def test_three_axes_run_and_rebuild_from_older_json(tmp_path):
    out = tmp_path / "study"
    argv = [
        "--task", "lm", "--corpus", str(tiny_corpus(tmp_path / "corpus")), "--tokenizer", "byte",
        "--val-fraction", "0.25", "--block-size", "32", "--steps", "10", "--eval-every", "5", "--warmup", "1",
        "--batch-size", "4", "--val-size", "4", "--sizes", "32/2/1", "--seeds", "1", "--quiet", "--out", str(out),
    ]  # fmt: skip
    compare.main(argv)
    folder = out / "h32-n2-l1"
    data = json.loads((folder / "results.json").read_text())
    for run in data["runs"]:
        points = run["train_seconds_at_step"]
        assert [s for s, _ in points] == [0, 5, 10] and points[0][1] == 0.0
        assert all(a[1] < b[1] for a, b in zip(points, points[1:])) and points[-1][1] <= run["train_seconds"]
        axes = data["aggregate"]["models"][run["model"]]["axes"]
        assert axes["tokens"] == 10 * 4 * 32 and axes["seconds_source"] == "measured"
        assert axes["flops"] == flops.training_flops(data["configs"][run["model"]], 10 * 4 * 32, 32, run["model"])
    dc, tf = (data["aggregate"]["models"][k]["axes"]["flops"] for k in ("dcformer", "transformer"))
    assert dc != tf  # DCMHA's extra work is counted (and the Transformer's wider MLP)
    comparisons = data["aggregate"]["axis_comparisons"]["lm"]
    assert set(comparisons) == {"tokens", "flops", "seconds"} and all(comparisons.values())
    table = (folder / "results.md").read_text()
    assert "| model | training tokens | training FLOPs |" in table and "measured: the training steps only" in table
    for path in (folder / "curves_axes.png", out / "scaling_axes.png"):
        assert path.read_bytes()[:8] == PNG
    assert "training FLOPs | training seconds |" in (out / "scaling.md").read_text()

    # an older results.json: no per-evaluation seconds -> estimated from the median step time
    for run in data["runs"]:
        del run["train_seconds_at_step"]
    data.pop("aggregate")
    (folder / "results.json").write_text(json.dumps(data))
    (folder / "curves_axes.png").unlink()
    compare.main(["--report-only", "--out", str(out)])
    rebuilt = json.loads((folder / "results.json").read_text())
    assert rebuilt["aggregate"]["models"]["dcformer"]["axes"]["seconds_source"] == "estimated"
    assert "estimated as steps x the median step time" in (folder / "results.md").read_text()
    assert "| ≈ " in (out / "scaling.md").read_text() and (folder / "curves_axes.png").read_bytes()[:8] == PNG

    # older still: no step time at all -> the seconds axis is n/a, the other two are still there
    for run in rebuilt["runs"]:
        del run["step_seconds_median"]
    (folder / "results.json").write_text(json.dumps(rebuilt))
    compare.main(["--report-only", "--out", str(folder)])
    again = json.loads((folder / "results.json").read_text())
    assert again["aggregate"]["axis_comparisons"]["lm"]["seconds"] is None
    assert again["aggregate"]["axis_comparisons"]["lm"]["flops"] is not None
    text = (folder / "results.md").read_text()
    assert "training seconds: n/a" in text and "| n/a |" in text
    assert not list(folder.glob(".*.tmp")) and not list(folder.glob(".curves*"))  # no temporary file left behind

    # a comparison whose DCFormer has qk-norm (the study's dcformer-qk runs) names it in its tables and plot legends
    assert "| DCFormer (DCMHA) |" in text and "+ qk-norm" not in text
    again["setup"]["dc_overrides"] = {**(again["setup"].get("dc_overrides") or {}), "use_qk_norm": True}
    (folder / "results.json").write_text(json.dumps(again))
    compare.main(["--report-only", "--out", str(folder)])
    text = (folder / "results.md").read_text()
    assert "| DCFormer (DCMHA) + qk-norm |" in text and "| DCFormer (DCMHA) |" not in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_device_cuda_without_cuda_is_one_clear_error(capsys):
    with pytest.raises(SystemExit) as exc:
        compare.parse_args(["--task", "lm", "--device", "cuda"])
    assert exc.value.code == 2
    assert "--device cuda: no CUDA device is available here" in capsys.readouterr().err
    assert compare.parse_args(["--task", "lm", "--device", "cpu"]).device == "cpu"  # the neighbour is accepted
    assert compare.parse_args(["--task", "lm"]).device == "cpu"  # auto: the CPU here


def gpu_command() -> list[str]:
    """The GPU study's command as docs/evidence.md prints it (the line after the marker)."""
    lines = (ROOT / "docs" / "evidence.md").read_text().splitlines()
    start = lines.index("<!-- gpu-command -->")
    block = []
    for line in lines[start + 2 :]:  # the marker, then the opening fence
        if line.startswith("```"):
            break
        block.append(line.rstrip("\\").strip())
    argv = shlex.split(" ".join(block))
    assert argv[:3] == ["python", "-m", "dcformer_research.compare"]
    return argv[3:]


def test_gpu_command_of_the_docs_parses_to_the_405m_shape(tmp_path):
    """Every option of the documented command exists; on the CPU (--device cpu in place of cuda) it resolves to
    the paper's 405M shape and a few hundred million training tokens."""
    argv = gpu_command()
    assert argv[argv.index("--device") + 1] == "cuda"
    argv[argv.index("--device") + 1] = "cpu"
    argv[argv.index("--corpus") + 1] = str(tmp_path)
    argv[argv.index("--out") + 1] = str(tmp_path / "out")
    args = compare.parse_args(argv)
    assert args.shape_dict == {
        "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096
    }  # fmt: skip
    tokens = args.steps * args.batch_size * args.block_size
    assert 2e8 <= tokens <= 5e8 and args.bf16 and args.block_size == 2048
