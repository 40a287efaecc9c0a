"""The JSON presets in configuration/: every file loads, the released shapes are right, the tiny one runs."""

import glob
import json
import os

import pytest
import torch

from modeling_dcformer import DCFormerConfig, DCFormerForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_DIR = os.path.join(ROOT, "configuration")
PRESETS = sorted(glob.glob(os.path.join(CONFIG_DIR, "*.json")))

EXPECTED_FILES = [
    "dcformer-2.8b.json",
    "dcformer-tiny.json",
    *[f"dcformer-{name}.json" for name in ("llama-3.2-1b", "qwen2.5-0.5b", "qwen3-0.6b", "mistral-7b")],
    "dcpythia-6.9b.json",
    *[f"dcpythia-pythia-{size}.json" for size in ("70m", "160m", "410m", "1b", "1.4b", "2.8b", "6.9b", "12b")],
]

# EleutherAI/pythia-* config.json: (hidden, layers, heads, vocab); intermediate is 4 * hidden.
PYTHIA_SHAPES = {
    "70m": (512, 6, 8, 50304),
    "160m": (768, 12, 12, 50304),
    "410m": (1024, 24, 16, 50304),
    "1b": (2048, 16, 8, 50304),
    "1.4b": (2048, 24, 16, 50304),
    "2.8b": (2560, 32, 32, 50304),
    "6.9b": (4096, 32, 32, 50432),
    "12b": (5120, 36, 40, 50688),
}


def load(name: str) -> DCFormerConfig:
    return DCFormerConfig.from_json_file(os.path.join(CONFIG_DIR, name))


def meta_model(config: DCFormerConfig) -> DCFormerForCausalLM:
    with torch.device("meta"):  # shapes only: no memory, no init time
        return DCFormerForCausalLM(config)


def dcmha_params(layer) -> int:
    proj = layer.self_attn.dyn_w_proj
    return proj.dw1.numel() + proj.qkw.numel() + proj.dd.numel()


def test_every_expected_preset_exists():
    assert sorted(os.path.basename(p) for p in PRESETS) == sorted(EXPECTED_FILES)


@pytest.mark.parametrize("path", PRESETS, ids=os.path.basename)
def test_preset_loads_cleanly(path):
    with open(path) as f:
        raw = json.load(f)
    assert raw["model_type"] == "dcformer"
    assert not [k for k in raw if k.startswith("_")], "presets carry no comment keys"
    config = DCFormerConfig.from_json_file(path)
    assert isinstance(config, DCFormerConfig)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        assert getattr(config, key) == raw[key], key
    rope = raw.get("rope_parameters", raw)  # the transformers dict, or the flat keys of older configs
    assert config.rope_theta == rope["rope_theta"]
    assert config.partial_rotary_factor == rope["partial_rotary_factor"]
    assert len(config.layer_types) == config.num_hidden_layers
    # round trip through transformers' own serialisation
    again = DCFormerConfig.from_dict(config.to_dict())
    assert again.layer_types == config.layer_types
    assert again.rope_parameters == config.rope_parameters


def test_dcpythia_6_9b_released_shape():
    c = load("dcpythia-6.9b.json")
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads) == (4096, 32, 32)
    assert (c.intermediate_size, c.vocab_size, c.max_position_embeddings) == (16384, 50257, 2048)
    assert c.head_dim == 128
    assert c.use_qk_norm and c.use_dcmha and not c.query_wise
    assert c.window_size == 256 and c.window_type is None
    assert c.layer_types == ["sliding_attention", "full_attention"] * 16  # even layers local
    assert c.partial_rotary_factor == 0.25 and c.rope_theta == 10000
    assert c.norm_type == "layernorm" and c.layer_norm_eps == 1e-5
    assert c.use_parallel_residual and not c.use_gated_mlp and c.hidden_act == "gelu"
    assert c.attention_bias and c.mlp_bias and not c.tie_word_embeddings
    assert (c.bos_token_id, c.eos_token_id) == (0, 0)
    assert (c.num_head_groups, c.dynamic_rank, c.dynamic_hidden_size) == (1, 2, 128)


def test_dcpythia_6_9b_dcmha_parameter_count():
    model = meta_model(load("dcpythia-6.9b.json"))
    layer = model.model.layers[0]
    proj = layer.self_attn.dyn_w_proj
    assert tuple(proj.dw1.shape) == (4096, 1, 4, 128)
    assert tuple(proj.qkw.shape) == (1, 4, 128, 4, 32)
    assert tuple(proj.dd.shape) == (4096, 1, 128)
    assert dcmha_params(layer) == 2_686_976  # spec: dw1 + qkw + dd per layer
    assert sum(dcmha_params(l) for l in model.model.layers) == 85_983_232  # spec: in all
    assert layer.self_attn.q_norm.weight.shape == (128,)


def test_dcformer_2_8b_shape():
    c = load("dcformer-2.8b.json")
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.head_dim) == (2560, 32, 32, 80)
    assert (c.intermediate_size, c.vocab_size) == (6912, 50257)
    assert c.norm_type == "rmsnorm" and c.layer_norm_eps == 1e-6
    assert not c.use_parallel_residual and c.use_gated_mlp and c.hidden_act == "silu"
    assert not c.attention_bias and not c.mlp_bias
    assert c.partial_rotary_factor == 1.0 and c.rope_theta == 10000
    assert c.use_qk_norm and c.window_size == 256 and c.window_type == "LG"
    assert c.layer_types == ["sliding_attention", "full_attention"] * 16
    model = meta_model(c)
    mlp = model.model.layers[0].mlp
    assert mlp.gate_proj.weight.shape == (6912, 2560) and mlp.gate_proj.bias is None
    assert model.model.layers[0].self_attn.qkv_proj.bias is None


@pytest.mark.parametrize("size", sorted(PYTHIA_SHAPES))
def test_pythia_shaped_presets(size):
    c = load(f"dcpythia-pythia-{size}.json")
    hidden, layers, heads, vocab = PYTHIA_SHAPES[size]
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.vocab_size) == (hidden, layers, heads, vocab)
    assert c.intermediate_size == 4 * hidden and c.max_position_embeddings == 2048
    assert c.partial_rotary_factor == 0.25 and c.rope_theta == 10000
    assert c.norm_type == "layernorm" and c.layer_norm_eps == 1e-5
    assert c.use_parallel_residual and c.hidden_act == "gelu" and c.attention_bias and c.mlp_bias
    assert not c.tie_word_embeddings and not c.use_qk_norm
    assert c.window_size is None and c.layer_types == ["full_attention"] * layers
    assert (c.bos_token_id, c.eos_token_id) == (0, 0)


def test_pythia_shaped_parameter_count_is_pythia_plus_dcmha():
    # Pythia-160M has 162,322,944 parameters (embed + untied head included); DCMHA adds dw1 + qkw + dd.
    c = load("dcpythia-pythia-160m.json")
    model = meta_model(c)
    total = sum(p.numel() for p in model.parameters())
    extra = sum(dcmha_params(l) for l in model.model.layers)
    D, N = c.hidden_size, c.num_attention_heads
    assert extra == c.num_hidden_layers * (D * 4 * 4 * N + 4 * 4 * N * 4 * N + D * 4 * N)
    assert total - extra == 162_322_944


# The Llama-family presets: the source's config.json fields (Hub `config.json` of each model) as transformers' own
# config class, and the source's parameter count (tied embeddings counted once).
LLAMA_FAMILY = {
    "llama-3.2-1b": ("LlamaConfig", 1_235_814_400, dict(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        intermediate_size=8192, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
        tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "qwen2.5-0.5b": ("Qwen2Config", 494_032_768, dict(
        hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen3-0.6b": ("Qwen3Config", 596_049_920, dict(
        hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        intermediate_size=3072, vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "mistral-7b": ("MistralConfig", 7_241_732_096, dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        intermediate_size=14336, vocab_size=32000, max_position_embeddings=32768, rms_norm_eps=1e-5,
        tie_word_embeddings=False, sliding_window=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}


@pytest.mark.parametrize("name", sorted(LLAMA_FAMILY))
def test_llama_family_presets_are_the_sources_shapes(name):
    import transformers

    config_class, count, fields = LLAMA_FAMILY[name]
    c = load(f"dcformer-{name}.json")
    source = getattr(transformers, config_class)(**fields)
    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(source)
    model = meta_model(c)
    extra = sum(dcmha_params(layer) for layer in model.model.layers)
    total = sum(p.numel() for p in model.parameters())
    assert total - extra == sum(p.numel() for p in reference.parameters()) == count
    head_dim = getattr(source, "head_dim", None) or source.hidden_size // source.num_attention_heads
    assert (c.num_key_value_heads, c.head_dim) == (source.num_key_value_heads, head_dim)
    assert c.layer_norm_eps == source.rms_norm_eps and c.tie_word_embeddings == source.tie_word_embeddings
    assert c.norm_type == "rmsnorm" and not c.use_parallel_residual and c.use_gated_mlp and c.hidden_act == "silu"
    assert c.use_qk_norm == (name == "qwen3-0.6b") and c.use_dcmha
    assert c.window_size == getattr(source, "sliding_window", None) if name == "mistral-7b" else c.window_size is None
    attention = model.model.layers[0].self_attn
    assert (attention.qkv_proj.bias is not None, attention.o_proj.bias is not None) == (name == "qwen2.5-0.5b", False)
    ours = model.model.rotary_emb.__class__(c).inv_freq
    theirs = reference.model.rotary_emb.__class__(source).inv_freq
    torch.testing.assert_close(ours, theirs)  # llama3 scaling included: transformers' rope functions


def test_tiny_preset_builds_and_runs():
    c = load("dcformer-tiny.json")
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads) == (64, 2, 4)
    assert (c.intermediate_size, c.vocab_size, c.max_position_embeddings) == (256, 512, 256)
    assert c.window_size == 16 and c.use_qk_norm
    torch.manual_seed(0)
    model = DCFormerForCausalLM(c).eval()
    ids = torch.randint(0, c.vocab_size, (2, 40))  # longer than the window
    out = model(ids, labels=ids)
    assert out.logits.shape == (2, 40, 512)
    assert torch.isfinite(out.logits).all() and torch.isfinite(out.loss)
    generated = model.generate(ids[:, :5], max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert generated.shape == (2, 9)


def test_from_preset_loads_each_file_by_name():
    names = sorted(os.path.basename(p)[: -len(".json")] for p in PRESETS)
    for name in names:
        by_name = DCFormerConfig.from_preset(name)
        assert by_name.to_dict() == load(f"{name}.json").to_dict(), name


def test_from_preset_overrides_and_derived_fields_follow():
    c = DCFormerConfig.from_preset("dcformer-tiny", window_size=None, num_hidden_layers=3)
    assert c.window_size is None and c.num_hidden_layers == 3 and c.layer_types == ["full_attention"] * 3


def test_from_preset_unknown_name_lists_the_presets():
    with pytest.raises(ValueError) as err:
        DCFormerConfig.from_preset("dcpythia-7b")
    message = str(err.value)
    assert message.startswith("unknown preset 'dcpythia-7b'; the presets are: dcformer-2.8b, dcformer-llama-3.2-1b, ")
    assert "dcpythia-pythia-12b" in message and "\n" not in message


def test_one_resolver_for_names_and_files(tmp_path):
    """modeling_dcformer.configuration resolves presets for every tool (from_preset, dcformer-train --config_name,
    compare_small.py --shape): the names are the files, a name or a file gives the file, anything else is None
    (a directory or Hub id) or, for a `.json` name, an error listing the presets."""
    from modeling_dcformer.configuration import config_file, preset_file, preset_names

    assert preset_names() == sorted(os.path.basename(p)[: -len(".json")] for p in PRESETS)
    for name in preset_names():
        assert config_file(name) == preset_file(name) == config_file(f"{name}.json")
        assert os.path.samefile(preset_file(name), os.path.join(CONFIG_DIR, f"{name}.json"))
    own = tmp_path / "mine.json"
    own.write_text(json.dumps({"model_type": "dcformer"}))
    assert config_file(str(own)) == own
    assert config_file("EleutherAI/pythia-160m") is None and config_file(str(tmp_path)) is None
    with pytest.raises(FileNotFoundError, match="the presets are: dcformer-2.8b"):
        config_file("no-such.json")
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        preset_file("nope")
