"""Training DCFormer with the transformers Trainer and dcformer-train / examples/train_clm.py (CPU, tiny models, no
downloads).

- Trainer lowers the loss of a tiny model on a small repeated corpus;
- chunked attention (with per-chunk recompute, with and without layer checkpointing) gives the loss and gradients of
  the plain, unchunked oracle attention, and the same Trainer run as unchunked attention;
- resuming from a checkpoint continues the same run (same losses, same final weights);
- activation checkpointing, bf16 autocast, fp16 (what the CPU allows) and torch.compile under Trainer;
- the script's CLI end to end on the bundled text (preset + local tokenizer, .txt and .jsonl, eval perplexity,
  auto-resume, a model that loads with from_pretrained);
- two processes over gloo: DDP through `accelerate launch` with the installed multi_cpu_gloo.yaml, and FSDP2
  (fully_shard on each DCFormerDecoderLayer) against single-process training;
- the shipped accelerate / DeepSpeed config files are consistent with the model.
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
import torch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
SCRIPT = EXAMPLES / "train_clm.py"
TRAIN_TXT = EXAMPLES / "data" / "harbour_train.txt"
VALID_TXT = EXAMPLES / "data" / "harbour_validation.txt"

import modeling_dcformer  # noqa: F401
from modeling_dcformer import DCFormerConfig, DCFormerForCausalLM
from modeling_dcformer.training import train_clm
from modeling_dcformer.training.tokenizer import build_tiny_tokenizer, read_lines

ACCELERATE_DIR = train_clm.ACCELERATE_DIR  # the accelerate configs, installed with the package

BLOCK = 32
TOKENIZER_VOCAB = 384


# ----------------------------------------------------------------------------------------------------------------
# Fixtures and helpers
# ----------------------------------------------------------------------------------------------------------------
pytestmark = pytest.mark.usefixtures("one_thread_each_test")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tokenizer")
    build_tiny_tokenizer(read_lines([TRAIN_TXT]), TOKENIZER_VOCAB, out)
    return out


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def pack(tokenizer, lines, block=BLOCK):
    ids = [t for line in lines for t in tokenizer(line)["input_ids"] + [tokenizer.eos_token_id]]
    return [ids[i : i + block] for i in range(0, len(ids) - block + 1, block)]


def lm_dataset(blocks):
    from datasets import Dataset

    return Dataset.from_dict({"input_ids": blocks, "labels": [list(b) for b in blocks]})


def tiny_config(vocab_size, **overrides):
    base = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        use_qk_norm=True,
        window_size=8,  # layer 0 local (window 8 < block 32), layer 1 global
        attention_chunk_size=8,  # 4 chunks of queries a block, each recomputed in the backward pass
        eos_token_id=0,
        bos_token_id=0,
    )
    return DCFormerConfig(**{**base, **overrides})


def tiny_model(vocab_size, seed=0, **overrides):
    torch.manual_seed(seed)
    return DCFormerForCausalLM(tiny_config(vocab_size, **overrides))


def training_args(output_dir, **overrides):
    from transformers import TrainingArguments

    base = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=8,
        per_device_eval_batch_size=8,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        max_steps=10,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    return TrainingArguments(**{**base, **overrides})


def make_trainer(model, args, train_blocks, eval_blocks=None):
    from transformers import Trainer, default_data_collator

    return Trainer(
        model=model,
        args=args,
        train_dataset=lm_dataset(train_blocks),
        eval_dataset=None if eval_blocks is None else lm_dataset(eval_blocks),
        data_collator=default_data_collator,
    )


def logged_losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subprocess_env(tmp_path):
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HOME=str(tmp_path / "hf_home"),  # datasets' cache of the local files goes here, not to ~/.cache
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        ACCELERATE_DISABLE_RICH="1",
    )
    for key in [k for k in env if k.startswith(("ACCELERATE_USE_", "FSDP_", "LOCAL_RANK", "WORLD_SIZE", "RANK"))]:
        env.pop(key)
    return env


def run_cmd(cmd, env, timeout=150):
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{output[-6000:]}"
    return output


def load_script():
    return train_clm  # examples/train_clm.py runs modeling_dcformer.training.train_clm's command line


# ----------------------------------------------------------------------------------------------------------------
# 1. Trainer learns
# ----------------------------------------------------------------------------------------------------------------
def test_trainer_lowers_training_loss_on_repeated_corpus(tokenizer, tmp_path):
    lines = read_lines([TRAIN_TXT])[:12]
    blocks = pack(tokenizer, lines)  # a few blocks, seen again and again
    model = tiny_model(len(tokenizer))
    trainer = make_trainer(model, training_args(tmp_path, max_steps=40), blocks * 4, eval_blocks=blocks)
    before = trainer.evaluate()["eval_loss"]
    assert abs(before - math.log(len(tokenizer))) < 0.5  # an untrained model is close to uniform
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    losses = logged_losses(trainer)
    assert len(losses) == 40 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.5, losses
    assert after < before - 1.5, (before, after)


# ----------------------------------------------------------------------------------------------------------------
# 2. Chunked attention = plain attention, in loss and gradients
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layer_checkpointing", [False, True], ids=["chunks", "chunks+layer-checkpointing"])
def test_chunked_training_step_matches_plain_oracle_attention(layer_checkpointing):
    """Loss and every parameter gradient of a train-mode fp32 step with chunked, recomputed attention (3-query
    chunks, a window of 5, ignored labels) equal those of the spec's plain oracle (full [T, S] scores, loops over
    heads) run in float64 on the same weights."""
    from oracle import oracle_causal_lm

    torch.manual_seed(0)
    config = tiny_config(100, attention_chunk_size=3, window_size=5, attention_recompute=True)
    model = DCFormerForCausalLM(config).train()
    with torch.no_grad():  # composition weights large enough to matter
        for name, p in model.named_parameters():
            if "dyn_w_proj" in name:
                p.normal_(0.0, 0.5)
    if layer_checkpointing:
        model.activation_checkpointing_enable()  # what Trainer(activation_checkpointing=True) calls
        assert model.is_activation_checkpointing
    ids = torch.randint(0, 100, (2, 13), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[1, :4] = -100

    loss = model(ids, labels=labels).loss
    loss.backward()

    state = {k: v.detach().double().requires_grad_(True) for k, v in model.state_dict().items()}
    logits = oracle_causal_lm(state, config, ids)
    shift_logits, shift_labels = logits[:, :-1].reshape(-1, 100), labels[:, 1:].reshape(-1)
    ref_loss = torch.nn.functional.cross_entropy(shift_logits, shift_labels, ignore_index=-100)
    ref_loss.backward()

    torch.testing.assert_close(loss.detach().double(), ref_loss.detach(), rtol=1e-5, atol=1e-5)
    for name, p in model.named_parameters():
        assert p.grad is not None and state[name].grad is not None, name
        ref = state[name].grad
        # fp32 round-off, amplified by composition weights of std 0.5: ~5e-5 of a gradient's range here
        torch.testing.assert_close(p.grad.double(), ref, rtol=1e-4, atol=3e-4 * ref.abs().max().item(), msg=name)
    assert state["model.layers.0.self_attn.dyn_w_proj.qkw"].grad.abs().max() > 1e-3  # composition is exercised


def test_trainer_run_same_with_chunked_and_plain_attention(tokenizer, tmp_path):
    """The same Trainer run (same data order, same optimiser) with chunked + recomputed attention and activation
    checkpointing, and with one plain chunk and nothing recomputed: same losses step by step, same final weights."""
    blocks = pack(tokenizer, read_lines([TRAIN_TXT])[:12])
    runs = {}
    for name, overrides, ckpt in (
        ("plain", dict(attention_chunk_size=512, attention_recompute=False), False),
        ("chunked", dict(attention_chunk_size=4, attention_recompute=True), True),
    ):
        model = tiny_model(len(tokenizer), **overrides)
        args = training_args(tmp_path / name, max_steps=6, activation_checkpointing=ckpt)
        trainer = make_trainer(model, args, blocks * 2)
        trainer.train()
        assert trainer.model.is_activation_checkpointing == ckpt
        runs[name] = (logged_losses(trainer), {k: v.detach().clone() for k, v in model.state_dict().items()})
    (plain_losses, plain_state), (chunk_losses, chunk_state) = runs["plain"], runs["chunked"]
    assert plain_losses == pytest.approx(chunk_losses, rel=1e-5, abs=1e-5)
    for key in plain_state:
        torch.testing.assert_close(chunk_state[key], plain_state[key], rtol=1e-4, atol=1e-5, msg=key)


# ----------------------------------------------------------------------------------------------------------------
# 3. Resume
# ----------------------------------------------------------------------------------------------------------------
def test_resume_from_checkpoint_continues_the_same_run(tokenizer, tmp_path):
    blocks = pack(tokenizer, read_lines([TRAIN_TXT])[:24])  # several batches an epoch: shuffling matters
    kwargs = dict(max_steps=8, save_strategy="steps", save_steps=4, lr_scheduler_type="linear", warmup_steps=2)

    full = make_trainer(tiny_model(len(tokenizer)), training_args(tmp_path / "full", **kwargs), blocks)
    full.train()
    assert (tmp_path / "full" / "checkpoint-4").is_dir()

    # A fresh process would start from a fresh model: another seed proves the weights come from the checkpoint.
    resumed = make_trainer(tiny_model(len(tokenizer), seed=123), training_args(tmp_path / "resumed", **kwargs), blocks)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-4"))

    assert resumed.state.global_step == 8
    steps = {h["step"]: h["loss"] for h in full.state.log_history if "loss" in h}
    steps_resumed = {h["step"]: h["loss"] for h in resumed.state.log_history if "loss" in h}
    for step in range(5, 9):
        assert steps_resumed[step] == pytest.approx(steps[step], rel=1e-6, abs=1e-6), step
    for (key, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=key)


# ----------------------------------------------------------------------------------------------------------------
# 4. Activation checkpointing, mixed precision, torch.compile
# ----------------------------------------------------------------------------------------------------------------
def record_matmul_dtypes(model):
    """dtypes of the attention input projection's output during training (bf16 under bf16 autocast)."""
    seen = set()
    for module in model.modules():
        if type(module).__name__ == "DCFormerAttention":
            module.qkv_proj.register_forward_hook(lambda m, i, o: seen.add(o.dtype))
    return seen


@pytest.mark.parametrize("ckpt", [False, True], ids=["bf16", "bf16+activation-checkpointing"])
def test_trainer_bf16_mixed_precision(tokenizer, tmp_path, ckpt):
    blocks = pack(tokenizer, read_lines([TRAIN_TXT])[:12])
    fp32_model = tiny_model(len(tokenizer))
    fp32 = make_trainer(fp32_model, training_args(tmp_path / "fp32", max_steps=8), blocks)
    fp32.train()

    model = tiny_model(len(tokenizer))
    dtypes = record_matmul_dtypes(model)
    trainer = make_trainer(
        model, training_args(tmp_path / "bf16", max_steps=8, bf16=True, activation_checkpointing=ckpt), blocks
    )
    trainer.train()
    assert dtypes == {torch.bfloat16}, dtypes  # autocast really ran the matmuls in bf16
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights
    losses, ref = logged_losses(trainer), logged_losses(fp32)
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.3
    assert losses == pytest.approx(ref, rel=0.03, abs=0.05)  # bf16 follows the fp32 run


def test_fp16_on_cpu(tokenizer, tmp_path):
    """accelerate has no fp16 autocast on the CPU: Trainer(fp16=True, use_cpu=True) runs, in fp32. The model itself
    trains under torch.autocast('cpu', float16) with a GradScaler: finite loss and gradients close to fp32's."""
    blocks = pack(tokenizer, read_lines([TRAIN_TXT])[:12])
    model = tiny_model(len(tokenizer))
    dtypes = record_matmul_dtypes(model)
    trainer = make_trainer(model, training_args(tmp_path, max_steps=3, fp16=True), blocks)
    trainer.train()
    assert dtypes == {torch.float32}  # documents accelerate's behaviour: fp16 is ignored on the CPU
    assert all(math.isfinite(x) for x in logged_losses(trainer))

    ids = torch.tensor(blocks[:4])
    ref = tiny_model(len(tokenizer)).train()
    ref_loss = ref(ids, labels=ids).loss
    ref_loss.backward()
    model = tiny_model(len(tokenizer)).train()
    dtypes = record_matmul_dtypes(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(ids, labels=ids).loss
    assert dtypes == {torch.float16}
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.isfinite(p.grad).all(), name
        scale = p_ref.grad.abs().max().item()
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=0.05, atol=0.05 * scale + 1e-6, msg=name)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-2)
    scaler.step(optimizer)
    scaler.update()
    assert scaler.get_scale() == 1024.0  # no inf/nan step was skipped


@pytest.mark.parametrize(
    "backend",
    [
        # Trainer + torch.compile: 2 minutes of Dynamo tracing even with aot_eager; inductor also builds C++ kernels
        # with gcc. Opt in with `pytest -m expensive` (the compiled DCMHA backend itself is in the default run:
        # test_dcmha_backends.py, test_dcmha_compiled.py)
        pytest.param("aot_eager", marks=pytest.mark.expensive),
        pytest.param("inductor", marks=pytest.mark.expensive),
    ],
)
def test_trainer_torch_compile(tokenizer, tmp_path, backend):
    """TrainingArguments(torch_compile=True): Trainer trains a torch.compile'd DCFormer (graph breaks at the
    attention's data-dependent chunk bounds are allowed) with the losses of the eager run."""
    blocks = pack(tokenizer, read_lines([TRAIN_TXT])[:12])
    eager = make_trainer(tiny_model(len(tokenizer)), training_args(tmp_path / "eager", max_steps=3), blocks)
    eager.train()
    args = training_args(tmp_path / "compiled", max_steps=3, torch_compile=True, torch_compile_backend=backend)
    compiled = make_trainer(tiny_model(len(tokenizer)), args, blocks)
    compiled.train()
    assert type(compiled.model_wrapped).__name__ == "OptimizedModule"
    assert logged_losses(compiled) == pytest.approx(logged_losses(eager), rel=1e-4, abs=1e-4)
    torch._dynamo.reset()


# ----------------------------------------------------------------------------------------------------------------
# 5. The script
# ----------------------------------------------------------------------------------------------------------------
def script_args(output_dir, tokenizer_dir, *extra, model=("--config_name", "dcformer-tiny")):
    return [
        *model,
        "--config_overrides", "attention_chunk_size=16",
        "--tokenizer_name", str(tokenizer_dir),
        "--block_size", "64",
        "--per_device_train_batch_size", "8",
        "--per_device_eval_batch_size", "8",
        "--learning_rate", "3e-3",
        "--logging_steps", "1",
        "--output_dir", str(output_dir),
        "--use_cpu",
        "--report_to", "none",
        "--disable_tqdm", "true",
        "--dataloader_num_workers", "0",
        *extra,
    ]  # fmt: skip


def test_script_units():
    from modeling_dcformer.configuration import config_file  # the one preset resolver, behind --config_name

    script = load_script()
    assert config_file("dcformer-tiny") == ROOT / "configuration" / "dcformer-tiny.json"
    assert config_file("dcpythia-6.9b.json") == ROOT / "configuration" / "dcpythia-6.9b.json"
    assert config_file(str(ROOT / "configuration" / "dcformer-tiny.json")).is_file()
    assert config_file("EleutherAI/pythia-160m") is None  # a Hub id / directory: AutoConfig's job
    with pytest.raises(FileNotFoundError, match="the presets are: dcformer-2.8b, dcformer-llama-3.2-1b"):
        config_file("no-such-preset.json")

    config = DCFormerConfig.from_json_file(ROOT / "configuration" / "dcformer-tiny.json")
    new = script.apply_config_overrides(config, "window_size=None,attention_chunk_size=32,attention_recompute=false")
    assert new.window_size is None and new.layer_types == ["full_attention"] * config.num_hidden_layers
    assert new.attention_chunk_size == 32 and new.attention_recompute is False
    new = script.apply_config_overrides(config, "num_hidden_layers=4,window_type=LGLL")
    assert new.layer_types == ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
    with pytest.raises(ValueError, match="no attribute"):
        script.apply_config_overrides(config, "not_a_field=1")

    from transformers import GPTNeoXConfig

    with pytest.raises(ValueError, match="dcformer-convert-pythia"):
        script.refuse_non_dcformer(GPTNeoXConfig(), "EleutherAI/pythia-70m")


def test_script_cli_end_to_end(tokenizer_dir, tmp_path):
    """Preset + local tokenizer + local .txt files: trains, evaluates (loss and perplexity), saves a model that
    loads with from_pretrained and generates."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "run"
    args = script_args(
        out, tokenizer_dir,
        "--train_file", str(TRAIN_TXT), "--validation_file", str(VALID_TXT),
        "--do_train", "--do_eval", "--max_steps", "30", "--eval_strategy", "steps", "--eval_steps", "15",
        "--append_eos",
    )  # fmt: skip
    output = run_cmd([sys.executable, str(SCRIPT), *args], subprocess_env(tmp_path))

    match = re.search(r"eval_loss = ([\d.]+)\s+perplexity = ([\d.]+)", output)
    assert match, output[-3000:]
    eval_loss, ppl = float(match.group(1)), float(match.group(2))
    assert ppl == pytest.approx(math.exp(eval_loss), rel=1e-3)
    results = json.loads((out / "all_results.json").read_text())
    assert results["perplexity"] == pytest.approx(math.exp(results["eval_loss"]), rel=1e-6)
    state = json.loads((out / "trainer_state.json").read_text())
    losses = [h["loss"] for h in state["log_history"] if "loss" in h]
    evals = [h["eval_loss"] for h in state["log_history"] if "eval_loss" in h]
    assert len(losses) == 30 and losses[-1] < losses[0] - 1.0
    assert evals[-1] < math.log(TOKENIZER_VOCAB) - 0.5

    model = AutoModelForCausalLM.from_pretrained(str(out))
    tok = AutoTokenizer.from_pretrained(str(out))
    assert type(model).__name__ == "DCFormerForCausalLM"
    assert model.config.attention_chunk_size == 16 and model.config.use_cache
    assert model.config.vocab_size == 512  # the preset's, larger than the tokenizer's 384
    ids = tok("The harbour", return_tensors="pt").input_ids
    gen = model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert gen.shape == (1, ids.shape[1] + 5)


def test_script_cli_model_dir_jsonl_and_auto_resume(tokenizer_dir, tmp_path):
    """Fine-tuning a saved model directory (a DCPythia body as dcformer-convert-pythia writes it: qk-norm
    off, every layer global) on a .jsonl `text` column with the validation split held out of it; a second run in
    the same output_dir with more steps resumes from the last checkpoint (history kept, global step continued)."""
    from transformers import AutoModelForCausalLM

    source = tmp_path / "dcpythia-tiny"
    start = tiny_model(512, seed=3, use_qk_norm=False, window_size=None, max_position_embeddings=128)
    start.save_pretrained(str(source))
    data = tmp_path / "train.jsonl"
    with open(data, "w", encoding="utf-8") as f:
        for line in read_lines([TRAIN_TXT]):
            f.write(json.dumps({"text": line, "id": len(line)}) + "\n")
    out = tmp_path / "run"
    env = subprocess_env(tmp_path)
    common = ["--train_file", str(data), "--validation_split_percentage", "10", "--do_train", "--do_eval",
              "--save_steps", "4", "--max_eval_samples", "4"]  # fmt: skip
    model = ("--model_name_or_path", str(source))
    first_run = script_args(out, tokenizer_dir, *common, "--max_steps", "4", model=model)
    run_cmd([sys.executable, str(SCRIPT), *first_run], env)
    assert (out / "checkpoint-4").is_dir()
    first = json.loads((out / "all_results.json").read_text())
    assert first["eval_samples"] == 4 and math.isfinite(first["eval_loss"])
    tuned = AutoModelForCausalLM.from_pretrained(str(out))
    assert tuned.config.layer_types == start.config.layer_types and not tuned.config.use_qk_norm
    assert tuned.config.attention_chunk_size == 16  # --config_overrides reached the loaded model
    # Fine-tuned from the given weights: rows of tokens the tokenizer never produces (ids 384..511) get no gradient
    # (and no weight decay) and stay as they were; the rest moved.
    unused = slice(TOKENIZER_VOCAB, None)
    embed, embed0 = tuned.model.embed_tokens.weight, start.model.embed_tokens.weight
    assert torch.equal(embed[unused], embed0[unused])
    assert not torch.equal(embed[:TOKENIZER_VOCAB], embed0[:TOKENIZER_VOCAB])
    assert not torch.equal(
        tuned.model.layers[0].self_attn.dyn_w_proj.qkw, start.model.layers[0].self_attn.dyn_w_proj.qkw
    )

    second_run = script_args(out, tokenizer_dir, *common, "--max_steps", "6", model=model)
    output = run_cmd([sys.executable, str(SCRIPT), *second_run], env)
    assert "resuming from" in output and "checkpoint-4" in output
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 6
    assert [h["step"] for h in state["log_history"] if "loss" in h] == [1, 2, 3, 4, 5, 6]


# ----------------------------------------------------------------------------------------------------------------
# 6. Several processes (gloo on the CPU)
# ----------------------------------------------------------------------------------------------------------------
def test_two_process_ddp_with_accelerate_launch(tokenizer_dir, tmp_path):
    """`accelerate launch --config_file $(dcformer-train --print-accelerate-config multi_cpu_gloo)`: two CPU
    processes (DDP, gloo) train, the loss is finite and falls, DDP does not warn about unused parameters, and rank 0
    saves a model that loads."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "ddp"
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(ACCELERATE_DIR / "multi_cpu_gloo.yaml"), "--main_process_port", str(free_port()),
        str(SCRIPT),
        *script_args(out, tokenizer_dir, "--train_file", str(TRAIN_TXT), "--validation_file", str(VALID_TXT),
                     "--do_train", "--do_eval", "--max_steps", "12", "--per_device_train_batch_size", "4",
                     "--save_strategy", "no"),
    ]  # fmt: skip
    output = run_cmd(cmd, subprocess_env(tmp_path))
    assert "process rank 0 of 2" in output and "process rank 1 of 2" in output, output[-3000:]
    # the script tells DDP that every parameter is used (it is): no search for unused ones, and no warning
    assert "find_unused_parameters=True" not in output and "unused parameters" not in output
    assert "distributed distributed" in output
    state = json.loads((out / "trainer_state.json").read_text())
    losses = [h["loss"] for h in state["log_history"] if "loss" in h]
    assert len(losses) == 12 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]
    results = json.loads((out / "all_results.json").read_text())
    assert math.isfinite(results["eval_loss"]) and results["train_samples"] > 0
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert type(model).__name__ == "DCFormerForCausalLM"


def fsdp2_worker(out_dir):
    """Run by torchrun (2 processes): FSDP2 shards a tiny DCFormer, one unit per DCFormerDecoderLayer (the model's
    _no_split_modules, as accelerate's TRANSFORMER_BASED_WRAP does), trains 3 steps on half a batch each, and
    compares with the same 3 steps on the full batch in one process; rank 0 saves the gathered model."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    config = tiny_config(64)
    model = DCFormerForCausalLM(config).train()
    reference = DCFormerForCausalLM(config).train()
    reference.load_state_dict(model.state_dict())
    wrap = set(model._no_split_modules)
    units = [m for m in model.modules() if type(m).__name__ in wrap]
    assert len(units) == config.num_hidden_layers
    for unit in units:
        fully_shard(unit)
    fully_shard(model)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    # SGD: the comparison stays tight (Adam's normalisation blows up round-off in near-zero gradients)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    data = torch.randint(0, 64, (4, BLOCK), generator=torch.Generator().manual_seed(1))
    share = data.shape[0] // world
    losses, ref_losses = [], []
    for _ in range(3):
        mine = data[rank * share : (rank + 1) * share]
        loss = model(mine, labels=mine).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        ref_loss = reference(data, labels=data).loss
        ref_loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        ref_losses.append(ref_loss.item())
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        keys = sorted(full)
        diff = max((full[k] - reference.state_dict()[k]).abs().max().item() for k in keys)
        torch.save(reference.state_dict(), os.path.join(out_dir, "reference.pt"))
        DCFormerForCausalLM(config).save_pretrained(out_dir, state_dict=dict(full))
        with open(os.path.join(out_dir, "fsdp_result.json"), "w") as f:
            json.dump({"losses": losses, "ref_losses": ref_losses, "max_param_diff": diff, "keys": keys}, f)
    dist.barrier()
    dist.destroy_process_group()


def test_two_process_fsdp2_gloo(tmp_path):
    """accelerate enables FSDP only on accelerators (on the CPU it silently trains DDP, see the report in
    examples/train_clm.py's warning), and FSDP1 refuses the CPU; FSDP2 (fully_shard), which accelerate uses with
    fsdp_version 2, runs over gloo: sharded DCFormer training equals single-process training, and the gathered
    full state dict saves as a model that loads."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "fsdp"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(Path(__file__)), "fsdp2-worker", str(out)]  # fmt: skip
    run_cmd(cmd, subprocess_env(tmp_path))
    result = json.loads((out / "fsdp_result.json").read_text())
    assert result["losses"] == pytest.approx(result["ref_losses"], rel=1e-5, abs=1e-5)
    assert result["losses"][-1] < result["losses"][0]
    assert result["max_param_diff"] < 1e-5
    model = AutoModelForCausalLM.from_pretrained(str(out))
    reference = torch.load(out / "reference.pt")
    assert result["keys"] == sorted(model.state_dict()) == sorted(reference)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, reference[key], rtol=1e-5, atol=1e-5, msg=key)


# ----------------------------------------------------------------------------------------------------------------
# 7. Config files and the attributes engines read
# ----------------------------------------------------------------------------------------------------------------
def test_accelerate_configs_and_model_attributes():
    import yaml

    from modeling_dcformer import modeling_dcformer as mdc  # noqa: F401

    # What FSDP / DeepSpeed / device_map read from the model class.
    assert DCFormerForCausalLM._no_split_modules == ["DCFormerDecoderLayer"]
    assert isinstance(mdc.DCFormerDecoderLayer, type)
    assert DCFormerForCausalLM.supports_gradient_checkpointing
    for flag in ("_supports_flash_attn", "_supports_sdpa", "_supports_flex_attn"):
        assert getattr(DCFormerForCausalLM, flag) is False, flag  # DCMHA composes heads: no fused kernel applies

    fsdp = yaml.safe_load((ACCELERATE_DIR / "fsdp.yaml").read_text())
    assert fsdp["distributed_type"] == "FSDP"
    assert fsdp["fsdp_config"]["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert fsdp["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] in DCFormerForCausalLM._no_split_modules
    for stage in (2, 3):
        cfg = yaml.safe_load((ACCELERATE_DIR / f"deepspeed_zero{stage}.yaml").read_text())
        assert cfg["distributed_type"] == "DEEPSPEED"
        ds_file = ACCELERATE_DIR / cfg["deepspeed_config"]["deepspeed_config_file"]
        ds = json.loads(ds_file.read_text())
        assert ds["zero_optimization"]["stage"] == stage
        assert "optimizer" not in ds  # Trainer's torch optimizer: no DeepSpeed op to compile
        assert ds["train_micro_batch_size_per_gpu"] == "auto" and ds["bf16"]["enabled"] == "auto"
    assert json.loads((ACCELERATE_DIR / "ds_zero3.json").read_text())["zero_optimization"][
        "stage3_gather_16bit_weights_on_model_save"
    ]
    gloo = yaml.safe_load((ACCELERATE_DIR / "multi_cpu_gloo.yaml").read_text())
    assert gloo["num_processes"] == 2


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "fsdp2-worker":
    fsdp2_worker(sys.argv[2])
