"""modeling_dcformer.conversion.llama (`dcformer-convert-llama`, from conversion/) on tiny random Llama, Qwen2, Qwen3
and Mistral checkpoints built here with transformers (GQA, llama3 rope scaling, tied embeddings, q/k/v biases without
an o bias, qk-norm with an explicit head_dim, sliding windows shorter than the test sequences): the converted model
computes the source's function (forward, cached greedy generation, left padding, every DCMHA backend that runs here),
every DCMHA weight gets a gradient at step 0 and moves, the output loads natively and as remote code alone, and a
bad source is one line with the destination untouched."""

import json
import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import modeling_dcformer  # noqa: F401  (registers "dcformer" with the Auto classes)
from modeling_dcformer import DCFormerForCausalLM
from modeling_dcformer.conversion import llama as l2d
from modeling_dcformer.dcmha import DCMHA_BACKENDS, DCMHAInputs
from helpers import run_without_the_package
from test_convert_tools import assert_one_line, tree

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

VOCAB, PAD = 320, 0
BODY = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=PAD)
# Each family as it has them: GQA everywhere (4 query heads, 2 key/value heads); Llama with llama3 rope scaling, tied
# embeddings and its one attention_bias flag (on all four projections) and mlp_bias; Qwen2 with biases on q, k, v but
# not o, tied; Qwen3 with qk-norm, head_dim 24 != 64 / 4 and a sliding window on its last layer (max_window_layers);
# Mistral with a sliding window of 8 keys on every layer (the sequences below are longer).
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32)
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True,
                                                  attention_bias=True, mlp_bias=True)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True, rms_norm_eps=1e-5)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=24, use_sliding_window=True, sliding_window=8,
                                                  max_window_layers=1, rope_parameters=dict(rope_type="default",
                                                                                            rope_theta=5000.0))),
    "mistral": (MistralConfig, MistralForCausalLM, dict(sliding_window=8)),
}
NAMES = list(FAMILIES)
LICENSES = {  # the source's model card: its licence goes into the converted model's card
    "llama": "---\nlicense: llama3.2\n---\n# A tiny Llama\n",
    "qwen2": "---\nlicense: other\nlicense_name: qwen-research\nlicense_link: https://example.org/LICENSE\n---\n",
}
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
TEXTS = ["The harbour town wakes before the boats come in.", "Gulls follow the last boat home at dusk, def f(n):"]


# ----------------------------------------------------------------------------------------------------------------
# Sources built here, converted once
# ----------------------------------------------------------------------------------------------------------------
def sharpen_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights large enough that attention is sharp and the logits are O(1..10) (tied embeddings too): every norm's
    scale spread near 1 (not all ones), matrices at 1.5 / sqrt(fan-in), embeddings N(0, 0.2^2), biases N(0, 0.1^2)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif p.dim() == 2:
                p.copy_(noise * (0.1 if "embed" in name else (0.75 if "lm_head" in name else 1.5) / p.shape[1] ** 0.5))
            else:
                p.copy_(0.1 * noise)
    return model


def build_source(name: str, path: Path, tokenizer, seed: int = 0, **overrides) -> Path:
    config_class, model_class, extra = FAMILIES[name]
    torch.manual_seed(seed)
    model = sharpen_(model_class(config_class(**{**BODY, **extra, **overrides})).eval(), seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if name in LICENSES:
        (path / "README.md").write_text(LICENSES[name])
    return path


def load_source(name: str, path: Path):
    return FAMILIES[name][1].from_pretrained(path, attn_implementation="eager").eval()


def load_converted(path: Path, implementation: str = "eager") -> DCFormerForCausalLM:
    model = AutoModelForCausalLM.from_pretrained(path).eval()  # the package's own class (no remote code)
    assert type(model) is DCFormerForCausalLM
    model.config.dcmha_implementation = implementation
    return model


@pytest.fixture(scope="module")
def tokenizer():
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(TEXTS * 3, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tokenizer) -> dict[str, tuple[Path, Path]]:
    """{family: (source folder, converted folder)}, converted with the defaults (verification on)."""
    root = tmp_path_factory.mktemp("llama-family")
    out = {}
    for name in NAMES:
        src = build_source(name, root / name, tokenizer)
        out[name] = (src, l2d.convert(str(src), str(root / f"dc-{name}")))
    return out


def random_ids(length: int, batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def left_padded(length: int = 24, pad: int = 7) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, position_ids) of two rows, the second left-padded by `pad` tokens; positions
    count real tokens only (what `generate` and DCFormer derive from the mask)."""
    ids, mask = random_ids(length, seed=5), torch.ones(2, length, dtype=torch.long)
    ids[1, :pad], mask[1, :pad] = PAD, 0
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


# ----------------------------------------------------------------------------------------------------------------
# The config, the files and the card
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_config_keeps_the_source_body(name, converted):
    src, dst = converted[name]
    source, cfg = load_source(name, src).config, load_converted(dst).config
    assert cfg.converted_from_model_type == name and cfg.converted_from_folder == src.name
    assert cfg.conversion["tool"] == "dcformer-convert-llama" and cfg.conversion["exact"]
    assert cfg.conversion["max_logit_difference"] <= 1e-5 and cfg.conversion["verified_in"] == "fp32"
    assert (cfg.norm_type, cfg.use_parallel_residual, cfg.use_gated_mlp, cfg.use_dcmha) == ("rmsnorm", False, True,
                                                                                            True)
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "intermediate_size", "hidden_act", "max_position_embeddings", "tie_word_embeddings",
                  "bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(cfg, field) == getattr(source, field), field
    assert cfg.head_dim == (getattr(source, "head_dim", None) or 64 // 4)  # Qwen2's config has none: derived
    assert cfg.num_key_value_heads == 2 and cfg.layer_norm_eps == source.rms_norm_eps
    rope = {**source.rope_parameters, "partial_rotary_factor": 1.0}
    assert cfg.rope_parameters == rope
    biases = {"llama": (True, True, True), "qwen2": (True, False, False), "qwen3": (False, False, False),
              "mistral": (False, False, False)}[name]
    assert (cfg.attention_bias, cfg.output_bias, cfg.mlp_bias) == biases
    assert cfg.use_qk_norm == (name == "qwen3")
    if name == "qwen3":
        assert cfg.head_dim == 24 != cfg.hidden_size // cfg.num_attention_heads
        assert cfg.qk_norm_eps == source.rms_norm_eps
    windows = {"qwen3": (8, ["full_attention", "sliding_attention"]),
               "mistral": (8, ["sliding_attention"] * 2)}.get(name, (None, ["full_attention"] * 2))
    assert (cfg.window_size, cfg.layer_types) == windows
    if name.startswith("qwen"):
        assert cfg.layer_types == source.layer_types


@pytest.mark.parametrize("name", NAMES)
def test_tokenizer_generation_config_and_card(name, converted):
    src, dst = converted[name]
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (dst / file).read_bytes() == (src / file).read_bytes(), file
    card = ModelCard.load(dst / "README.md")
    expected = {"llama": {"license": "llama3.2"},
                "qwen2": {"license": "other", "license_name": "qwen-research",
                          "license_link": "https://example.org/LICENSE"}}.get(name, {})
    assert {key: getattr(card.data, key, None) for key in expected} == expected
    if name not in LICENSES:
        assert card.data.license is None  # the source's card states none: none is written
    family = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}[name]
    assert f"Built from the {family} checkpoint `{src.name}` (local) by `dcformer-convert-llama`" in card.text
    assert "computes exactly the source's function" in card.text


def test_license_option_overrides_the_source_card(converted, tmp_path, capsys):
    src, _ = converted["qwen2"]
    assert l2d.main([str(src), str(tmp_path / "dst"), "--no-verify", "--license", "apache-2.0"]) == 0
    data = ModelCard.load(tmp_path / "dst" / "README.md").data
    assert data.license == "apache-2.0" and getattr(data, "license_name", None) is None


def test_legacy_rope_scaling_config_reads_the_same(converted):
    """A Hub config in transformers 4's keys (rope_theta, rope_scaling) maps to the same rope_parameters."""
    src, dst = converted["llama"]
    raw = json.loads((src / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    raw["rope_theta"], raw["rope_scaling"] = rope.pop("rope_theta"), rope
    family, source = l2d.read_source_config(raw, "legacy")
    config = l2d.dcformer_config(family, source, True)
    assert config.rope_parameters == json.loads((dst / "config.json").read_text())["rope_parameters"]


# ----------------------------------------------------------------------------------------------------------------
# The source's function: forward, cached generation, left padding, every backend
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
@torch.no_grad()
def test_logits_equal_the_source(name, converted):
    src, dst = converted[name]
    source, model = load_source(name, src), load_converted(dst)
    ids = random_ids(40)  # longer than the windows (8)
    ref = source(ids).logits
    assert ref.abs().max() > 1.0  # a function worth comparing
    torch.testing.assert_close(model(ids).logits, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", NAMES)
@torch.no_grad()
def test_cached_greedy_generation_is_the_source(name, converted):
    src, dst = converted[name]
    source, model = load_source(name, src), load_converted(dst)
    prompt = random_ids(6, batch=1, seed=2)
    settings = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=PAD)
    expected = source.generate(prompt, **settings)
    generated = model.generate(prompt, **settings)
    assert generated.shape == (1, 38) and torch.equal(generated, expected)
    # the cache really is used: the last step's logits from the cache equal a full forward over the whole sequence
    full = model(generated[:, :-1]).logits[:, -1]
    torch.testing.assert_close(full, source(generated[:, :-1]).logits[:, -1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", NAMES)
@torch.no_grad()
def test_left_padding(name, converted):
    src, dst = converted[name]
    source, model = load_source(name, src), load_converted(dst)
    ids, mask, positions = left_padded()
    real = mask.bool()
    ref = source(ids, attention_mask=mask, position_ids=positions).logits
    alone = source(ids[1:, 7:]).logits[0]  # the padded row without its padding
    torch.testing.assert_close(ref[1, 7:], alone, atol=1e-5, rtol=0)
    for kwargs in (dict(position_ids=positions), {}):  # DCFormer derives the same positions from the mask
        out = model(ids, attention_mask=mask, **kwargs).logits
        torch.testing.assert_close(out[real], ref[real], atol=1e-5, rtol=0)
    settings = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=PAD)
    expected = source.generate(ids[:, :12], attention_mask=mask[:, :12], **settings)
    assert torch.equal(model.generate(ids[:, :12], attention_mask=mask[:, :12], **settings), expected)


def gqa_probe(device: str) -> DCMHAInputs:
    """A small composed grouped-query call (4 query heads, 2 key/value heads) for a backend's `why_not`."""
    gen = torch.Generator().manual_seed(0)
    B, N, Nkv, T, Dh, G, I = 1, 4, 2, 5, 8, 1, 2
    q = torch.randn(B, N, T, Dh, generator=gen)
    k, v = (torch.randn(B, Nkv, T, Dh, generator=gen) for _ in range(2))
    terms = torch.randn(B, T, G, 2, 2 * I + 1, N // G, generator=gen)
    q, k, v, terms = (x.to(device) for x in (q, k, v, terms))
    return DCMHAInputs(q, k, v, terms, terms.clone(), 0, 0, None, None, I, G, 4)


@pytest.mark.parametrize("backend", ["eager", "compiled", "cpu", "triton"])
@pytest.mark.parametrize("name", NAMES)
@torch.no_grad()
def test_every_backend_computes_the_source(name, backend, converted, aot_eager_compile):
    """Padded logits and cached greedy tokens through each backend; "triton" on a GPU where there is one, else in
    Triton's CPU interpreter for Qwen3 only (GQA, head_dim 24, qk-norm and a window: about 15 s a model there)."""
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    problem = DCMHA_BACKENDS[backend].why_not(gqa_probe(device))
    if problem is not None:
        pytest.skip(f'"{backend}" cannot run here: {problem}')
    interpreted = backend == "triton" and device == "cpu"
    if interpreted and name != "qwen3":
        pytest.skip('"triton" runs in Triton\'s CPU interpreter here (slow): the Qwen3 model stands for the families')
    src, dst = converted[name]
    source, model = load_source(name, src).to(device), load_converted(dst, backend).to(device)
    ids, mask, positions = (x.to(device) for x in left_padded(length=20, pad=5))
    real = mask.bool()
    ref = source(ids, attention_mask=mask, position_ids=positions).logits
    torch.testing.assert_close(model(ids, attention_mask=mask).logits[real], ref[real], atol=1e-5, rtol=0)
    prompt = random_ids(6, batch=1, seed=3).to(device)
    new = 4 if interpreted else 12
    settings = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=PAD)
    assert torch.equal(model.generate(prompt, **settings), source.generate(prompt, **settings))


# ----------------------------------------------------------------------------------------------------------------
# The new weights are trainable
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_one_training_step_moves_every_dcmha_weight(name, converted):
    _, dst = converted[name]
    model = load_converted(dst).train()
    dynamic = {n: p for n, p in model.named_parameters() if ".dyn_w_proj." in n}
    assert len(dynamic) == 3 * model.config.num_hidden_layers  # dw1, qkw, dd per layer
    assert all(torch.count_nonzero(p) == 0 for n, p in dynamic.items() if n.endswith(".dd"))  # the exact init
    before = {n: p.detach().clone() for n, p in dynamic.items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = random_ids(16)
    model(ids, labels=ids).loss.backward()
    for n, p in dynamic.items():
        assert p.grad is not None and torch.count_nonzero(p.grad) > 0, f"{n} got no gradient at step 0"
    optimizer.step()
    for n, p in dynamic.items():
        assert not torch.equal(p.detach(), before[n]), f"{n} did not move"


# ----------------------------------------------------------------------------------------------------------------
# Remote code alone: a Python with only torch and transformers
# ----------------------------------------------------------------------------------------------------------------
REMOTE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(1)
    root, report = Path(sys.argv[1]), {}
    for folder in sys.argv[2:]:
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
        ids = torch.load(root / "ids.pt")
        with torch.no_grad():
            torch.save(model(ids).logits, root / (Path(folder).name + ".remote.pt"))
        report[Path(folder).name] = type(model).__module__
    report["top_level"] = sorted({m.split(".")[0] for m in sys.modules if "dcformer" in m})
    (root / "report.json").write_text(json.dumps(report))
    """
)


@torch.no_grad()
def test_remote_code_alone_loads_and_computes_the_source(converted, tmp_path):
    ids = random_ids(20)
    torch.save(ids, tmp_path / "ids.pt")
    run_without_the_package(REMOTE_SCRIPT, tmp_path, tmp_path, *(dst for _, dst in converted.values()))
    report = json.loads((tmp_path / "report.json").read_text())
    assert report.pop("top_level") == ["transformers_modules"], report  # the copies, never the package
    for name, (src, dst) in converted.items():
        assert report[dst.name].startswith("transformers_modules."), report
        remote = torch.load(tmp_path / f"{dst.name}.remote.pt")
        torch.testing.assert_close(remote, load_source(name, src)(ids).logits, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------------------------------------------
# Streaming, and what is refused
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sharded(tmp_path_factory, tokenizer) -> Path:
    """A 4-layer Qwen2 source saved in shards of 40 KB: layers' q/k/v parts spread over several files."""
    root = tmp_path_factory.mktemp("sharded")
    src = build_source("qwen2", root / "src", tokenizer, seed=1, num_hidden_layers=4)
    model = load_source("qwen2", src)
    for file in src.glob("model*.safetensors*"):
        file.unlink()
    model.save_pretrained(src, max_shard_size="40KB")
    assert len(list(src.glob("model-*.safetensors"))) >= 4
    return src


def test_sharded_source_streams_with_one_layer_held(sharded, tmp_path, monkeypatch, capsys):
    held = []
    real = l2d.LlamaConverter.map_tensor

    def map_tensor(self, key, tensor):
        out = real(self, key, tensor)
        held.append(len({layer for layer, _ in self.pending}))
        return out

    monkeypatch.setattr(l2d.LlamaConverter, "map_tensor", map_tensor)
    code = l2d.main([str(sharded), str(tmp_path / "dst"), "--max-shard-size", "30KB"])
    out = capsys.readouterr().out
    assert code == 0 and "verify: max |logit difference| (fp32)" in out and ": OK" in out, out
    assert held and max(held) <= 2, held  # a layer's parts, and those of one a shard boundary split (of 4 layers)
    assert len(list((tmp_path / "dst").glob("model-*.safetensors"))) > 1
    ids = random_ids(20)
    with torch.no_grad():
        expected = load_source("qwen2", sharded)(ids).logits
        torch.testing.assert_close(load_converted(tmp_path / "dst")(ids).logits, expected, atol=1e-5, rtol=0)


@pytest.fixture
def occupied(tmp_path) -> Path:
    """A destination with the user's file in it: a failed run with --overwrite must leave it as it is."""
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    return dst


def refused(src, dst: Path, capsys, *needles: str) -> None:
    before = tree(dst)
    code = l2d.main([str(src), str(dst), "--overwrite"])
    assert code == 2
    assert_one_line(capsys.readouterr().err, *needles)
    assert tree(dst) == before


def edited_source(src: Path, folder: Path, **changes) -> Path:
    """A copy of `src` with config.json's fields changed (None removes one)."""
    shutil.copytree(src, folder)
    raw = json.loads((folder / "config.json").read_text())
    raw.update(changes)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if v is not None}))
    return folder


def test_wrong_architecture_is_refused_by_the_command(converted, tmp_path, occupied):
    """Through the console script: a GPT-NeoX config is one line naming the architecture, exit code 2."""
    neox = edited_source(converted["llama"][0], tmp_path / "neox", architectures=["GPTNeoXForCausalLM"],
                         model_type="gpt_neox")
    script = shutil.which("dcformer-convert-llama")
    assert script is not None, "the console script is not installed (pip install -e .)"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    before = tree(occupied)
    result = subprocess.run([script, str(neox), str(occupied), "--overwrite"], capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert_one_line(result.stderr, "GPTNeoXForCausalLM", "architectures", "dcformer-convert-pythia")
    assert tree(occupied) == before


@pytest.mark.parametrize("case", ["sequence-classification", "model-type-mismatch"])
def test_other_architectures_are_refused(case, converted, tmp_path, occupied, capsys):
    changes = {"sequence-classification": dict(architectures=["LlamaForSequenceClassification"]),
               "model-type-mismatch": dict(architectures=["MistralForCausalLM"])}[case]
    src = edited_source(converted["llama"][0], tmp_path / "src", **changes)
    refused(src, occupied, capsys, changes["architectures"][0])


@pytest.mark.parametrize("case", ["hidden_act", "quantization_config", "layer_types", "rope_type"])
def test_an_unmappable_field_is_named(case, converted, tmp_path, occupied, capsys):
    name, changes = {
        "hidden_act": ("llama", dict(hidden_act="not_an_activation")),
        "quantization_config": ("mistral", dict(quantization_config={"quant_method": "gptq", "bits": 4})),
        # sliding layers without a window: which keys they see is not defined
        "layer_types": ("qwen3", dict(use_sliding_window=False, layer_types=["full_attention", "sliding_attention"])),
        "rope_type": ("qwen2", dict(rope_parameters={"rope_type": "not_a_rope", "rope_theta": 10000.0})),
    }[case]
    refused(edited_source(converted[name][0], tmp_path / "src", **changes), occupied, capsys, case)


def test_missing_shard_is_named(sharded, tmp_path, occupied, capsys):
    src = tmp_path / "src"
    shutil.copytree(sharded, src)
    gone = sorted(src.glob("model-*.safetensors"))[1]
    gone.unlink()
    refused(src, occupied, capsys, "missing", gone.name)


def test_truncated_file_is_named(sharded, tmp_path, occupied, capsys):
    src = tmp_path / "src"
    shutil.copytree(sharded, src)
    cut = sorted(src.glob("model-*.safetensors"))[-1]
    cut.write_bytes(cut.read_bytes()[:-1000])
    refused(src, occupied, capsys, str(cut), "truncated or corrupt")


def test_a_layer_without_its_key_projection_is_named(converted, tmp_path, occupied, capsys):
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(converted["mistral"][0], src)
    state = load_file(src / "model.safetensors")
    del state["model.layers.1.self_attn.k_proj.weight"]
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    refused(src, occupied, capsys, "model.layers.1.self_attn.k_proj.weight")


def test_a_verification_failure_writes_nothing(converted, tmp_path, occupied, capsys, monkeypatch):
    """Keys and values swapped in the fused projection (the classic bug): the verification fails the run."""
    real = l2d.LlamaConverter.map_tensor

    def swapped(self, key, tensor):
        return real(self, key.replace("k_proj", "@").replace("v_proj", "k_proj").replace("@", "v_proj"), tensor)

    monkeypatch.setattr(l2d.LlamaConverter, "map_tensor", swapped)
    before = tree(occupied)
    assert l2d.main([str(converted["qwen2"][0]), str(occupied), "--overwrite"]) == 2
    captured = capsys.readouterr()
    assert "FAILED" in captured.out
    assert_one_line(captured.err, "differ")
    assert tree(occupied) == before
