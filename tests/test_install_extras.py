"""What each install installs: `make demo` installs the `demo` extra only (what
examples/demo.py runs: lm-eval and datasets; no test tools, no triton), the `train` extra holds what fine-tuning
needs (peft for LoRA, datasets for dcformer-train), the training command is an entry point, and its accelerate
configs are package data."""

import configparser
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def setup_cfg() -> configparser.ConfigParser:
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    return parser


def extra(name: str) -> set[str]:
    """The distribution names of an extra (versions and markers dropped)."""
    lines = [line.strip() for line in setup_cfg()["options.extras_require"][name].splitlines() if line.strip()]
    return {re.split(r"[<>=!;\[ ]", line, maxsplit=1)[0].lower() for line in lines}


def test_demo_extra_is_what_the_demo_runs():
    assert extra("demo") == {"lm-eval", "datasets"}
    assert "triton" in extra("test") and "pytest" in extra("test")  # where they belong


def test_make_demo_installs_only_the_demo_extra():
    proc = subprocess.run(["make", "-n", "demo"], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0 and "No rule" not in proc.stderr:
        pytest.skip(f"make is not usable here: {proc.stderr.strip()}")
    installs = [line for line in proc.stdout.splitlines() if "pip install" in line and "-e" in line]
    assert installs, proc.stdout
    assert all('".[demo]"' in line for line in installs), installs
    assert "examples/demo.py" in proc.stdout


def test_train_extra_and_entry_point():
    assert {"peft", "datasets"} <= extra("train")
    scripts = setup_cfg()["options.entry_points"]["console_scripts"]
    assert "dcformer-train = modeling_dcformer.training.train_clm:cli" in scripts
    options = setup_cfg()["options"]
    assert "modeling_dcformer.training" in options["packages"].split()
    data = setup_cfg()["options.package_data"]["modeling_dcformer.training"]
    assert "accelerate/*.yaml" in data and "accelerate/*.json" in data


def test_the_wheel_holds_no_research_code():
    """The comparisons, studies and reports are research/, a distribution of its own: no package of the library's
    wheel holds them, and research/ declares its own package (which `make install` installs beside the library)."""
    packages = setup_cfg()["options"]["packages"].split()
    assert all(name == "modeling_dcformer" or name.startswith("modeling_dcformer.") for name in packages), packages
    research = (ROOT / "research" / "pyproject.toml").read_text()
    assert 'packages = ["dcformer_research"]' in research and '"modeling-dcformer"' in research
    assert "-e research" in (ROOT / "Makefile").read_text()


def test_no_pytest_pythonpath_and_thin_examples():
    assert "pythonpath" not in setup_cfg()["tool:pytest"]
    for script in sorted((ROOT / "examples").glob("*.py")):
        lines = len(script.read_text().splitlines())
        assert lines <= 500, f"{script.name}: {lines} lines"


def test_saved_remote_code_does_not_carry_the_research_code(tmp_path):
    """What a saved model carries as remote code imports nothing of the research code, the demo or the training."""
    from modeling_dcformer import DCFormerConfig, DCFormerForCausalLM

    config = DCFormerConfig.from_preset("dcformer-tiny", hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    DCFormerForCausalLM(config).save_pretrained(tmp_path / "saved")
    code = {p.name: p.read_text() for p in (tmp_path / "saved").glob("*.py")}
    assert code, "save_pretrained wrote no remote code"
    assert not [name for name, text in code.items() if "dcformer_research" in text or ".training import" in text]
