"""What the tools say when something outside them goes wrong:

- the converters' `--push-to-hub` with a failing upload: one line (the complete output directory, the failure, the
  `hf upload` command that retries just the upload with `--private`, no Python and no token), a non-zero exit, the
  directory left complete;
- examples/train_clm.py under `accelerate launch --num_processes 2 --cpu` (one process runs): a warning naming the
  routes that do start several CPU processes; under torchrun (two processes run): no warning;
- examples/demo.py's summary when the benchmark could not measure a ratio: `n/a`, never `nan`, and valid JSON.
"""

import json
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import load_example, save_tiny_neox
from modeling_dcformer.conversion import released as released_converter
from modeling_dcformer.conversion import pythia as p2d
from modeling_dcformer.training import train_clm
from released_checkpoint import released_dir

demo = load_example("demo")  # examples/demo.py, in-process

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
REPO = "someone/dcpythia-upload-test"


# ----------------------------------------------------------------------------------------------------------------
# Item 9: a failed upload after a successful conversion
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tool", ["pythia", "released"])
def test_failed_upload_is_one_line_with_the_retry_command(tool, tmp_path, capsys, monkeypatch):
    import huggingface_hub

    class ConnectError(Exception):  # what the HTTP client raises without a network (not an OSError)
        pass

    def unreachable(self, *args, **kwargs):
        raise ConnectError("[Errno -3] Temporary failure in name resolution\n(and 25 more frames)")

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", unreachable)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", unreachable)
    if tool == "pythia":
        src, module, extra = tmp_path / "neox", p2d, ["--no-verify"]
        save_tiny_neox(src)
    else:
        src, module, extra = released_dir(tmp_path)[0], released_converter, []
    capsys.readouterr()
    dst = tmp_path / "out dir"  # a space: the retry command must quote it
    code = module.main([str(src), str(dst), "--push-to-hub", REPO, "--private", "--token", "hf_secret_x", *extra])
    out, err = capsys.readouterr()

    lines = [line for line in err.splitlines() if line.strip() and not re.search(r"\d+%\|", line)]  # no progress bars
    assert code != 0 and code != 2, (code, err)  # 2 is "nothing converted"; this one says the output is there
    assert len(lines) == 1 and "Traceback" not in err, err
    line = lines[0]
    assert f"saved the model to {dst.resolve()}" in line and REPO in line  # publishing.HubUploadError's own text
    assert "ConnectError: [Errno -3] Temporary failure in name resolution" in line and "25 more" not in line
    assert f"hf upload {REPO} '{dst.resolve()}' --private" in line
    assert "push_to_hub(" not in line  # a command-line user gets a command, not Python
    assert "hf_secret_x" not in line and "add --token" in line  # the token is never printed
    assert f"Converted {src}" in out
    # The converted directory is complete: it loads.
    from transformers import AutoModelForCausalLM

    assert {"config.json", "README.md", "model.safetensors"} <= {p.name for p in dst.iterdir()}
    assert type(AutoModelForCausalLM.from_pretrained(dst)).__name__ == "DCFormerForCausalLM"


# ----------------------------------------------------------------------------------------------------------------
# Item 10: fewer processes than asked for
# ----------------------------------------------------------------------------------------------------------------
ACCELERATE_CPU_ENV = {"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
ACCELERATE_CPU_ARGV = ["python3", "/usr/bin/accelerate", "launch", "--num_processes", "2", "--cpu", "train_clm.py"]


def assert_names_the_routes(message):
    assert "accelerate launch --config_file $(dcformer-train --print-accelerate-config multi_cpu_gloo)" in message
    assert "torchrun --nproc_per_node" in message and "--use_cpu" in message


def test_process_count_warning():
    message = train_clm.process_count_warning(ACCELERATE_CPU_ENV, 1, ACCELERATE_CPU_ARGV)
    assert "asked for 2 processes but started only this one" in message and "--cpu" in message
    assert_names_the_routes(message)
    for argv in (["accelerate", "launch", "--num-processes=4", "--cpu", "x.py"], ["accelerate", "launch", "x.py"]):
        message = train_clm.process_count_warning(ACCELERATE_CPU_ENV, 1, argv)
        assert ("4 processes" if "--num-processes=4" in argv else "several processes") in message

    message = train_clm.process_count_warning({"WORLD_SIZE": "4", "RANK": "0"}, 2, [])
    assert "asked for 4 processes" in message and "has 2" in message
    assert_names_the_routes(message)

    # Nothing to say: as many processes run as were asked for, or no launcher asked for several.
    assert train_clm.process_count_warning({}, 1, []) is None
    assert train_clm.process_count_warning({"WORLD_SIZE": "2"}, 2, []) is None
    assert train_clm.process_count_warning({"ACCELERATE_USE_CPU": "True"}, 1, ["accelerate", "launch"]) is None
    one = ["accelerate", "launch", "--num_processes", "1"]
    assert train_clm.process_count_warning(ACCELERATE_CPU_ENV, 1, one) is None


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_train_clm(launcher: list[str], tmp_path) -> str:
    """examples/train_clm.py for one step of a tiny preset on the bundled text, under `launcher`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "WORLD_SIZE", "RANK", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HOME=str(tmp_path / "hf_home"),
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", ACCELERATE_DISABLE_RICH="1",
               )  # fmt: skip
    args = [
        str(EXAMPLES / "train_clm.py"), "--config_name", "dcformer-tiny", "--new_tokenizer_vocab_size", "300",
        "--train_file", str(EXAMPLES / "data" / "harbour_train.txt"), "--block_size", "32",
        "--per_device_train_batch_size", "2", "--max_steps", "1", "--do_train", "--save_strategy", "no",
        "--report_to", "none", "--use_cpu", "--disable_tqdm", "true", "--output_dir", str(tmp_path / "run"),
    ]  # fmt: skip
    proc = subprocess.run([*launcher, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    return output


@pytest.mark.slow
def test_accelerate_cpu_launch_runs_one_process_and_says_so(tmp_path):
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--cpu",
                "--main_process_port", str(free_port())]  # fmt: skip
    output = run_train_clm(launcher, tmp_path)
    assert "process rank 0 of 1" in output and "of 2" not in output
    assert "accelerate launch was asked for 2 processes but started only this one" in output
    assert "--print-accelerate-config multi_cpu_gloo" in output and "torchrun --nproc_per_node" in output


@pytest.mark.slow
def test_torchrun_two_cpu_processes_smoke(tmp_path):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", str(free_port())]  # fmt: skip
    output = run_train_clm(launcher, tmp_path)
    assert "process rank 0 of 2" in output and "process rank 1 of 2" in output
    assert "asked for" not in output
    state = json.loads((tmp_path / "run" / "trainer_state.json").read_text())
    assert state["global_step"] == 1


# ----------------------------------------------------------------------------------------------------------------
# Item 12: the demo's summary with a ratio the benchmark could not measure
# ----------------------------------------------------------------------------------------------------------------
def demo_summary(bench: dict) -> dict:
    return {
        "source": {"source": "tiny", "dir": "/d/pythia-tiny"},
        "conversion": {"verified": True, "max_logit_difference": 1e-6, "tolerance": 1e-4},
        "training": {"steps": 2, "seconds_per_step": 0.1, "train_loss_first": 5.0, "train_loss_last": 4.0,
                     "logging_steps": 1, "eval_loss_before": 5.0, "eval_loss_after": 4.5},
        "evaluation": {"tasks": {}},
        "save": {"dir": "/d/out", "auto_map": True, "model_card": True},
        "reload": {"native": {"ok": True, "max_abs_diff": 0.0},
                   "remote_code": {"status": "ok", "ok": True, "max_abs_diff": 0.0,
                                   "modeling_dcformer_importable": False}},
        "generation": {"greedy": "a", "sampled": ["b"], "cache_matches_no_cache": True},
        "bench": bench,
        "wall_time_s": 1.0,
        "stage_seconds": {"total": 1.0},
        "ok": True,
    }  # fmt: skip


def test_demo_bench_ratio_not_measured(tmp_path, monkeypatch):
    """bench_model.py writes NaN for a ratio over a baseline measured as 0 (prefill memory of the tiny model on a
    CPU): the demo keeps it as None (summary.json stays valid JSON) and prints n/a, not `nanx`."""
    written = {"baseline": "GPT-NeoX", "shape": "tiny", "ratios": {"prefill": 1.25, "decode": 2.0},
               "memory_ratios": {"prefill": float("nan"), "decode": 1.5}}  # fmt: skip

    def fake_bench(cmd, cwd=None):
        Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps(written))  # json writes NaN as the bench does
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(demo.subprocess, "run", fake_bench)
    bench = demo.run_quick_bench(tmp_path)
    assert bench["memory_ratios"] == {"prefill": None, "decode": 1.5} and bench["ratios"] == written["ratios"]
    json.dumps(bench, allow_nan=False)

    for memory in (bench["memory_ratios"], written["memory_ratios"]):  # None, or a NaN straight from the bench
        rows = dict(demo.summary_rows(demo_summary({**bench, "memory_ratios": memory})))
        text = rows["bench DCFormer/GPT-NeoX"]
        assert "nan" not in text.lower().replace("n/a", "")
        assert text == ("prefill 1.25x, decode 2.00x; peak memory prefill n/a (baseline measured as 0), "
                        "decode 1.50x")
    assert math.isnan(written["memory_ratios"]["prefill"])
