"""A load never gives the config of one save with the weights of another. Each save by the package writes a new
`save_id` into config.json and into its shard index's metadata; a reader without the package's lock (a save's remote
code alone, `trust_remote_code=True` where the package is not installed) checks the id of the config it built the
model from against the shard index transformers read and against the folder's config.json before and after the
weights are read (`checkpoint_checks.check_same_save`): a folder saved again meanwhile is one clear error, "load
again", not a model.

Simulated deterministically: the config read, then the folder saved again, then the weights read (what AutoModel
does when a save lands between its two reads), a save landing while the weights are read, and a folder holding the
config of one save and the shards of another. The neighbours that must keep loading: the same save, saves without
ids (older ones, transformers' own), a config saved alone after the model, `subfolder`, quantized and sharded saves;
with the package installed, its reader lock and the config read again.
"""

import json
import os
import shutil
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from helpers import build_model, make_config, run_without_the_package
from modeling_dcformer import DCFormerConfig, DCFormerForCausalLM
from modeling_dcformer.configuration_dcformer import PACKAGE

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

INDEX = "model.safetensors.index.json"
LAYOUTS = {"single": "5GB", "sharded": "150KB"}


def model_of(seed: int, **overrides) -> DCFormerForCausalLM:
    return build_model(make_config(**overrides), seed=seed).eval()


def save(model, folder: Path, layout: str) -> str:
    """`model` saved by the package at `folder` (swapped in whole); returns the save's id."""
    model.save_pretrained(folder, model_card=False, max_shard_size=LAYOUTS[layout])
    assert (folder / INDEX).exists() == (layout == "sharded")
    return json.loads((folder / "config.json").read_text())["save_id"]


def same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def assert_mixed_saves_error(caught, folder: Path, *needles: str) -> None:
    message = str(caught.value)
    assert "\n" not in message, message
    assert message.startswith(f"config.json and the weights come from different saves of {folder}"), message
    for needle in needles:
        assert needle in message, (needle, message)


@pytest.fixture
def remote_code(monkeypatch):
    """`from_pretrained` as a save's remote code alone runs it: no `PACKAGE.loading` (no reader lock, no config read
    again), transformers' own load with the flat modules' checks."""
    monkeypatch.setattr(PACKAGE, "loading", None)


@pytest.fixture(params=["package", "remote-code"])
def reader(request, monkeypatch):
    if request.param == "remote-code":
        monkeypatch.setattr(PACKAGE, "loading", None)
    return request.param


# ----------------------------------------------------------------------------------------------------------------
# What a save writes
# ----------------------------------------------------------------------------------------------------------------
def test_each_save_writes_one_new_id_into_its_config_and_its_shard_index(tmp_path):
    model = model_of(0)
    first = save(model, tmp_path / "m", "sharded")
    index = json.loads((tmp_path / "m" / INDEX).read_text())
    assert index["metadata"]["save_id"] == first and index["metadata"]["total_size"] > 0
    assert model.config.save_id == first  # the model's config is the one saved last
    second = save(model, tmp_path / "m", "sharded")
    assert second != first and json.loads((tmp_path / "m" / INDEX).read_text())["metadata"]["save_id"] == second


# ----------------------------------------------------------------------------------------------------------------
# The remote code alone: a mixed load is an error
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_config_read_before_a_new_save_with_its_weights_is_an_error(tmp_path, layout, remote_code):
    """AutoModel reads config.json, then (imports later) the weights: a save between the two."""
    folder = tmp_path / "m"
    old = save(model_of(0), folder, layout)
    config = DCFormerConfig.from_pretrained(folder)
    new = save(model_of(1), folder, layout)
    for load in (DCFormerForCausalLM.from_pretrained, AutoModelForCausalLM.from_pretrained):
        with pytest.raises(OSError) as caught:
            load(folder, config=config)
        assert_mixed_saves_error(caught, folder, old, new, "load again", "save_id to None")
    assert same_weights(DCFormerForCausalLM.from_pretrained(folder), model_of(1))  # loading again reads one save
    config.save_id = None  # a config of another save, given on purpose
    assert same_weights(DCFormerForCausalLM.from_pretrained(folder, config=config), model_of(1))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_save_landing_while_the_weights_are_read_is_an_error(tmp_path, layout, remote_code, monkeypatch):
    folder, next_save = tmp_path / "m", tmp_path / "next"
    save(model_of(0), folder, layout)
    save(model_of(1), next_save, layout)
    read = PreTrainedModel._load_pretrained_model

    def read_then_save(*args, **kwargs):  # the weights read, then the folder replaced (as a save swaps it in)
        loaded = read(*args, **kwargs)
        os.rename(folder, tmp_path / "replaced")
        os.rename(next_save, folder)
        return loaded

    monkeypatch.setattr(PreTrainedModel, "_load_pretrained_model", staticmethod(read_then_save))
    with pytest.raises(OSError) as caught:
        DCFormerForCausalLM.from_pretrained(folder)
    assert_mixed_saves_error(caught, folder, "load again")


def test_a_folder_holding_the_config_of_one_save_and_the_shards_of_another_is_an_error(tmp_path, reader):
    folder, other = tmp_path / "m", tmp_path / "other"
    old = save(model_of(0), folder, "sharded")
    new = save(model_of(1), other, "sharded")
    for shard in folder.glob("model*.safetensors*"):
        shard.unlink()
    for shard in other.glob("model*.safetensors*"):  # the index and shards of the other save, its config left
        shutil.copy2(shard, folder / shard.name)
    with pytest.raises(OSError) as caught:
        DCFormerForCausalLM.from_pretrained(folder)
    assert_mixed_saves_error(caught, folder, old, new, "shard index")


def test_a_subfolder_saved_again_after_its_config_was_read_is_an_error(tmp_path, remote_code):
    root = tmp_path / "repo"
    old = save(model_of(0), root / "sub", "single")
    config = DCFormerConfig.from_pretrained(root, subfolder="sub")
    save(model_of(1), root / "sub", "single")
    with pytest.raises(OSError) as caught:
        DCFormerForCausalLM.from_pretrained(root, subfolder="sub", config=config)
    assert_mixed_saves_error(caught, root / "sub", old)


# ----------------------------------------------------------------------------------------------------------------
# The neighbours: one save loads, however it is read
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_save_loads_with_or_without_its_config_given(tmp_path, layout, reader):
    folder, model = tmp_path / "m", model_of(0)
    save(model, folder, layout)
    assert same_weights(DCFormerForCausalLM.from_pretrained(folder), model)
    config = DCFormerConfig.from_pretrained(folder)
    assert same_weights(AutoModelForCausalLM.from_pretrained(folder, config=config), model)
    assert same_weights(DCFormerForCausalLM.from_pretrained(tmp_path, subfolder="m"), model)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_saves_without_ids_load(tmp_path, layout, reader):
    """Older saves: no id anywhere, or (the package before the index carried it) in config.json only."""
    folder, model = tmp_path / "m", model_of(0)
    save(model, folder, layout)
    if layout == "sharded":
        index = json.loads((folder / INDEX).read_text())
        index["metadata"].pop("save_id", None)  # (absent where the package wrote it into config.json only)
        (folder / INDEX).write_text(json.dumps(index))
    assert same_weights(DCFormerForCausalLM.from_pretrained(folder), model)
    config = json.loads((folder / "config.json").read_text())
    del config["save_id"]
    (folder / "config.json").write_text(json.dumps(config))
    assert same_weights(DCFormerForCausalLM.from_pretrained(folder), model)


def test_a_config_saved_alone_after_the_model_still_loads(tmp_path, reader):
    """A model loaded from one save, saved elsewhere, then its config saved beside it (generation settings, say)."""
    save(model_of(0), tmp_path / "m", "single")
    model = DCFormerForCausalLM.from_pretrained(tmp_path / "m")
    save(model, tmp_path / "again", "sharded")
    model.config.save_pretrained(tmp_path / "again")
    assert same_weights(DCFormerForCausalLM.from_pretrained(tmp_path / "again"), model)


def test_the_package_reads_the_new_config_of_a_folder_saved_again(tmp_path):
    """With the package installed a config read before a save is read again (its reader lock keeps the rest one save):
    the new save loads, whole."""
    folder = tmp_path / "m"
    save(model_of(0), folder, "sharded")
    config = DCFormerConfig.from_pretrained(folder)
    new = save(model_of(1), folder, "sharded")
    model = AutoModelForCausalLM.from_pretrained(folder, config=config)
    assert model.config.save_id == new and same_weights(model, model_of(1))


def test_a_conversion_is_a_save_too(tmp_path, monkeypatch):
    """A converter's output carries a new id in its config and shard index; converted again (--overwrite) while a
    reader without the package had read the first config, the reader's load is refused."""
    from modeling_dcformer.conversion import released as released_converter
    from released_checkpoint import released_dir

    src, out = released_dir(tmp_path, "src")[0], tmp_path / "out"
    assert released_converter.main([str(src), str(out), "--max-shard-size", "40KB"]) == 0
    first = json.loads((out / "config.json").read_text())["save_id"]
    assert json.loads((out / INDEX).read_text())["metadata"]["save_id"] == first
    config = DCFormerConfig.from_pretrained(out)
    assert released_converter.main([str(src), str(out), "--max-shard-size", "40KB", "--overwrite"]) == 0
    monkeypatch.setattr(PACKAGE, "loading", None)
    with pytest.raises(OSError) as caught:
        DCFormerForCausalLM.from_pretrained(out, config=config)
    assert_mixed_saves_error(caught, out, first, "load again")
    assert DCFormerForCausalLM.from_pretrained(out).config.save_id != first


QUANTIZERS = ["torchao-int8", "bnb-8bit"]


def quantization(method: str):
    from transformers import BitsAndBytesConfig, TorchAoConfig

    try:
        if method == "bnb-8bit":
            import bitsandbytes  # noqa: F401

            return BitsAndBytesConfig(load_in_8bit=True)
        from torchao.quantization import Int8WeightOnlyConfig

        return TorchAoConfig(Int8WeightOnlyConfig())
    except Exception as err:  # noqa: BLE001 - an import error of any kind: the library is not usable here
        pytest.skip(f"{method} is not usable here ({type(err).__name__}: {err})")


@pytest.mark.parametrize("method", QUANTIZERS)
def test_quantized_sharded_saves_load_and_a_mixed_one_is_refused(tmp_path, method, reader):
    model_of(0, hidden_size=64, intermediate_size=128).save_pretrained(tmp_path / "fp32", model_card=False)
    quantized = DCFormerForCausalLM.from_pretrained(tmp_path / "fp32", quantization_config=quantization(method))
    old = save(quantized, tmp_path / "q", "sharded")
    ids = torch.randint(0, quantized.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = quantized(ids).logits
        assert torch.equal(DCFormerForCausalLM.from_pretrained(tmp_path / "q")(ids).logits, expected)
    if reader == "remote-code":
        config = DCFormerConfig.from_pretrained(tmp_path / "q")
        save(quantized, tmp_path / "q", "sharded")
        with pytest.raises(OSError) as caught:
            DCFormerForCausalLM.from_pretrained(tmp_path / "q", config=config)
        assert_mixed_saves_error(caught, tmp_path / "q", old)


# ----------------------------------------------------------------------------------------------------------------
# The real thing: a Python without the package, the save's remote code
# ----------------------------------------------------------------------------------------------------------------
REMOTE_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.set_num_threads(1)
    root, report = Path(sys.argv[1]), {}
    for layout in ("single", "sharded"):
        folder = root / layout
        config = AutoConfig.from_pretrained(folder, trust_remote_code=True)  # AutoModel's first read
        os.rename(folder, root / f"{layout}-replaced")  # a save by the package swaps the folder in whole
        os.rename(root / f"{layout}-next", folder)
        try:
            AutoModelForCausalLM.from_pretrained(folder, config=config, trust_remote_code=True)
            report[layout] = "loaded"
        except Exception as err:
            report[layout] = f"{type(err).__name__}: {err}"
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)  # loading again
        report[layout + "-again"] = [type(model).__module__, model.config.save_id]
        torch.save(model.state_dict(), root / f"{layout}-again.pt")
    (root / "report.json").write_text(json.dumps(report))
    """
)


def test_remote_code_without_the_package_refuses_a_mixed_load_and_loads_again(tmp_path):
    for layout in LAYOUTS:
        save(model_of(0), tmp_path / layout, layout)
        save(model_of(1), tmp_path / f"{layout}-next", layout)
    run_without_the_package(REMOTE_SCRIPT, tmp_path, tmp_path)
    report = json.loads((tmp_path / "report.json").read_text())
    expected = model_of(1).state_dict()
    for layout in LAYOUTS:
        folder = tmp_path / layout
        message = report[layout]
        assert message.startswith(f"OSError: config.json and the weights come from different saves of {folder}"), (
            message)
        assert "load again" in message and "\n" not in message
        module, save_id = report[layout + "-again"]
        assert module.startswith("transformers_modules.")  # the remote code, not the package
        assert save_id == json.loads((folder / "config.json").read_text())["save_id"]
        state = torch.load(tmp_path / f"{layout}-again.pt")
        assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in state)
