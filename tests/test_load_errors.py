"""Loading that goes wrong ends in one line naming the file or the field, and transformers' attention request on a
config is refused where transformers refuses it: when a model is built.

- A weight file that is empty, truncated, has garbage or a header length past its end, or a header that is not JSON,
  and a shard index that is not JSON, lacks its weight map or names a shard that is not there: one line naming the
  file (transformers' own errors name no file).
- A config.json without `model_type`: `DCFormerForCausalLM.from_pretrained` and the Auto classes with
  `trust_remote_code=True` say which file and what to add. (Without `trust_remote_code`, transformers' AutoConfig
  decides before any of our code runs: a folder with remote code and no model_type makes it ask to run the code.)
- A checkpoint holding none of the model's tensors plus one stray integer tensor: the stray and the missing tensors
  are named, not a "non-floating dtype".
- `config._attn_implementation = "sdpa"` is kept as a request (transformers' common tests do it on every config); the
  model built from that config refuses it, and a DCMHA name set afterwards is accepted.
"""

import json
import os
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from modeling_dcformer import DCFormerConfig, DCFormerForCausalLM

SMALL = dict(
    vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
    max_position_embeddings=64,
)  # fmt: skip


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A saved tiny DCFormer, and the logits it gives: copied by each test before it is damaged."""
    torch.manual_seed(0)
    model = DCFormerForCausalLM(DCFormerConfig(**SMALL)).eval()
    path = tmp_path_factory.mktemp("load_errors") / "saved"
    model.save_pretrained(path, model_card=False)
    return path


def copy_of(saved, tmp_path, name="model"):
    target = tmp_path / name
    shutil.copytree(saved, target)
    return target


def shard(folder):
    """Turns the single weight file into a one-shard checkpoint with an index; returns the index path."""
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    header = load_file(folder / "model-00001-of-00001.safetensors")
    index = {"metadata": {"total_size": 0}, "weight_map": {key: "model-00001-of-00001.safetensors" for key in header}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder / "model.safetensors.index.json"


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def garbage(path):
    path.write_bytes(bytes(range(256)) * 16)


def empty(path):
    path.write_bytes(b"")


def huge_header(path):
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 2**40) + data[8:])


def header_not_json(path):
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    path.write_bytes(data[:8] + b"{" * length + data[8 + length :])


@pytest.mark.parametrize(
    "damage, message",
    [
        (truncate, r"model\.safetensors is truncated: its tensors need \d+ bytes of data but the file holds \d+"),
        (garbage, r"model\.safetensors is not a readable safetensors file: its first 8 bytes announce"),
        (empty, r"model\.safetensors is empty \(0 bytes\)"),
        (huge_header, r"model\.safetensors is not a readable safetensors file: .* 1099511627776-byte header"),
        (header_not_json, r"model\.safetensors is not a readable safetensors file: its header is not JSON"),
    ],
    ids=["truncated", "garbage", "empty", "huge-header", "header-not-json"],
)
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_unreadable_weight_file_is_one_line_naming_it(saved, tmp_path, damage, message, sharded):
    folder = copy_of(saved, tmp_path)
    weights = folder / "model.safetensors"
    if sharded:
        shard(folder)
        weights = folder / "model-00001-of-00001.safetensors"
        message = message.replace(r"model\.safetensors", r"model-00001-of-00001\.safetensors")
    damage(weights)
    for load in (DCFormerForCausalLM.from_pretrained, AutoModelForCausalLM.from_pretrained):
        with pytest.raises(OSError, match=message) as caught:
            load(folder)
        assert str(weights) in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", r"model\.safetensors\.index\.json is not valid JSON"),
        ('{"metadata": {}}', r"model\.safetensors\.index\.json has no \"weight_map\" object"),
        ('{"metadata": {}, "weight_map": {"lm_head.weight": "gone.safetensors"}}', r"names shards that are not in .*: gone\.safetensors"),
        ('{"weight_map": {"lm_head.weight": "model-00001-of-00001.safetensors"}}', r"has no \"metadata\" object"),
    ],
    ids=["not-json", "no-weight-map", "missing-shard", "no-metadata"],
)
def test_corrupt_shard_index_is_one_line_naming_it(saved, tmp_path, content, message):
    folder = copy_of(saved, tmp_path)
    index = shard(folder)
    index.write_text(content)
    with pytest.raises(OSError, match=message) as caught:
        DCFormerForCausalLM.from_pretrained(folder)
    assert str(index) in str(caught.value) and "\n" not in str(caught.value)


def test_intact_checkpoints_still_load_single_and_sharded(saved, tmp_path):
    """The other side of the guards: the same folders, undamaged, load with the saved logits."""
    ids = torch.arange(10).unsqueeze(0)
    with torch.no_grad():
        expected = DCFormerForCausalLM.from_pretrained(saved)(ids).logits
    folder = copy_of(saved, tmp_path)
    shard(folder)
    with torch.no_grad():
        torch.testing.assert_close(DCFormerForCausalLM.from_pretrained(folder)(ids).logits, expected, rtol=0, atol=0)


def test_other_load_errors_are_left_as_they_are(saved, tmp_path):
    """A failure no weight file explains keeps transformers' error (the diagnosis adds nothing false)."""
    folder = copy_of(saved, tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(OSError, match="no file named model.safetensors"):
        DCFormerForCausalLM.from_pretrained(folder)


# ----------------------------------------------------------------------------------------------------------------
# config.json without model_type
# ----------------------------------------------------------------------------------------------------------------
def without_model_type(folder):
    config = json.loads((folder / "config.json").read_text())
    del config["model_type"]
    (folder / "config.json").write_text(json.dumps(config))


def test_config_without_model_type_is_a_clear_error(saved, tmp_path):
    folder = copy_of(saved, tmp_path)
    without_model_type(folder)
    message = rf"{folder / 'config.json'} has no \"model_type\": a DCFormer config says \"model_type\": \"dcformer\""
    with pytest.raises(ValueError, match=message):
        DCFormerForCausalLM.from_pretrained(folder)
    with pytest.raises(ValueError, match=message):
        DCFormerConfig.from_pretrained(folder)
    # the Auto classes with the folder's remote code: the same line, from the copy of our config saved there
    with pytest.raises(ValueError, match=message):
        AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    # without trust_remote_code transformers decides alone (before our code runs): its refusal, never a load
    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=False)


def test_config_with_model_type_and_released_config_without_one_load(saved, tmp_path):
    """The other side: a config with model_type loads; a released config (the authors' key names) may leave it out,
    its type defaulting to "dcpythia"."""
    from released_checkpoint import released_config

    assert DCFormerForCausalLM.from_pretrained(saved).config.model_type == "dcformer"
    folder = tmp_path / "released"
    folder.mkdir()
    cfg = released_config("dcpythia")
    del cfg["model_type"]
    (folder / "config.json").write_text(json.dumps(cfg))
    assert DCFormerConfig.from_pretrained(folder).released_model_type == "dcpythia"


# ----------------------------------------------------------------------------------------------------------------
# A stray integer tensor in place of the model's
# ----------------------------------------------------------------------------------------------------------------
def test_checkpoint_of_one_stray_integer_tensor_names_it_and_the_missing_ones(saved, tmp_path):
    folder = copy_of(saved, tmp_path)
    save_file({"step_counter": torch.arange(3)}, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as caught:
        DCFormerForCausalLM.from_pretrained(folder)
    message = str(caught.value)
    assert "non-floating" not in message, message
    assert "tensors that are not DCFormer's (step_counter)" in message, message
    assert "the checkpoint lacks" in message and "embed_tokens.weight" in message, message


def test_integer_tensor_under_a_dcformer_name_is_still_refused(saved, tmp_path):
    """The other side: an integer tensor where the model has a float one stays "non-floating", here beside the
    stray one."""
    folder = copy_of(saved, tmp_path)
    state = load_file(folder / "model.safetensors")
    state["model.norm.weight"] = state["model.norm.weight"].long()
    state["step_counter"] = torch.arange(3)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"non-floating dtype.*model\.norm\.weight \(I64\)") as caught:
        DCFormerForCausalLM.from_pretrained(folder)
    assert "step_counter" not in str(caught.value)


# ----------------------------------------------------------------------------------------------------------------
# Config._attn_implementation = "sdpa"
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["sdpa", "flash_attention_2", "flex_attention"])
def test_attn_implementation_request_on_a_config_is_refused_when_the_model_is_built(name):
    config = DCFormerConfig(**SMALL)
    config._attn_implementation = name  # what transformers' common model tests do: not an error by itself
    assert config._attn_implementation == name and config.dcmha_implementation == "auto"
    assert "_attn_implementation_internal" not in config.to_dict()  # never written to config.json
    message = f"attn_implementation='{name}' cannot compute DCFormer's attention"
    with pytest.raises(ValueError, match=message):
        DCFormerForCausalLM(config)
    with pytest.raises(ValueError, match=message):
        AutoModelForCausalLM.from_config(config)
    config._attn_implementation = "eager"  # a DCMHA implementation replaces the request
    model = DCFormerForCausalLM(config)
    assert model.config._attn_implementation == model.config.dcmha_implementation == "eager"
    model.config.dcmha_implementation = "cpu"
    assert model.config._attn_implementation == "cpu"  # says what runs
    with pytest.raises(ValueError, match=message):
        model.set_attn_implementation(name)
    assert model.config._attn_implementation == "cpu"


def test_attn_implementation_given_to_the_config_itself_is_still_checked_at_once():
    with pytest.raises(ValueError, match="attn_implementation='sdpa' cannot compute DCFormer's attention"):
        DCFormerConfig(**SMALL, attn_implementation="sdpa")
    assert DCFormerConfig(**SMALL, attn_implementation="eager").dcmha_implementation == "eager"
