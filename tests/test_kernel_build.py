"""Building the CPU kernel under races and faults (issue 30, item 7): two first-time builds at once into a fresh
`$DCFORMER_CACHE` both succeed (one builds while the other waits on the entry's lock, then loads the stamped
build); a build folder replaced by a file is rebuilt; a cache root that is a file is one clear reason; under
"auto" a failed build is a warning and eager's numbers."""

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from helpers import VOCAB, assert_close, build_model, make_config
from modeling_dcformer import cpu_kernel
from modeling_dcformer.dcmha import DCMHA_BACKENDS

pytestmark = pytest.mark.usefixtures("one_thread_each_test")

USE_KERNEL = textwrap.dedent(
    """
    import torch
    from modeling_dcformer import cpu_kernel
    cpu_kernel.KERNEL.load()
    scores = torch.randn(1, 4, 3, 5)
    cpu_kernel.compose_softmax_compose(scores, torch.zeros(1, 1, 2, 5, 4, 3), 0, None, 0, None, 2, 0, None, 1.0, 2, 1)
    print("ok", bool(torch.isfinite(scores).all()))
    """
)


@pytest.fixture(scope="module", autouse=True)
def _compiler():
    if cpu_kernel.compiler() is None:
        pytest.skip("no C++ compiler here")


@pytest.mark.slow
def test_two_first_time_builds_at_once_both_succeed(tmp_path):
    env = dict(os.environ, DCFORMER_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    runs = [
        subprocess.Popen([sys.executable, "-c", USE_KERNEL], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
        for _ in range(2)
    ]  # fmt: skip
    for run in runs:
        out, err = run.communicate(timeout=900)
        assert run.returncode == 0, err[-3000:]
        assert "ok True" in out
    entries = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len([e for e in entries if not e.endswith(".lock")]) == 1, entries  # no private build folder left
    folder = next(p for p in (tmp_path / "cache").iterdir() if p.is_dir())
    assert (folder / cpu_kernel.STAMP).read_text().strip() == cpu_kernel.file_sha256(folder / f"{folder.name}.so")


@pytest.mark.slow
def test_a_build_folder_replaced_by_a_file_is_rebuilt(tmp_path):
    env = dict(os.environ, DCFORMER_CACHE=str(tmp_path), OMP_NUM_THREADS="1")
    folder = tmp_path / cpu_kernel.KERNEL.build_dir(cpu_kernel.compiler()).name
    folder.write_text("not a folder\n")
    run = subprocess.run([sys.executable, "-c", USE_KERNEL], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "ok True" in run.stdout and "incomplete or corrupt: rebuilding" in run.stderr
    assert folder.is_dir() and (folder / cpu_kernel.STAMP).is_file()


def test_a_cache_root_that_is_a_file_is_one_clear_reason(monkeypatch, tmp_path):
    root = tmp_path / "cache"
    root.write_text("")
    monkeypatch.setenv("DCFORMER_CACHE", str(root))
    backend = cpu_kernel.CPUKernelBackend(tmp_path / "never_built.cpp")
    (tmp_path / "never_built.cpp").write_text("// not built\n")
    with pytest.raises(RuntimeError, match=rf"the kernel cache {root} \(\$DCFORMER_CACHE\) is a file, not a folder"):
        backend.load()


def test_auto_warns_when_the_build_fails_and_computes_eagerly(monkeypatch, tmp_path, caplog):
    """The docs promise a warning when a backend cannot be built; "auto" then gives eager's numbers."""
    source = tmp_path / "broken.cpp"
    source.write_text("this is not C++;\n")
    monkeypatch.setenv("DCFORMER_CACHE", str(tmp_path / "cache"))
    lazy = DCMHA_BACKENDS["kernel"]
    monkeypatch.setattr(lazy, "_backend", cpu_kernel.CPUKernelBackend(source))
    model = build_model(make_config(num_hidden_layers=1, dcmha_implementation="eager"))
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(0))
    logger = logging.getLogger("modeling_dcformer.cpu_kernel")
    monkeypatch.setattr(logger, "propagate", True)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="modeling_dcformer.cpu_kernel"):
        expected = model(ids).logits
        model.config.dcmha_implementation = "auto"
        assert_close(model(ids).logits, expected)
        model(ids)  # the failure is remembered: one warning, not one per call
    warnings = [r.getMessage() for r in caplog.records if "cannot be built here" in r.getMessage()]
    assert len(warnings) == 1 and 'dcmha_implementation="auto" does without it' in warnings[0]
