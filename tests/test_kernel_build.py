"""Building the CPU kernel under races and faults: two first-time builds at once into a fresh
`$DCFORMER_CACHE` both succeed (one builds while the other waits on the entry's lock, then loads the stamped
build); a build folder replaced by a file is rebuilt; a cache root that is a file is one clear reason; under
"auto" a failed build is a warning and eager's numbers."""

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from helpers import VOCAB, assert_close, build_model, make_config, registered
from modeling_dcformer.kernels import build, dcmha_cpu

pytestmark = pytest.mark.usefixtures("one_thread_each_test")

# The build machinery (cache entry, lock, stamp, private folder, swap) does not depend on what it compiles: these
# tests build a one-line stand-in source (about a second) instead of the kernel (about 30 s each, three times); the
# kernel itself is built and checked by test_dcmha_cpu.py.
STAND_IN = 'extern "C" int dcformer_build_probe() { return 42; }  // a stand-in for csrc/dcmha_cpu.cpp\n'

BUILD_AND_LOAD = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from modeling_dcformer.kernels.build import OperatorLibrary
    library = OperatorLibrary(Path(sys.argv[1]))
    library.load()
    print("ok", library.loaded)
    """
)


def stand_in(tmp_path) -> tuple[build.OperatorLibrary, list[str], dict]:
    """The stand-in source as a library, the command that builds and loads it in a fresh process, and an
    environment whose `$DCFORMER_CACHE` is `tmp_path / "cache"`."""
    source = tmp_path / "stand_in.cpp"
    source.write_text(STAND_IN + f"// {tmp_path.name}\n")  # one cache entry (and extension name) per test
    env = dict(os.environ, DCFORMER_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    return build.OperatorLibrary(source), [sys.executable, "-c", BUILD_AND_LOAD, str(source)], env


def entry(tmp_path, library) -> Path:
    """The stand-in's cache entry (computed under the tests' `$DCFORMER_CACHE`)."""
    return tmp_path / "cache" / library.folder(build.find_compiler()).name


def test_two_first_time_builds_at_once_both_succeed(tmp_path):
    library, command, env = stand_in(tmp_path)
    runs = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]  # fmt: skip
    for run in runs:
        out, err = run.communicate(timeout=600)
        assert run.returncode == 0, err[-3000:]
        assert "ok True" in out
    entries = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len([e for e in entries if not e.endswith(".lock")]) == 1, entries  # no private build folder left
    folder = entry(tmp_path, library)
    assert folder.is_dir(), entries
    assert (folder / build.STAMP).read_text().strip() == build.file_sha256(folder / f"{folder.name}.so")


@pytest.fixture
def in_process(tmp_path, monkeypatch, caplog):
    """Builds of the stand-in in this process (a subprocess costs seconds of imports): `$DCFORMER_CACHE` is
    `tmp_path / "cache"`, and the warnings of the build are captured."""
    monkeypatch.setenv("DCFORMER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(logging.getLogger("modeling_dcformer.kernels.build"), "propagate", True)
    caplog.set_level(logging.WARNING, logger="modeling_dcformer.kernels.build")
    return stand_in(tmp_path)[0]


def never_build(folder, cxx):
    raise AssertionError(f"built {folder} again")


def test_a_build_folder_replaced_by_a_file_is_rebuilt(tmp_path, in_process, caplog):
    folder = entry(tmp_path, in_process)
    folder.parent.mkdir()
    folder.write_text("not a folder\n")
    in_process.load()
    assert in_process.loaded and "incomplete or corrupt: rebuilding" in caplog.text
    assert folder.is_dir() and (folder / build.STAMP).is_file()


def test_a_corrupt_cached_build_is_rebuilt_not_loaded(tmp_path, in_process, caplog, monkeypatch):
    """A cached library that does not match its stamp (a crash mid-write, a corrupt disk) is rebuilt with a warning,
    never loaded (loading a truncated kernel crashed the process with a bus error); the rebuilt one then loads
    without a build."""
    folder = entry(tmp_path, in_process)
    folder.mkdir(parents=True)
    library = folder / f"{folder.name}.so"
    library.write_bytes(b"\x7fELF" + bytes(60))  # the start of a library whose write was cut short
    (folder / build.STAMP).write_text("0" * 64 + "\n")
    loaded = []
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    in_process.load()
    assert "incomplete or corrupt: rebuilding" in caplog.text
    assert str(library) not in loaded, "the truncated library was loaded"
    assert (folder / build.STAMP).read_text().strip() == build.file_sha256(library)
    assert library.stat().st_size > 64
    caplog.clear()
    later = stand_in(tmp_path)[0]
    monkeypatch.setattr(later, "build", never_build)
    later.load()
    assert later.loaded and loaded[-1] == str(library) and "rebuilding" not in caplog.text


def test_a_cache_root_that_is_a_file_is_one_clear_reason(monkeypatch, tmp_path):
    root = tmp_path / "cache"
    root.write_text("")
    monkeypatch.setenv("DCFORMER_CACHE", str(root))
    library = build.OperatorLibrary(tmp_path / "never_built.cpp")
    (tmp_path / "never_built.cpp").write_text("// not built\n")
    with pytest.raises(RuntimeError, match=rf"the kernel cache {root} \(\$DCFORMER_CACHE\) is a file, not a folder"):
        library.load()


def test_auto_warns_when_the_build_fails_and_computes_eagerly(monkeypatch, tmp_path, caplog):
    """The docs promise a warning when a backend cannot be built; "auto" then gives eager's numbers."""
    source = tmp_path / "broken.cpp"
    source.write_text("this is not C++;\n")
    monkeypatch.setenv("DCFORMER_CACHE", str(tmp_path / "cache"))
    model = build_model(make_config(num_hidden_layers=1, dcmha_implementation="eager"))
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(0))
    logger = logging.getLogger("modeling_dcformer.kernels.dcmha_cpu")
    monkeypatch.setattr(logger, "propagate", True)
    broken = dcmha_cpu.CPUBackend(build.OperatorLibrary(source))
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="modeling_dcformer.kernels.dcmha_cpu"), \
            registered("cpu", broken):
        expected = model(ids).logits
        model.config.dcmha_implementation = "auto"
        assert_close(model(ids).logits, expected)
        model(ids)  # the failure is remembered: one warning, not one per call
    warnings = [r.getMessage() for r in caplog.records if "cannot be built here" in r.getMessage()]
    assert len(warnings) == 1 and 'dcmha_implementation="auto" does without it' in warnings[0]


def test_the_build_key_covers_the_compiler_flags():
    """A backend built with other flags (benchmarks/ab_kernel_source.py's variants) gets its own cache entry; the
    default flags keep the kernel's entry, so existing builds stay valid."""
    source = dcmha_cpu.SOURCE
    default = build.OperatorLibrary(source).folder("c++")
    assert build.OperatorLibrary(source, cflags=build.CFLAGS).folder("c++") == default
    assert build.OperatorLibrary(source, cflags=[*build.CFLAGS, "-DX=1"]).folder("c++") != default
    assert default.name.startswith("dcmha_cpu_")  # the entry of the kernel's earlier builds: they stay valid
