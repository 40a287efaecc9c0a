"""modeling_dcformer.conversion.pythia (`dcformer-convert-pythia`, from conversion/) on tiny random GPT-NeoX
checkpoints built here (with a locally trained byte-level BPE tokenizer): exact logits, gradients on every new
parameter, trainability, round trip through AutoModelForCausalLM, dtypes, the legacy layout, the
released-architecture options (and their warnings), and the CLI's errors."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers import PreTrainedTokenizerFast

import modeling_dcformer  # noqa: F401  (registers "dcformer" with the Auto classes)
from modeling_dcformer.conversion import pythia as p2d
from modeling_dcformer.conversion.exact import init_dynamic_weights_exact
from modeling_dcformer import DCFormerConfig, DCFormerForCausalLM
from helpers import sharpen_neox_

ROOT = Path(__file__).resolve().parent.parent
TEXTS = [
    "The quick brown fox jumps over the lazy dog, and the dog does not mind at all.",
    "In 1969 Neil Armstrong walked on the Moon; def f(n): return n + 1",
]
# Odd head counts, rotary fractions 0.25 / 1.0 / 0.5, parallel and sequential residuals, no attention biases with
# tied embeddings and another GELU, and a vocabulary padded beyond the tokenizer's (as Pythia's is).
VARIANTS = {
    "3heads-rot0.25-parallel": dict(hidden_size=48, num_attention_heads=3, rotary_pct=0.25),
    "3heads-rot1.0-sequential": dict(
        hidden_size=48, num_attention_heads=3, rotary_pct=1.0, use_parallel_residual=False, rotary_emb_base=500.0
    ),
    "5heads-rot0.5-nobias-tied-gelu_new": dict(
        hidden_size=40, num_attention_heads=5, rotary_pct=0.5, attention_bias=False, tie_word_embeddings=True,
        hidden_act="gelu_new",
    ),
}


# ----------------------------------------------------------------------------------------------------------------
# Fixtures: a tokenizer and GPT-NeoX checkpoints built locally
# ----------------------------------------------------------------------------------------------------------------
pytestmark = pytest.mark.usefixtures("one_thread_per_module")


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TEXTS * 3 + ["Attention composes heads.", "Photosynthesis stores energy."], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>")


def build_neox(seed: int = 0, **overrides) -> GPTNeoXForCausalLM:
    """A tiny GPT-NeoX LM with weights large enough that attention is sharp and logits are O(1..10)."""
    settings = dict(
        vocab_size=320, hidden_size=48, num_hidden_layers=2, num_attention_heads=3, intermediate_size=96,
        max_position_embeddings=160, bos_token_id=0, eos_token_id=0,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = GPTNeoXForCausalLM(GPTNeoXConfig(**settings)).eval()
    sharpen_neox_(model)
    return model


@pytest.fixture
def make_source(tmp_path, tokenizer):
    """Factory: `make_source(name, dtype=None, **config_overrides)` -> directory of a saved GPT-NeoX checkpoint."""

    def make(name: str = "neox", dtype: torch.dtype | None = None, seed: int = 0, **overrides) -> Path:
        model = build_neox(seed, **overrides)
        if dtype is not None:
            model = model.to(dtype)
        path = tmp_path / name
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        return path

    return make


def encode(tokenizer, text: str = TEXTS[0]) -> torch.Tensor:
    return torch.tensor([tokenizer(text)["input_ids"]])


def run_cli(*args, capsys=None) -> tuple[int, str, str]:
    code = p2d.main([str(a) for a in args])
    out, err = capsys.readouterr() if capsys is not None else ("", "")
    return code, out, err


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tokenizer):
    """One converted checkpoint (3 heads, rotary 0.25) shared by the gradient and training tests."""
    root = tmp_path_factory.mktemp("shared")
    build_neox(3).save_pretrained(root / "src")
    tokenizer.save_pretrained(root / "src")
    p2d.convert(str(root / "src"), str(root / "dst"))
    return root / "dst"


# ----------------------------------------------------------------------------------------------------------------
# The function is kept
# ----------------------------------------------------------------------------------------------------------------
def test_regroup_qkv_layout():
    N, Dh, D = 3, 2, 6
    # row label = 100 * head + 10 * part (q=0, k=1, v=2) + dim, GPT-NeoX order [head, part, dim]
    labels = torch.tensor([100 * n + 10 * j + d for n in range(N) for j in range(3) for d in range(Dh)]).float()
    ours = p2d.regroup_qkv(labels, N)
    assert ours.tolist() == [100 * n + 10 * j + d for j in range(3) for n in range(N) for d in range(Dh)]
    weight = labels[:, None].expand(3 * N * Dh, D)
    assert torch.equal(p2d.regroup_qkv(weight, N)[:, 0], ours)


@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
def test_converted_logits_equal_source(variant, make_source, tokenizer, tmp_path, capsys):
    src = make_source(**VARIANTS[variant])
    code, out, err = run_cli(src, tmp_path / "dst", capsys=capsys)
    assert code == 0, err
    assert "verify: max |logit difference|" in out and ": OK" in out

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "dst").eval()  # round trip through the Auto class
    assert isinstance(model, DCFormerForCausalLM)
    source = GPTNeoXForCausalLM.from_pretrained(src, attn_implementation="eager").eval()
    cfg = model.config
    # provenance a reader can use: the folder's name, never the absolute local path
    assert cfg.converted_from is None and cfg.converted_from_folder == src.name
    assert cfg.converted_from_model_type == "gpt_neox"
    assert str(src.parent) not in (tmp_path / "dst" / "config.json").read_text()
    from modeling_dcformer.checkpoints.fingerprint import model_fingerprint

    assert cfg.conversion["weights"] == model_fingerprint(model)  # which weights compute the source's function
    assert cfg.conversion["exact"] and cfg.conversion["max_logit_difference"] <= 1e-4
    assert cfg.vocab_size == 320 > len(tokenizer)  # padded vocabulary kept
    assert cfg.partial_rotary_factor == source.config.rope_parameters["partial_rotary_factor"]
    assert cfg.rope_theta == source.config.rope_parameters["rope_theta"]
    assert cfg.use_parallel_residual == source.config.use_parallel_residual
    assert cfg.max_position_embeddings == 160 and cfg.layer_norm_eps == source.config.layer_norm_eps
    assert cfg.attention_bias == source.config.attention_bias
    assert cfg.hidden_act == source.config.hidden_act and cfg.tie_word_embeddings == source.config.tie_word_embeddings
    assert not cfg.use_qk_norm and set(cfg.layer_types) == {"full_attention"}
    assert (tmp_path / "dst" / "tokenizer.json").is_file()

    with torch.no_grad():
        for text in TEXTS:
            ids = encode(tokenizer, text)
            ref = source(ids).logits
            assert ref.abs().max() > 1.0  # a function worth comparing
            torch.testing.assert_close(model(ids).logits, ref, atol=1e-4, rtol=0)
        ids = torch.randint(0, cfg.vocab_size, (2, 150), generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(model(ids).logits, source(ids).logits, atol=1e-4, rtol=0)


def test_legacy_layout_and_sharded_output(make_source, tokenizer, tmp_path, capsys):
    """Old Pythia files: config names rotary_pct / rotary_emb_base / torch_dtype, a pytorch_model.bin with the head
    as embed_out and the attention.bias / masked_bias / rotary_emb.inv_freq buffers. Output in small shards."""
    src = make_source("new", rotary_pct=0.25)
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        state = {key: f.get_tensor(key) for key in f.keys()}
    assert "embed_out.weight" in state
    for layer in range(2):
        prefix = f"gpt_neox.layers.{layer}.attention"
        state[f"{prefix}.bias"] = torch.tril(torch.ones(160, 160, dtype=torch.bool))[None, None]
        state[f"{prefix}.masked_bias"] = torch.tensor(-1e9)
        state[f"{prefix}.rotary_emb.inv_freq"] = torch.ones(2)
    torch.save(state, legacy / "pytorch_model.bin")
    config = json.loads((src / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.pop("dtype", None)
    config.update(rotary_pct=rope["partial_rotary_factor"], rotary_emb_base=rope["rope_theta"], torch_dtype="float32")
    (legacy / "config.json").write_text(json.dumps(config))
    tokenizer.save_pretrained(legacy)

    code, out, err = run_cli(legacy, tmp_path / "dst", "--max-shard-size", "20KB", capsys=capsys)
    assert code == 0, err
    assert ": OK" in out
    assert (tmp_path / "dst" / "model.safetensors.index.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "dst").eval()
    source = GPTNeoXForCausalLM.from_pretrained(src).eval()
    ids = encode(tokenizer)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, source(ids).logits, atol=1e-4, rtol=0)


def test_dtype_kept_unless_asked(make_source, tokenizer, tmp_path, capsys):
    src = make_source(dtype=torch.float16)
    cases = ((tmp_path / "fp16", [], torch.float16), (tmp_path / "fp32", ["--dtype", "float32"], torch.float32))
    for dst, extra, want in cases:
        code, out, err = run_cli(src, dst, *extra, capsys=capsys)
        assert code == 0, err
        assert ": OK" in out  # fp32 verification of fp16 weights: still exact
        with safe_open(str(dst / "model.safetensors"), framework="pt") as f:
            dtypes = {f.get_slice(key).get_dtype() for key in f.keys()}
            assert any("dyn_w_proj" in key for key in f.keys())
        assert dtypes == {"F16" if want == torch.float16 else "F32"}
        assert json.loads((dst / "config.json").read_text())["dtype"] == str(want).removeprefix("torch.")
        model = AutoModelForCausalLM.from_pretrained(dst)
        assert model.dtype == want


# ----------------------------------------------------------------------------------------------------------------
# The new parameters are trainable
# ----------------------------------------------------------------------------------------------------------------
def first_backward(model, tokenizer) -> dict[int, dict[str, float]]:
    """Gradient norm of dw1, qkw and dd in every layer after one backward pass of the LM loss."""
    ids = torch.cat([encode(tokenizer, t)[:, :16] for t in TEXTS])
    model.zero_grad()
    model(ids, labels=ids).loss.backward()
    norms = {}
    for layer, block in enumerate(model.model.layers):
        proj = block.self_attn.dyn_w_proj
        norms[layer] = {name: 0.0 if p.grad is None else float(p.grad.norm()) for name, p in proj.named_parameters()}
    return norms


def test_every_dynamic_weight_gets_a_gradient(converted, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(converted).train()
    # The init is the exact one: dd = 0, and w2 = h qkw_w2 = 0 because the units carrying w2 are dormant.
    for block in model.model.layers:
        proj = block.self_attn.dyn_w_proj
        K, I = proj.dw1.shape[-1], proj.qkw.shape[-2] // 2
        assert torch.count_nonzero(proj.dd) == 0
        active, dormant = slice(0, K // 2), slice(K // 2, K)
        assert torch.count_nonzero(proj.dw1[..., dormant]) == 0 and torch.count_nonzero(proj.dw1[..., active]) > 0
        assert torch.count_nonzero(proj.qkw[:, :, active, I:]) == 0  # w2 rows of the active units
        assert torch.count_nonzero(proj.qkw[:, :, dormant, :I]) == 0  # w1 rows of the dormant units
        assert torch.count_nonzero(proj.qkw[:, :, active, :I]) > 0
        assert torch.count_nonzero(proj.qkw[:, :, dormant, I:]) > 0
    norms = first_backward(model, tokenizer)
    assert len(norms) == model.config.num_hidden_layers
    for layer, grads in norms.items():
        assert set(grads) == {"dw1", "qkw", "dd"}
        for name, norm in grads.items():
            assert norm > 0, f"layer {layer}: {name} got no gradient"


def test_all_zero_init_would_be_a_saddle(converted, tokenizer):
    """Why the init is not simply zeros: then dw1 and qkw get exactly zero gradient (only dd would move)."""
    model = AutoModelForCausalLM.from_pretrained(converted).train()
    with torch.no_grad():
        for block in model.model.layers:
            for p in block.self_attn.dyn_w_proj.parameters():
                p.zero_()
    for grads in first_backward(model, tokenizer).values():
        assert grads["dw1"] == 0 and grads["qkw"] == 0 and grads["dd"] > 0


def test_training_only_the_new_parameters_lowers_the_loss(converted, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(converted).train()
    new = [p for name, p in model.named_parameters() if "dyn_w_proj" in name]
    for name, p in model.named_parameters():
        p.requires_grad_("dyn_w_proj" in name)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    ids = torch.cat([encode(tokenizer, t)[:, :16] for t in TEXTS])
    optimizer = torch.optim.Adam(new, lr=1e-2)
    losses = []
    for _ in range(6):
        optimizer.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    with torch.no_grad():
        losses.append(float(model(ids, labels=ids).loss))
    assert losses[-1] < losses[0] - 0.1, losses
    for name, p in model.named_parameters():  # only the new parameters moved, and all of them did
        assert torch.equal(p, before[name]) != ("dyn_w_proj" in name), name


def test_init_function_is_exact_on_any_dcformer(tiny_config):
    """`init_dynamic_weights_exact` on a whole model (windows, qk-norm, head groups): same logits as plain MHA."""
    config = tiny_config(window_size=3, window_type="LG", use_qk_norm=True, num_head_groups=2)
    torch.manual_seed(0)
    model = DCFormerForCausalLM(config).eval()
    init_dynamic_weights_exact(model, 0.5, torch.Generator().manual_seed(0))
    plain = DCFormerForCausalLM(DCFormerConfig(**{**config.to_dict(), "use_dcmha": False})).eval()
    missing, _ = plain.load_state_dict(model.state_dict(), strict=False)
    assert not missing
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, atol=1e-5, rtol=0)
    again = DCFormerForCausalLM(config)
    init_dynamic_weights_exact(again, 0.5, torch.Generator().manual_seed(0))
    dyn = {name: p for name, p in again.named_parameters() if "dyn_w_proj" in name}
    assert len(dyn) == 3 * config.num_hidden_layers
    assert all(torch.equal(p, model.get_parameter(name)) for name, p in dyn.items())  # reproducible per generator
    with pytest.raises(ValueError, match="positive"):
        init_dynamic_weights_exact(model, 0.0)
    with pytest.raises(ValueError, match="no DCMHA"):
        init_dynamic_weights_exact(torch.nn.Linear(2, 2))


# ----------------------------------------------------------------------------------------------------------------
# Released-architecture options, verification failure and CLI errors
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture
def warnings_logged(caplog, monkeypatch):
    """The converter's warnings: logged (transformers' logging) by `modeling_dcformer.conversion.pythia`."""
    monkeypatch.setattr(logging.getLogger("modeling_dcformer.conversion.pythia"), "propagate", True)
    caplog.set_level(logging.WARNING, logger="modeling_dcformer.conversion.pythia")
    return lambda: [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize("option", [["--window-size", "8"], ["--qk-norm"]], ids=["window", "qk-norm"])
def test_released_options_warn_and_report_the_difference(option, make_source, tmp_path, capsys, warnings_logged):
    src = make_source()
    code, out, err = run_cli(src, tmp_path / "dst", *option, capsys=capsys)
    assert code == 0, err
    warned = warnings_logged()
    assert len(warned) == 2 and "no longer computes" in warned[0] and "max |logit difference|" in warned[1], warned
    assert "verify:" not in out  # no bound applied: nothing to pass or fail
    config = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert config["conversion"]["exact"] is False and config["conversion"]["max_logit_difference"] > 1e-4
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "dst")
    if option[0] == "--qk-norm":
        assert model.config.use_qk_norm
        assert all(torch.equal(b.self_attn.q_norm.weight, torch.ones(16)) for b in model.model.layers)
    else:
        assert model.config.window_size == 8 and "sliding_attention" in model.config.layer_types


def test_verification_failure_exits_nonzero_and_writes_nothing(make_source, tmp_path, capsys, monkeypatch):
    src = make_source()
    monkeypatch.setattr(p2d, "regroup_qkv", lambda tensor, num_heads: tensor)  # the classic bug: no regrouping
    code, out, err = run_cli(src, tmp_path / "dst", capsys=capsys)
    assert code == 2
    assert "FAILED" in out and "error:" in err and "differ" in err
    assert not (tmp_path / "dst").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".dst")]  # no partial directory left


def test_non_empty_destination_refused_unless_overwrite(make_source, tmp_path, capsys):
    src = make_source()
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    code, _, err = run_cli(src, dst, "--no-verify", capsys=capsys)
    assert code == 2 and "error:" in err and "--overwrite" in err
    assert (dst / "keep.txt").read_text() == "mine"
    code, _, err = run_cli(src, dst, "--no-verify", "--overwrite", capsys=capsys)
    assert code == 0, err
    assert not (dst / "keep.txt").exists() and (dst / "model.safetensors").is_file()


def test_cli_rejects_bad_sources_and_options(make_source, tmp_path, capsys):
    code, _, err = run_cli(tmp_path / "absent", tmp_path / "dst", capsys=capsys)
    assert code == 2 and "error:" in err and "does not exist" in err
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 8}))
    code, _, err = run_cli(other, tmp_path / "dst", capsys=capsys)
    assert code == 2 and "not a GPT-NeoX checkpoint" in err and "'gpt2'" in err
    src = make_source()
    for option, message in (
        (["--window-type", "LG"], "needs --window-size"),
        (["--init-scale", "0"], "positive"),
        (["--window-size", "1000"], "max_position_embeddings"),
        (["--dtype", "int8"], "unknown dtype"),
        (["--revision", "step1000"], "Hub ids only"),
    ):
        code, _, err = run_cli(src, tmp_path / "dst", *option, capsys=capsys)
        assert code == 2 and "error:" in err and message in err, (option, err)
    assert not (tmp_path / "dst").exists()
    odd = make_source("odd-rotary", hidden_size=36, num_attention_heads=3, rotary_pct=0.25)  # 3 rotary dims
    code, _, err = run_cli(odd, tmp_path / "dst", capsys=capsys)
    assert code == 2 and "even number of rotary dimensions" in err


def test_warnings_reach_the_terminal_by_default(make_source, tmp_path):
    """Run as the command, with logging as transformers leaves it: the warnings are on stderr, the verification's
    results and the final line on stdout."""
    src = make_source()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRANSFORMERS_VERBOSITY")}
    result = subprocess.run(
        [sys.executable, "-m", "modeling_dcformer.conversion.pythia", str(src), str(tmp_path / "dst"), "--qk-norm",
         "--no-verify"],
        capture_output=True, text=True, cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1"}, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--qk-norm give the released DCPythia architecture" in result.stderr
    assert "the logit difference was not measured" in result.stderr
    assert f"Converted {src} -> " in result.stdout and "no longer computes" not in result.stdout


def test_script_rejects_a_llama_checkpoint(tmp_path):
    """Run as `python -m modeling_dcformer.conversion.pythia` (what `dcformer-convert-pythia` runs): a LLaMA
    checkpoint is refused with exit code 2 and a clear message."""
    llama = LlamaForCausalLM(
        LlamaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    )
    llama.save_pretrained(tmp_path / "llama")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(
        [sys.executable, "-m", "modeling_dcformer.conversion.pythia", str(tmp_path / "llama"), str(tmp_path / "dst")],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "error:" in result.stderr and "not a GPT-NeoX checkpoint" in result.stderr and "'llama'" in result.stderr
    assert not (tmp_path / "dst").exists()
