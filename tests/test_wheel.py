"""The package as a user meets it: a wheel, installed (not editable) into a fresh virtual environment by the
README's install block, then used from a temporary directory outside the checkout.

Slow (a few minutes: the environment is installed from scratch), so `make test` skips it and `make check-wheel`
(run by CI after `make test`) selects it with `-m wheel`.
"""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
SCRIPTS = ("dcformer-convert-pythia", "dcformer-convert-llama", "dcformer-convert-released", "dcformer-eval")

pytestmark = pytest.mark.wheel  # installs a fresh environment: `make check-wheel` runs it (`pytest -m wheel`)


def readme_blocks(lang):
    return [code for kind, code in FENCE.findall((ROOT / "README.md").read_text()) if kind == lang]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The README's install block, run in an empty directory with the wheel built from this checkout."""
    base = tmp_path_factory.mktemp("wheel")
    dist = base / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
                    str(ROOT)], check=True, cwd=base)
    (wheel,) = dist.glob("modeling_dcformer-*.whl")
    install = readme_blocks("console")[0]
    assert install.startswith("python -m venv .venv") and '".[eval]"' in install
    install = install.replace("python -m venv", f"{sys.executable} -m venv", 1).replace('".[eval]"', f'"{wheel}[eval]"')
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", install], cwd=base, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    bin_dir = base / ".venv" / "bin"
    work = base / "work"  # outside the checkout: nothing of it is importable from here
    work.mkdir()
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    environ.update(PATH=os.pathsep.join([str(bin_dir), environ.get("PATH", "")]), HF_HUB_OFFLINE="1",
                   HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(base / "hf_home"),
                   OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", DISABLE_MULTIPROC="1")
    return bin_dir, work, environ


def run(env, *cmd, code=None):
    bin_dir, work, environ = env
    if code is not None:
        cmd = [str(bin_dir / "python"), "-c", textwrap.dedent(code), *cmd]
    proc = subprocess.run(list(cmd), cwd=work, env=environ, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{cmd}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def test_the_wheel_holds_the_library_and_no_research_code(env):
    """The wheel's files are the package (its flat modules, its folders and their data) and its metadata: the
    comparisons and studies (research/, dcformer_research) are not in it, nor importable where it is installed."""
    import zipfile

    (wheel,) = (Path(env[1]).parent / "dist").glob("modeling_dcformer-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert all(n.startswith(("modeling_dcformer/", "modeling_dcformer-")) for n in names), names
    assert not [n for n in names if "research" in n or "experiments" in n], names
    for folder in ("kernels/csrc/dcmha_cpu.cpp", "publishing/model_card_template.md", "training/accelerate/fsdp.yaml",
                   "configuration/dcformer-tiny.json", "evals/tasks/piqa_local.yaml"):
        assert f"modeling_dcformer/{folder}" in names, folder
    out = run(env, code="import importlib.util; print(importlib.util.find_spec('dcformer_research'))")
    assert out.strip() == "None", out


def test_installed_not_editable_and_not_from_the_checkout(env):
    out = run(env, code="import modeling_dcformer, modeling_dcformer.conversion as c, modeling_dcformer.evals as e; "
                        "print(modeling_dcformer.__file__, c.__file__, e.__file__)")
    assert "site-packages" in out and str(ROOT) not in out, out


@pytest.mark.parametrize("script", SCRIPTS)
def test_console_script_help(env, script):
    out = run(env, script, "--help")
    assert "usage" in out.lower(), out


def test_python_m_help(env):
    bin_dir = env[0]
    for module in ("modeling_dcformer.conversion.pythia", "modeling_dcformer.conversion.released",
                   "modeling_dcformer.evals.harness"):
        assert "usage" in run(env, str(bin_dir / "python"), "-m", module, "--help").lower()


def test_presets_by_name(env):
    out = run(env, code="""
        from modeling_dcformer import DCFormerConfig
        c = DCFormerConfig.from_preset("dcpythia-6.9b")
        print(c.hidden_size, c.num_hidden_layers, c.window_size)
        try:
            DCFormerConfig.from_preset("dcpythia-7b")
        except ValueError as err:
            print(err)
    """)
    assert out.startswith("4096 32 256\nunknown preset 'dcpythia-7b'; the presets are: dcformer-2.8b, "), out


def test_readme_quick_start(env):
    run(env, code=readme_blocks("python")[0])
    assert (env[1] / "my-dcformer" / "config.json").is_file()


MAKE_PYTHIA = """
    import sys
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, PreTrainedTokenizerFast
    import torch
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    text = ["The harbour town wakes before the boats come in.", "Gulls follow the last boat home at dusk."] * 20
    bpe.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    torch.manual_seed(0)
    config = GPTNeoXConfig(vocab_size=320, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, rotary_pct=0.25, max_position_embeddings=128)
    GPTNeoXForCausalLM(config).save_pretrained(sys.argv[1])
    tok.save_pretrained(sys.argv[1])
"""

REMOTE_RELOAD = """
    import importlib.abc, sys
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "modeling_dcformer":
                raise ModuleNotFoundError(f"{name} is blocked: as if not installed", name="modeling_dcformer")
    sys.meta_path.insert(0, Block())
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
    with torch.no_grad():
        torch.save(model(torch.tensor([[1, 2, 3, 4, 5]])).logits, sys.argv[2])
    print(type(model).__module__)
"""


def test_convert_evaluate_save_and_reload_with_remote_code(env):
    bin_dir, work, _ = env
    run(env, "pythia-tiny", code=MAKE_PYTHIA)
    out = run(env, "dcformer-convert-pythia", "pythia-tiny", "dcpythia-tiny", "--verify")
    assert (work / "dcpythia-tiny" / "config.json").is_file(), out
    run(env, "dcformer-eval", "--model", "dcformer", "--model_args", "pretrained=dcpythia-tiny", "--tasks",
        "piqa_local", "--limit", "5", "--device", "cpu", "--output_path", "results")
    (results,) = work.glob("results/**/results_*.json")
    assert json.loads(results.read_text())["results"]["piqa_local"]["acc,none"] is not None
    run(env, code="""
        import torch, modeling_dcformer
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained("dcpythia-tiny").eval()
        model.save_pretrained("saved")
        # the remote code carries no kernel, so its "auto" runs eager here: compare with eager (the native "auto"
        # takes the CPU kernel, equal to rounding: tests/test_dcmha_backends.py)
        model.config.dcmha_implementation = "eager"
        with torch.no_grad():
            torch.save(model(torch.tensor([[1, 2, 3, 4, 5]])).logits, "native.pt")
    """)
    module = run(env, str(bin_dir / "python"), "-I", "-c", textwrap.dedent(REMOTE_RELOAD), "saved", "remote.pt")
    assert module.startswith("transformers_modules."), module
    out = run(env, code="""
        import torch
        print(float((torch.load("native.pt") - torch.load("remote.pt")).abs().max()))
    """)
    assert float(out) == 0.0, out
