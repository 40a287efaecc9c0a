"""The bytes-and-FLOPs model of a layer on a GPU (`benchmarks/cost_model.py`): what the "triton" backend's design
predicts against GPT-NeoX, which a GPU run then checks (benchmarks/cuda_check.sh prints both)."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def cost_model():
    spec = importlib.util.spec_from_file_location("cost_model", ROOT / "benchmarks" / "cost_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("window", [None, 256], ids=["global", "window-256"])
def test_the_design_predicts_a_6_9b_layer_within_1_2_of_gpt_neox(cost_model, window):
    """DCPythia-6.9B's layer shape, 1 x 2048 tokens in bf16 on an H200: the forward pass within 1.2x GPT-NeoX's (its
    layers are global and local with a window of 256, alternating)."""
    row = cost_model.layer("dcpythia-6.9b", "bf16", window, backward=False)
    assert 1.0 < row["ratio"] <= 1.2, row
    train = cost_model.layer("dcpythia-6.9b", "bf16", window, backward=True)
    assert row["ratio"] < train["ratio"] <= 1.3  # the backward pass recomputes the scores and sums partials


def test_the_model_follows_the_work(cost_model):
    """More tokens, a slower memory, fp32 instead of bf16: each costs DCFormer's attention more; a window costs it
    less; every piece of the attention takes time."""
    base = cost_model.layer("dcpythia-6.9b", "bf16")
    assert cost_model.layer("dcpythia-6.9b", "bf16", tokens=4096)["dc_attention_s"] > 3 * base["dc_attention_s"]
    slow = cost_model.Machine(hbm=cost_model.H200.hbm / 2)
    assert cost_model.layer("dcpythia-6.9b", "bf16", machine=slow)["ratio"] > base["ratio"]
    assert cost_model.layer("dcpythia-6.9b", "fp32")["dc_attention_s"] > base["dc_attention_s"]
    assert cost_model.layer("dcpythia-6.9b", "bf16", window=256)["dc_attention_s"] < base["dc_attention_s"]
    assert set(base["kernels"]) == {"q.k", "_fwd_stats", "_fwd_probs", "p.v"}
    assert all(seconds > 0 for seconds in base["kernels"].values())


def test_the_command_prints_a_table(cost_model, capsys, tmp_path):
    assert cost_model.main(["--shape", "pythia-160m", "--details", "--json", str(tmp_path / "m.json")]) == 0
    out = capsys.readouterr().out
    assert "| pythia-160m | 8 x 1024 | forward |" in out and "_bwd_grads" in out
    assert (tmp_path / "m.json").read_text().startswith("[")
