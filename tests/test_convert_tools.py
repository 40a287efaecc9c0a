"""The converters as tools: they run as files as well as through their console scripts; they record a provenance a
reader can use (never an absolute local path) and the fingerprint of the weights they wrote; they write through a
symbolically linked destination; they refuse, before any work, a destination that cannot be replaced safely; and
every bad input or failed write is one line naming the file, with nothing half-written left. Both are the one
skeleton (`modeling_dcformer.conversion.converter`) filled in: a converter made of its two required hooks gets all of
the above.

Every checkpoint is built here (tiny GPT-NeoX and released-layout ones); nothing is downloaded.
"""

import errno
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import modeling_dcformer  # noqa: F401  (registers the Auto classes)
from modeling_dcformer import DCFormerConfig, DCFormerForCausalLM
from modeling_dcformer.conversion import common
from modeling_dcformer.conversion.converter import ConversionOptions, Converter, UnknownTensor, flag
from modeling_dcformer.conversion import released as released_converter
from modeling_dcformer.conversion import pythia as p2d
from helpers import build_model, help_options, in_process_help_options, make_config, save_tiny_neox
from released_checkpoint import released_dir

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

ROOT = Path(__file__).resolve().parent.parent
PROGRESS = re.compile(r"^(Converting|Converting shards|Loading weights|Writing model shards)\b.*\[")
TOOLS = {"pythia": (p2d, "pythia.py", "dcformer-convert-pythia"),
         "released": (released_converter, "released.py", "dcformer-convert-released")}  # fmt: skip


@pytest.fixture
def neox(tmp_path):
    save_tiny_neox(tmp_path / "neox")
    return tmp_path / "neox"


@pytest.fixture
def released(tmp_path):
    return released_dir(tmp_path, "src")[0]


def source_of(tool, neox, released) -> Path:
    return neox if tool == "pythia" else released


def argv(tool, src, dst, *extra) -> list[str]:
    """A fast command line: the GPT-NeoX converter without its verification."""
    return [str(src), str(dst), *(["--no-verify"] if tool == "pythia" else []), *extra]


def run_main(tool, args, capsys) -> tuple[int, str]:
    code = TOOLS[tool][0].main([str(a) for a in args])
    return code, capsys.readouterr().err


def tree(path: Path) -> dict[str, bytes]:
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


def hidden(folder: Path) -> list[str]:
    """Hidden entries (partial outputs, locks, replaced copies) a run left in `folder`."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


# What importing transformers prints where torchao (the `test` extra, for quantization) is installed: its CUDA-only
# libraries failing to load and torch's deprecation notes on its enums. Not ours, and not an error of the tool.
TORCHAO_IMPORT_NOISE = re.compile(r"^(Failed to load .*torchao/|W\d{4} .*_pytree\.py:\d+\] )")


def assert_one_line(err: str, *needles: str) -> None:
    """The error is one line (progress bars and torchao's import notes aside) holding every needle; no traceback."""
    lines = [line for line in err.replace("\r", "\n").splitlines()
             if line.strip() and not PROGRESS.match(line) and not TORCHAO_IMPORT_NOISE.match(line)]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, err)


# ----------------------------------------------------------------------------------------------------------------
# `python conversion/X.py` runs, from any directory, like its console script
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tool", list(TOOLS))
def test_converter_runs_as_a_file_and_as_its_console_script(tool, tmp_path, capsys):
    """From another directory, with the installed package only (no sys.path edit anywhere): on main the file form
    failed with "attempted relative import with no known parent package". The console scripts' `--help` is checked
    on the installed wheel (`make check-wheel`: test_wheel.py::test_console_script_help); here the file form's help
    has the console script's options."""
    module, script, command = TOOLS[tool]
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the installed package only: no path of the checkout
    args = [sys.executable, str(ROOT / "conversion" / script), "--help"]
    result = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith(f"usage: {script}") and "--overwrite" in result.stdout, result.stdout[:500]
    options = help_options(result.stdout)
    assert options == in_process_help_options(module.main, capsys) and "--overwrite" in options


# ----------------------------------------------------------------------------------------------------------------
# Provenance a reader can use; the fingerprint of the converted weights
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tool", list(TOOLS))
def test_local_source_is_recorded_by_its_folder_name_only(tool, neox, released, tmp_path, capsys):
    src = source_of(tool, neox, released)
    code, err = run_main(tool, argv(tool, src, tmp_path / "out"), capsys)
    assert code == 0, err
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["converted_from"] is None and config["converted_from_folder"] == src.name
    for name in ("config.json", "README.md"):  # what an upload publishes
        assert str(tmp_path) not in (tmp_path / "out" / name).read_text(), name


@pytest.mark.parametrize("tool", list(TOOLS))
def test_card_of_a_local_source_links_no_hub_repo(tool, neox, released, tmp_path, capsys):
    """Only true statements: a local folder's name is shown as local, never as a Hub repository or base_model."""
    src = source_of(tool, neox, released)
    code, err = run_main(tool, argv(tool, src, tmp_path / "out"), capsys)
    assert code == 0, err
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"`{src.name}` (local)" in card and f"huggingface.co/{src.name}" not in card
    assert "base_model" not in card.split("---")[1]


@pytest.mark.parametrize("tool", list(TOOLS))
def test_hub_cache_source_is_recorded_as_its_hub_id_and_commit(tool, neox, released, tmp_path, capsys):
    """A folder of the Hub cache (what `hf download` leaves) is recorded as the Hub id and the commit it holds."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = tmp_path / "hub" / "models--SomeOrg--tiny-model" / "snapshots" / commit
    snapshot.parent.mkdir(parents=True)
    source_of(tool, neox, released).rename(snapshot)
    code, err = run_main(tool, argv(tool, snapshot, tmp_path / "out"), capsys)
    assert code == 0, err
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["converted_from"] == "SomeOrg/tiny-model" and config["converted_from_commit"] == commit
    assert config["converted_from_folder"] is None
    assert str(tmp_path) not in (tmp_path / "out" / "config.json").read_text()


def test_provenance_of_a_hub_id_source(tmp_path):
    """A Hub id given as the source (downloaded into the cache) keeps the id, the revision asked and the commit."""
    commit = "89abcdef0123456789abcdef0123456789abcdef"
    snapshot = tmp_path / "models--EleutherAI--pythia-70m" / "snapshots" / commit
    snapshot.mkdir(parents=True)
    record = common.source_provenance("EleutherAI/pythia-70m", snapshot, "step1000")
    assert record == {"converted_from": "EleutherAI/pythia-70m", "converted_from_folder": None,
                      "converted_from_revision": "step1000", "converted_from_commit": commit}  # fmt: skip
    local = common.source_provenance(".", tmp_path)  # "." is recorded by the folder's own name
    assert local["converted_from"] is None and local["converted_from_folder"] == tmp_path.name


@pytest.mark.parametrize("tool, dtype", [("pythia", None), ("released", None), ("released", "bfloat16")])
def test_fingerprint_tells_converted_weights_from_fine_tuned_ones(tool, dtype, neox, released, tmp_path, capsys):
    """`conversion.weights` is the fingerprint (`model_fingerprint`) of the weights the conversion wrote: equal
    for the loaded model, different once a training step changed it (what a card needs before it says the model
    computes the source's function)."""
    from modeling_dcformer.checkpoints.fingerprint import model_fingerprint

    cast = ["--dtype", dtype] if dtype else []
    code, err = run_main(tool, argv(tool, source_of(tool, neox, released), tmp_path / "out", *cast), capsys)
    assert code == 0, err
    model = DCFormerForCausalLM.from_pretrained(tmp_path / "out")
    assert model.dtype == getattr(torch, dtype or "float32")
    recorded = model.config.conversion["weights"]
    assert recorded.startswith("sha256:") and recorded == model_fingerprint(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    model(torch.tensor([[1, 2, 3, 4]]), labels=torch.tensor([[1, 2, 3, 4]])).loss.backward()
    optimizer.step()
    assert model_fingerprint(model) != recorded


# ----------------------------------------------------------------------------------------------------------------
# Symbolically linked destinations; destinations that cannot be replaced
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tool", list(TOOLS))
def test_overwrite_through_a_symlink_writes_the_folder_it_names(tool, neox, released, tmp_path, capsys):
    src = source_of(tool, neox, released)
    real, link = tmp_path / "store" / "real", tmp_path / "links" / "alias"
    real.mkdir(parents=True)
    link.parent.mkdir()
    (real / "old.txt").write_text("the old output")
    link.symlink_to(real)
    code, err = run_main(tool, argv(tool, src, link, "--overwrite"), capsys)
    assert code == 0, err
    assert link.is_symlink() and os.readlink(link) == str(real)  # the link stays a link...
    assert (real / "model.safetensors").is_file() and not (real / "old.txt").exists()  # ...its folder is new
    assert hidden(link.parent) == [] and hidden(real.parent) == []  # no .alias.partial-* / .real.* left


@pytest.mark.parametrize("tool", list(TOOLS))
def test_symlink_to_an_empty_folder_is_accepted(tool, neox, released, tmp_path, capsys):
    real, link = tmp_path / "empty", tmp_path / "alias"
    real.mkdir()
    link.symlink_to(real)
    code, err = run_main(tool, argv(tool, source_of(tool, neox, released), link), capsys)
    assert code == 0, err
    assert link.is_symlink() and (real / "model.safetensors").is_file() and hidden(tmp_path) == []


def test_dangling_symlink_gets_the_folder_it_names(neox, tmp_path, capsys):
    real, link = tmp_path / "later" / "real", tmp_path / "alias"
    link.symlink_to(real)  # names a folder that does not exist yet
    code, err = run_main("pythia", argv("pythia", neox, link), capsys)
    assert code == 0, err
    assert link.is_symlink() and (real / "model.safetensors").is_file() and hidden(real.parent) == []


@pytest.mark.parametrize("tool", list(TOOLS))
def test_symlink_to_a_full_folder_is_refused_before_converting(tool, neox, released, tmp_path, capsys, monkeypatch):
    real, link = tmp_path / "full", tmp_path / "alias"
    real.mkdir()
    (real / "mine.txt").write_text("keep me")
    link.symlink_to(real)
    monkeypatch.setattr(common.ShardWriter, "add", lambda *a: pytest.fail("converted before refusing"))
    code, err = run_main(tool, argv(tool, source_of(tool, neox, released), link), capsys)
    assert code == 2
    assert_one_line(err, "not empty", "--overwrite")
    assert tree(real) == {"mine.txt": b"keep me"} and link.is_symlink() and hidden(tmp_path) == []


@pytest.mark.parametrize("dst", ["..", "."])
def test_destination_holding_the_working_directory_is_refused_at_once(dst, neox, tmp_path, capsys, monkeypatch):
    """`--overwrite ..` / `.` from inside: one line naming the path, before any work, nothing changed."""
    work = tmp_path / "projects" / "work"  # (".." holds the working directory, not the source)
    work.mkdir(parents=True)
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    before = tree(tmp_path)
    monkeypatch.setattr(common.ShardWriter, "add", lambda *a: pytest.fail("converted before refusing"))
    code, err = run_main("pythia", argv("pythia", neox, dst, "--overwrite"), capsys)
    assert code == 2
    assert_one_line(err, f"destination {dst} ", "current directory")
    assert tree(tmp_path) == before and hidden(tmp_path) == [] and Path.cwd() == work


@pytest.mark.parametrize("dst", ["../sibling", "out"])
def test_destination_beside_or_under_the_working_directory_is_accepted(dst, neox, tmp_path, capsys, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    code, err = run_main("pythia", argv("pythia", neox, dst), capsys)
    assert code == 0, err
    assert (work / dst / "model.safetensors").is_file() and hidden(work.parent) == [] and hidden(work) == []


def test_mount_point_destination_is_refused_at_once(neox, tmp_path, capsys, monkeypatch):
    dst = tmp_path / "mnt"
    dst.mkdir()
    real_ismount = os.path.ismount
    monkeypatch.setattr(common.os.path, "ismount", lambda p: Path(p) == dst or real_ismount(p))
    code, err = run_main("pythia", argv("pythia", neox, dst, "--overwrite"), capsys)
    assert code == 2
    assert_one_line(err, str(dst), "mount point")


# ----------------------------------------------------------------------------------------------------------------
# A failed write, a truncated source, a config that is not JSON: one line naming the file
# ----------------------------------------------------------------------------------------------------------------
def disk_full(*args, **kwargs):
    """A full disk while a shard is written (`common.append_file`: its data after its header)."""
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("tool", list(TOOLS))
@pytest.mark.parametrize("where", ["shard", "config"])
def test_disk_full_is_one_line_and_leaves_nothing(tool, where, neox, released, tmp_path, capsys, monkeypatch):
    dst = tmp_path / "out"
    if where == "shard":
        monkeypatch.setattr(common, "append_file", disk_full)
    else:  # after the weights: the config write fails as Python's own OSError (no file name in it)
        def no_space(self, *args, **kwargs):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(DCFormerConfig, "save_pretrained", no_space)
    code, err = run_main(tool, argv(tool, source_of(tool, neox, released), dst), capsys)
    assert code == 2
    assert_one_line(err, "No space left on device", f"{dst} was left as it was")
    if where == "shard":
        assert "shard-00000" in err  # the file whose write failed
    assert not dst.exists() and hidden(tmp_path) == []


def test_disk_full_under_overwrite_keeps_the_old_output(neox, tmp_path, capsys, monkeypatch):
    dst = tmp_path / "out"
    assert run_main("pythia", argv("pythia", neox, dst), capsys)[0] == 0
    before = tree(dst)
    monkeypatch.setattr(common, "append_file", disk_full)
    code, err = run_main("pythia", argv("pythia", neox, dst, "--overwrite"), capsys)
    assert code == 2
    assert_one_line(err, "No space left on device", str(dst))
    assert tree(dst) == before and hidden(tmp_path) == []


def test_a_real_failed_write_is_one_line(released, tmp_path):
    """The real safetensors writer failing (a file-size limit stands for a full disk: no root or tmpfs needed)."""
    dst = tmp_path / "out"
    driver = (
        "import resource, signal, sys\n"
        "from modeling_dcformer.conversion import released as released_converter\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
        f"sys.exit(released_converter.main([{str(released)!r}, {str(dst)!r}]))\n"
    )
    result = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert_one_line(result.stderr, str(dst))
    assert "File too large" in result.stderr and not dst.exists() and hidden(tmp_path) == []


@pytest.mark.parametrize("tool", list(TOOLS))
@pytest.mark.parametrize("cut", ["header", "data"])
def test_truncated_source_weights_are_one_line_naming_the_file(tool, cut, neox, released, tmp_path, capsys):
    src = source_of(tool, neox, released)
    (weights,) = src.glob("*.safetensors")
    data = weights.read_bytes()
    weights.write_bytes(data[:6] if cut == "header" else data[: len(data) // 2])
    code, err = run_main(tool, argv(tool, src, tmp_path / "out"), capsys)
    assert code == 2
    assert_one_line(err, str(weights), "truncated or corrupt")
    assert not (tmp_path / "out").exists() and hidden(tmp_path) == []


def test_garbage_torch_weights_are_one_line_naming_the_file(neox, tmp_path, capsys):
    for weights in neox.glob("*.safetensors"):
        weights.unlink()
    (neox / "pytorch_model.bin").write_bytes(b"\x00not a torch file" * 8)
    code, err = run_main("pythia", argv("pythia", neox, tmp_path / "out"), capsys)
    assert code == 2
    assert_one_line(err, str(neox / "pytorch_model.bin"), "truncated or corrupt")


@pytest.mark.parametrize("tool", list(TOOLS))
@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_json_that_is_not_json_is_one_line_naming_the_file(tool, name, neox, released, tmp_path, capsys):
    src = source_of(tool, neox, released)
    (src / name).write_text('{"model_type": "gpt_neox", "hidden_size": 24,')  # cut short by a hand edit
    code, err = run_main(tool, argv(tool, src, tmp_path / "out"), capsys)
    assert code == 2
    assert_one_line(err, str(src / name), "not valid JSON")
    assert not (tmp_path / "out").exists()


def test_valid_index_is_read(neox, tmp_path, capsys):
    """The neighbour of the corrupt index: a real one (two shards) converts."""
    from safetensors.torch import load_file, save_file

    (weights,) = neox.glob("*.safetensors")
    state = load_file(weights)
    weights.unlink()
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}  # fmt: skip
    for name, names in shards.items():
        save_file({k: state[k] for k in names}, neox / name, metadata={"format": "pt"})
    weight_map = {key: name for name, names in shards.items() for key in names}
    (neox / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    code, err = run_main("pythia", argv("pythia", neox, tmp_path / "out"), capsys)
    assert code == 0, err


def test_fingerprint_of_a_mixed_dtype_checkpoint(tmp_path):
    """Tensors stored in another dtype than the config's load cast to it: the fingerprint hashes them so cast."""
    from safetensors.torch import save_file

    from modeling_dcformer.checkpoints.fingerprint import checkpoint_fingerprint, model_fingerprint

    config = DCFormerConfig(vocab_size=64, hidden_size=24, num_hidden_layers=1, num_attention_heads=3,
                            intermediate_size=48, tie_word_embeddings=True, dtype="float32")  # fmt: skip
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in DCFormerForCausalLM(config).state_dict().items() if k != "lm_head.weight"}
    state["model.norm.weight"] = torch.randn(24).to(torch.float16)  # one tensor kept in half precision
    (tmp_path / "m").mkdir()
    save_file(state, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(tmp_path / "m")
    model = DCFormerForCausalLM.from_pretrained(tmp_path / "m")
    assert model.dtype == torch.float32
    assert checkpoint_fingerprint(tmp_path / "m", config) == model_fingerprint(model)


def test_output_mode_follows_the_umask_and_an_existing_folders_mode(neox, tmp_path, capsys):
    """Through the converters: not the 0700 of a temporary folder."""
    dst = tmp_path / "out"
    old_umask = os.umask(0o022)
    try:
        assert run_main("pythia", argv("pythia", neox, dst), capsys)[0] == 0
        assert dst.stat().st_mode & 0o7777 == 0o755
        os.chmod(dst, 0o2775)  # a shared folder
        assert run_main("pythia", argv("pythia", neox, dst, "--overwrite"), capsys)[0] == 0
        assert dst.stat().st_mode & 0o7777 == 0o2775
    finally:
        os.umask(old_umask)


# ----------------------------------------------------------------------------------------------------------------
# The skeleton: a converter is its hooks
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class ResaveOptions(ConversionOptions):
    strict: bool = flag(False, "--strict", action="store_true", help="refuse a source with extra tensors")


class Resave(Converter):
    """The smallest converter: our own layout re-saved, with only the required hooks (and one option of its own)."""

    tool = "dcformer-convert-test"
    options_class = ResaveOptions

    def make_config(self, raw):
        if raw.get("model_type") != "dcformer":
            raise ValueError(f"{self.src}: model_type {raw.get('model_type')!r} is not 'dcformer'")
        return DCFormerConfig.from_dict(raw)

    def map_tensor(self, key, tensor):
        if key.startswith("extra.") and self.options.strict:
            raise UnknownTensor(f"{key!r} is not a tensor of this model")
        return [] if key.startswith("extra.") else [(key, tensor)]


@pytest.fixture
def native(tmp_path):
    """A saved DCFormer (our layout) and its model."""
    model = build_model(make_config(num_hidden_layers=2))
    model.save_pretrained(tmp_path / "native")
    return tmp_path / "native", model


def test_a_converter_is_its_hooks(native, tmp_path, capsys):
    """Two hooks filled in: the command line (common flags and its own), the streamed and checked weights, the cast,
    provenance, fingerprint, remote code and card, the one-line errors."""
    from safetensors.torch import load_file, save_file

    from modeling_dcformer.checkpoints.fingerprint import model_fingerprint

    src, model = native
    assert {"--overwrite", "--dtype", "--max-shard-size", "--revision", "--push-to-hub", "--private", "--token",
            "--license", "--strict"} <= in_process_help_options(Resave.main, capsys)  # fmt: skip
    dst = tmp_path / "out"
    assert Resave.main([str(src), str(dst), "--dtype", "bf16"]) == 0, capsys.readouterr().err
    assert f"Converted {src} -> {dst} (" in capsys.readouterr().out
    resaved = DCFormerForCausalLM.from_pretrained(dst)
    assert resaved.dtype == torch.bfloat16
    assert (dst / "README.md").is_file() and (dst / "modeling_dcformer.py").is_file()
    for key, tensor in model.state_dict().items():
        assert torch.equal(resaved.state_dict()[key], tensor.to(torch.bfloat16)), key
    config = resaved.config
    assert config.converted_from_folder == "native" and config.architectures == ["DCFormerForCausalLM"]
    assert config.conversion == {"tool": "dcformer-convert-test", "weights": model_fingerprint(resaved)}

    state = load_file(src / "model.safetensors")
    save_file({**state, "extra.buffer": torch.ones(3)}, src / "model.safetensors", metadata={"format": "pt"})
    assert Resave.main([str(src), str(tmp_path / "lenient")]) == 0  # dropped by `map_tensor`
    for argv, needles in (
        ([str(src), str(tmp_path / "x"), "--strict"], ["model.safetensors: 'extra.buffer' is not a tensor of this"]),
        ([str(src), str(tmp_path / "x"), "--revision", "main"], ["--revision applies to Hub ids only"]),
        ([str(src), str(tmp_path / "x"), "--max-shard-size", "lots"], ["cannot read the size 'lots'"]),
    ):
        capsys.readouterr()
        assert Resave.main(argv) == 2
        assert_one_line(capsys.readouterr().err, *needles)
    save_file({k: v for k, v in state.items() if k != "model.norm.weight"}, src / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    with pytest.raises(ValueError, match=r"lacks tensors the model needs: \['model\.norm\.weight'\]"):
        Resave.convert(str(src), str(tmp_path / "x"))
    assert not (tmp_path / "x").exists() and hidden(tmp_path) == []


def test_a_tensor_written_twice_or_of_the_wrong_shape_is_refused(native, tmp_path):
    src, _ = native

    class Twice(Resave):
        def map_tensor(self, key, tensor):
            return [(key, tensor), (key, tensor)]

    class Transposed(Resave):
        def map_tensor(self, key, tensor):
            return [(key, tensor.T if key == "model.embed_tokens.weight" else tensor)]

    with pytest.raises(ValueError, match=r"appears twice in the checkpoint"):
        Twice.convert(str(src), str(tmp_path / "x"))
    with pytest.raises(ValueError, match=r"embed_tokens\.weight: checkpoint shape \(32, 64\) vs model shape \(64, "):
        Transposed.convert(str(src), str(tmp_path / "x"))
    assert not (tmp_path / "x").exists() and hidden(tmp_path) == []


def test_released_revision_of_a_local_folder_is_refused(released, tmp_path, capsys):
    """`--revision` names a revision on the Hub: with a local folder it would be ignored, so it is an error."""
    code, err = run_main("released", [released, tmp_path / "out", "--revision", "main"], capsys)
    assert code == 2
    assert_one_line(err, "--revision applies to Hub ids only", str(released))
