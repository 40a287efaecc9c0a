"""The README's code blocks, run as a reader would run them (the rules are in docs/testing.md).

- ```python and ```bash blocks run in the README's order, in one temporary directory (so a later block finds what
  an earlier one wrote): each python block in a fresh namespace of this process, each bash block in `bash -euo
  pipefail` with this interpreter's console scripts (`dcformer-*`, `lm_eval`) first on PATH.
- The Hub ids in them are replaced by tiny local stand-ins built here (STAND_INS), the network is off, and
  `push_to_hub` goes to a fake Hub that records the upload.
- ```console blocks set up a machine; they are checked, not run here: `make` targets must exist (`make -n`), and
  the install block is what `make check-wheel` (tests/test_wheel.py) runs.
"""

import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from huggingface_hub import HfApi

from released_checkpoint import released_dir

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "DISABLE_MULTIPROC": "1", "OMP_NUM_THREADS": "1"}


def readme_blocks() -> list[tuple[str, str]]:
    return FENCE.findall(README.read_text())


def test_readme_is_short_and_its_blocks_are_known_kinds():
    text = README.read_text()
    assert len(text.encode()) <= 12_000, f"README.md is {len(text.encode())} bytes (at most 12,000)"
    kinds = [lang for lang, _ in readme_blocks()]
    assert set(kinds) <= {"python", "bash", "console"}, kinds
    assert kinds.count("python") >= 4 and kinds.count("bash") >= 3


def test_console_blocks_are_the_install_and_the_make_targets():
    console = [code for lang, code in readme_blocks() if lang == "console"]
    install, setup = console
    assert "python -m venv" in install and 'pip install ".[eval]"' in install
    for line in setup.splitlines():
        target = line.split()[1]
        assert line.split()[0] == "make", line
        proc = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr


@pytest.fixture
def stand_ins(tmp_path_factory):
    """Tiny local checkpoints for the README's Hub ids."""
    # the demo's tiny Pythia (GPT-NeoX layout and a byte-level BPE tokenizer)
    from modeling_dcformer.demo.pipeline import build_tiny_pythia
    from modeling_dcformer.training.tokenizer import read_lines

    root = tmp_path_factory.mktemp("stand_ins")
    pythia = root / "pythia-tiny"
    build_tiny_pythia(pythia, read_lines([ROOT / "examples" / "data" / "harbour_train.txt"]), seed=0)
    dcpythia, _, _ = released_dir(root, "released-dcpythia", model_type="dcpythia")
    dcformer, _, _ = released_dir(root, "released-dcformer", model_type="dcformer")
    return {"Caiyun-AI/DCPythia-6.9B": str(dcpythia), "Caiyun-AI/DCFormer-2.8B": str(dcformer),
            "EleutherAI/pythia-410m": str(pythia)}


@pytest.fixture
def fake_hub(monkeypatch):
    uploads = []

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        uploads.append((repo_id, sorted(p.name for p in Path(folder_path).iterdir())))
        return types.SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/0")

    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: types.SimpleNamespace(repo_id=repo_id))
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    monkeypatch.setattr(HfApi, "create_branch", lambda self, *a, **k: None)
    return uploads


def test_every_readme_block_runs(tmp_path, monkeypatch, stand_ins, fake_hub):
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    scripts = Path(sys.executable).parent
    assert shutil.which("dcformer-eval", path=str(scripts)), "install the package first (make install)"
    env = {**os.environ, "PATH": os.pathsep.join([str(scripts), os.environ.get("PATH", "")])}
    torch.manual_seed(0)
    ran = []
    for index, (lang, code) in enumerate(readme_blocks()):
        if lang == "console":
            continue
        for hub_id, local in stand_ins.items():
            code = code.replace(hub_id, local)
        if lang == "python":
            exec(compile(code, f"README.md block {index}", "exec"), {"__name__": f"readme_block_{index}"})
        else:
            proc = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=work, env=env,
                                  capture_output=True, text=True, timeout=600)
            assert proc.returncode == 0, f"README.md block {index}:\n{code}\n{proc.stdout[-3000:]}{proc.stderr[-5000:]}"
        ran.append(lang)
    assert ran.count("python") >= 4 and ran.count("bash") >= 3
    assert (work / "my-dcformer" / "config.json").is_file()
    assert (work / "dcpythia-410m" / "model.safetensors").is_file() or list((work / "dcpythia-410m").glob("*.safetensors"))
    assert (work / "dcpythia-6.9b-hf" / "config.json").is_file()
    assert [repo for repo, _ in fake_hub] == ["me/my-dcformer"]
    assert {"config.json", "model.safetensors", "README.md", "modeling_dcformer.py"} <= set(fake_hub[0][1])
