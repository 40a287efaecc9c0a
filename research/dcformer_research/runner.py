"""One training run of the small comparison (`examples/compare_small.py`) and the data it trains on.

`train_one` trains one model (`ablation.build_model`) with the stock `transformers.Trainer`: the same
`TrainingArguments` for every model (`training_arguments`), a step timer, and for the DCFormer models the RMS of
the dynamic composition terms on a fixed probe batch (`DynamicNormsCallback`). `prepare_lm` / `prepare_synthetic`
build the data (the same stream for every model and seed) and the parts of the report's setup they know.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from transformers import PreTrainedModel, Trainer, TrainerCallback, TrainingArguments, set_seed
from transformers.utils import SAFE_WEIGHTS_NAME

from modeling_dcformer.modeling_dcformer import DynamicWeightProjection
from .ablation import SLOT_NAMES, StaticComposition, build_model
from .lm_corpus import BlockDataset, bits_per_byte, load_corpus, predicted_bytes_per_token
from .report import write_atomic
from .synthetic_tasks import PadCollator, SyntheticDataset, TaskConfig, TaskVocab

TIMING_SKIP_STEPS = 5  # the first steps pay for compilation and warm caches: left out of tokens/s


def difficulty_of(row_ids: np.ndarray, task: str, vocab: TaskVocab) -> int:
    if task == "mqar":  # BOS, n (key, value) pairs, then the separator
        return (int(np.flatnonzero(row_ids == vocab.sep_id)[0]) - 1) // 2
    return int((row_ids == vocab.dot_id).sum())  # two-hop: one '.' per fact


def make_compute_metrics(task: str, vocab: TaskVocab, task_config: TaskConfig):
    lo, hi = task_config.difficulty_range(task)
    middle = (lo + hi) / 2

    def compute_metrics(eval_pred) -> dict:
        preds, labels, inputs = eval_pred.predictions, eval_pred.label_ids, eval_pred.inputs
        # the prediction for token i is the argmax of the logits at position i - 1
        preds, labels, inputs = preds[:, :-1], labels[:, 1:], inputs
        answer = labels != -100
        right = (preds == labels) & answer
        n_answers, n_right = answer.sum(1), right.sum(1)
        keep = n_answers > 0  # rows padded in by the evaluation loop have no answers
        difficulty = np.array([difficulty_of(inputs[r], task, vocab) if keep[r] else 0 for r in range(len(inputs))])
        easy, hard = keep & (difficulty <= middle), keep & (difficulty > middle)

        def acc(rows):
            return float(n_right[rows].sum() / max(n_answers[rows].sum(), 1))

        return {
            "accuracy": acc(keep),
            "seq_accuracy": float((n_right[keep] == n_answers[keep]).mean()),
            "accuracy_easy": acc(easy),
            "accuracy_hard": acc(hard),
        }

    return compute_metrics


def argmax_logits(logits, labels):
    if isinstance(logits, tuple):
        logits = logits[0]
    return logits.argmax(-1)


# ----------------------------------------------------------------------------------------------------------------
# One training run


def training_arguments(
    args, seed: int, output_dir: str, lr: float | None = None, save_every: int | None = None, resuming: bool = False
) -> TrainingArguments:
    """The one TrainingArguments of a comparison: identical for every model apart from the run's directory (and
    the learning rate, when `--dc-lr` or `--lr-sweep` gives each model its own). `save_every`: a checkpoint every
    that many steps (the two most recent kept), for runs that resume after an interruption (`experiments.study`);
    `resuming`: no evaluation at the start (the checkpoint's log already holds the one of its step)."""
    return TrainingArguments(
        output_dir=output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.eval_batch_size,
        learning_rate=args.lr if lr is None else lr,
        lr_scheduler_type=args.schedule,
        warmup_steps=args.warmup,
        weight_decay=args.weight_decay,
        adam_beta1=0.9,
        adam_beta2=0.95,
        max_grad_norm=1.0,
        eval_strategy="steps",
        eval_steps=args.eval_every,
        eval_on_start=not resuming,
        logging_strategy="steps",
        logging_steps=args.eval_every,
        save_strategy="steps" if save_every else "no",
        save_steps=save_every or 500,
        save_total_limit=2 if save_every else None,
        report_to="none",
        seed=seed,
        data_seed=args.data_seed,
        train_sampling_strategy="sequential",  # the stream is in its seeded order already; the same for every run
        remove_unused_columns=False,
        label_names=["labels"],
        include_for_metrics=["inputs"],
        dataloader_num_workers=0,
        use_cpu=args.device == "cpu",
        bf16=args.bf16,
        disable_tqdm=args.quiet,
    )


class StepTimer(TrainerCallback):
    """Wall time of each optimizer step, evaluations excluded (the Trainer evaluates after `on_step_end`), and the
    CPU time this process spent in it (`time.process_time`: on a machine shared with other jobs, close to what the
    step would take on a quiet core when the process runs one thread)."""

    def __init__(self):
        self.seconds: list[float] = []
        self.cpu_seconds: list[float] = []
        self._start = self._cpu_start = None

    def on_step_begin(self, args, state, control, **kwargs):
        self._start, self._cpu_start = time.perf_counter(), time.process_time()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self._start)
        self.cpu_seconds.append(time.process_time() - self._cpu_start)

    def steady_seconds(self) -> list[float]:
        return self.seconds[TIMING_SKIP_STEPS:] if len(self.seconds) > 2 * TIMING_SKIP_STEPS else self.seconds


class DynamicNormsCallback(TrainerCallback):
    """The size of the dynamic terms over training: at step 0 and every `every` steps, the RMS of w2 (the
    input-dependent weights of the low-rank terms; w1 is RMS-normalised) and of the tanh diagonal, per composition
    slot, averaged over layers and over a fixed probe batch."""

    def __init__(self, probe_ids: torch.Tensor, every: int):
        self.probe_ids, self.every = probe_ids, every
        self.history: list[dict] = []
        self.seconds = 0.0

    def record(self, model, step: int) -> None:
        start = time.perf_counter()
        projections = [m for m in model.modules() if isinstance(m, (DynamicWeightProjection, StaticComposition))]
        outputs = []
        hooks = [
            p.register_forward_hook(lambda mod, inp, out: outputs.append(out.detach().float())) for p in projections
        ]
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                model(input_ids=self.probe_ids.to(next(model.parameters()).device), use_cache=False)
        finally:
            for hook in hooks:
                hook.remove()
            model.train(was_training)
        terms = torch.stack(outputs)  # [layers, B, T, G, C, 2I+1, M]
        rank = (terms.shape[-2] - 1) // 2
        entry = {"step": step, "w2": {}, "dd": {}}
        for c, slot in enumerate(SLOT_NAMES[terms.shape[4]]):
            entry["w2"][slot] = terms[:, :, :, :, c, rank : 2 * rank].pow(2).mean().sqrt().item()
            entry["dd"][slot] = terms[:, :, :, :, c, 2 * rank].pow(2).mean().sqrt().item()
        self.history.append(entry)
        self.seconds += time.perf_counter() - start

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if not self.history:  # a resumed run has its history from the checkpoint
            self.record(model, 0)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every == 0 or state.global_step == state.max_steps:
            self.record(model, state.global_step)


STUDY_STATE = "study_state.json"  # beside each checkpoint: what the Trainer's state does not hold


class CheckpointSidecar(TrainerCallback):
    """After each checkpoint is saved, writes what a resumed run needs beyond the Trainer's own state into it: the
    step times so far, the dynamic-term history and the training wall time. Written last (atomically), so its
    presence marks a complete checkpoint."""

    def __init__(self, timer: "StepTimer", norms, seconds_before: float):
        self.timer, self.norms, self.seconds_before = timer, norms, seconds_before
        self.start = time.perf_counter()

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        payload = {
            "global_step": state.global_step,
            "step_seconds": self.timer.seconds,
            "step_cpu_seconds": self.timer.cpu_seconds,
            "dyn_norms": self.norms.history if self.norms else None,
            "train_seconds": self.seconds_before + time.perf_counter() - self.start,
        }
        write_atomic(folder / STUDY_STATE, json.dumps(payload))


def last_complete_checkpoint(folder: Path) -> Path | None:
    """The newest `checkpoint-N` under `folder` that holds the Trainer's state and our sidecar (both written after
    the weights and the optimizer); incomplete ones (an interruption while saving) are deleted."""
    if not folder.is_dir():
        return None
    found = sorted(
        (p for p in folder.glob("checkpoint-*") if p.is_dir() and p.name.split("-")[-1].isdigit()),
        key=lambda p: int(p.name.split("-")[-1]),
    )
    complete = [p for p in found if (p / "trainer_state.json").is_file() and (p / STUDY_STATE).is_file()]
    for p in found:
        if p not in complete:
            shutil.rmtree(p, ignore_errors=True)
    return complete[-1] if complete else None


def train_one(
    kind: str,
    seed: int,
    lr: float,
    args,
    configs: dict,
    data: dict,
    workdir: str,
    checkpoint_dir: str | None = None,
    save_every: int | None = None,
    extra_callbacks: tuple = (),
) -> dict:
    """One training run. With `checkpoint_dir` and `save_every`, the run checkpoints into `checkpoint_dir` every
    `save_every` steps and, if a complete checkpoint is there already, continues from it (model, optimizer,
    schedule, RNG, data position, logs, step times) instead of starting again."""
    set_seed(seed)  # the initialisation: same seed for every model
    model, n_params = build_model(kind, configs[kind])
    timer = StepTimer()
    callbacks = [timer]
    norms = None
    if kind != "transformer":
        norms = DynamicNormsCallback(data["probe_ids"], args.eval_every)
        callbacks.append(norms)
    resume, seconds_before = None, 0.0
    output_dir = str(Path(workdir) / f"{kind}-seed{seed}-lr{lr:g}")
    if checkpoint_dir is not None and save_every:
        output_dir = checkpoint_dir
        resume = last_complete_checkpoint(Path(checkpoint_dir))
        if resume is not None:
            saved = json.loads((resume / STUDY_STATE).read_text())
            timer.seconds = list(saved["step_seconds"])
            timer.cpu_seconds = list(saved.get("step_cpu_seconds") or [])
            if norms is not None and saved["dyn_norms"]:
                norms.history = saved["dyn_norms"]
            seconds_before = saved["train_seconds"]
            print(f"resuming from {resume} (step {saved['global_step']})", flush=True)
        callbacks.append(CheckpointSidecar(timer, norms, seconds_before))
    callbacks.extend(extra_callbacks)
    trainer = MultiTaskTrainer(
        model=model,
        args=training_arguments(args, seed, output_dir, lr, save_every, resuming=resume is not None),
        train_dataset=data["train"],
        eval_dataset=data["validation"],
        data_collator=data["collator"],
        preprocess_logits_for_metrics=argmax_logits,
        task_metrics=data["metrics"],
        callbacks=callbacks,
    )
    start = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=str(resume) if resume is not None else None)
    seconds = seconds_before + time.perf_counter() - start
    history = {}
    for entry in trainer.state.log_history:
        for key, value in entry.items():
            if key.startswith("eval_") and key.count("_") >= 2 and not key.endswith(("_runtime", "_per_second")):
                history.setdefault(key[len("eval_") :], {})[entry["step"]] = value
    curves = {name: sorted(points.items()) for name, points in history.items()}
    if "lm_loss" in curves:
        curves["lm_perplexity"] = [(s, math.exp(min(v, 50.0))) for s, v in curves["lm_loss"]]
        curves["lm_bits_per_byte"] = [(s, bits_per_byte(v, data["bytes_per_token"])) for s, v in curves["lm_loss"]]
    final = {name: points[-1][1] for name, points in curves.items()}
    train_losses = [(e["step"], e["loss"]) for e in trainer.state.log_history if "loss" in e]
    step_seconds = statistics.median(timer.steady_seconds())
    # the wall-clock axis: training seconds (evaluations excluded) spent up to each evaluated step
    elapsed = [0.0]
    for value in timer.seconds:
        elapsed.append(elapsed[-1] + value)
    eval_steps = sorted({s for points in curves.values() for s, _ in points})
    seconds_at_step = [(s, elapsed[min(s, len(elapsed) - 1)]) for s in eval_steps]
    cpu_elapsed = [0.0]
    for value in timer.cpu_seconds:
        cpu_elapsed.append(cpu_elapsed[-1] + value)
    cpu_at_step = [(s, cpu_elapsed[min(s, len(cpu_elapsed) - 1)]) for s in eval_steps]
    del trainer, model
    return {
        "model": kind,
        "seed": seed,
        "lr": lr,
        "parameters": n_params,
        "train_seconds": seconds,
        "train_runtime": result.metrics.get("train_runtime"),
        "step_seconds_median": step_seconds,
        "train_seconds_at_step": seconds_at_step,
        "train_cpu_seconds_at_step": cpu_at_step,
        "step_cpu_seconds_median": statistics.median(timer.cpu_seconds[TIMING_SKIP_STEPS:] or timer.cpu_seconds)
        if timer.cpu_seconds
        else None,
        "tokens_per_second": data["tokens_per_step"] / step_seconds,
        "final_train_loss": train_losses[-1][1] if train_losses else None,
        "train_loss_curve": train_losses,
        "curves": curves,
        "final": final,
        "dyn_norms": norms.history if norms else None,
        "resumed_from_step": int(resume.name.split("-")[-1]) if resume is not None else None,
    }


class MultiTaskTrainer(Trainer):
    """The stock Trainer; only routes each validation set to its task's metric function (the evaluation loop
    passes no dataset name to `compute_metrics`)."""

    def __init__(self, *args, task_metrics: dict, **kwargs):
        super().__init__(*args, **kwargs)
        self._task_metrics = task_metrics

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
        target = self.eval_dataset if eval_dataset is None else eval_dataset
        if not isinstance(target, dict):  # one task's set: by name (from the dict loop) or as a dataset
            task = eval_dataset if isinstance(eval_dataset, str) else metric_key_prefix.rsplit("_", 1)[-1]
            self.compute_metrics = self._task_metrics.get(task)
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Trainer's resume loads the file's tensors under their saved names, but transformers 5 saves some models
        under other names than their modules' (GPT-NeoX's `lm_head` is written as `embed_out`): the Transformer
        baseline resumed with its output layer as initialised, and only a warning. Where the names differ, the
        weights come through `from_pretrained` (which renames them) and every tensor is required."""
        model = self.model if model is None else model
        weights = Path(resume_from_checkpoint) / SAFE_WEIGHTS_NAME
        if isinstance(model, PreTrainedModel) and weights.is_file():
            with safe_open(weights, "pt") as f:
                saved_names = set(f.keys())
            every = {name for name, _ in model.named_parameters(remove_duplicate=False)}
            tied = every - dict(model.named_parameters()).keys()  # saved once, under the other name
            if set(model.state_dict()) - tied - saved_names:
                dtype = next(model.parameters()).dtype
                saved = type(model).from_pretrained(resume_from_checkpoint, config=model.config, dtype=dtype)
                model.load_state_dict(saved.state_dict(), strict=True)
                return
        super()._load_from_checkpoint(resume_from_checkpoint, model)


# ----------------------------------------------------------------------------------------------------------------
# Aggregation and reports




_CORPORA: dict = {}  # one tokenised corpus per (paths, tokenizer, vocabulary, split) in a process (--sizes)


def prepare_lm(args) -> tuple[dict, dict]:
    key = (tuple(args.corpus or ()), args.tokenizer, args.bpe_vocab, args.val_fraction)
    if key not in _CORPORA:
        try:
            _CORPORA[key] = load_corpus(args.corpus, args.tokenizer, args.bpe_vocab, args.val_fraction)
        except (FileNotFoundError, ValueError) as err:
            raise SystemExit(f"compare_small.py: error: --corpus: {err}") from None
    corpus = _CORPORA[key]
    size = args.steps * args.batch_size
    try:
        train = BlockDataset(corpus.train_ids, args.block_size, size, seed=args.data_seed)
        validation = BlockDataset(corpus.val_ids, args.block_size, args.val_size)
    except ValueError as err:
        raise SystemExit(f"compare_small.py: error: --block-size / --val-size: {err}") from None
    bytes_per_token = predicted_bytes_per_token(validation, corpus.tokenizer.bytes_per_token())
    summary = corpus.summary()
    print(
        f"corpus: {summary['train_documents']} + {summary['val_documents']} documents, {summary['tokenizer']} "
        f"tokens (vocabulary {summary['vocab_size']}), {summary['train_tokens']:,} training tokens in "
        f"{train.num_blocks:,} blocks of {args.block_size}; {size:,} blocks a run "
        f"({size / train.num_blocks:.2f} epochs)"
    )
    collator = PadCollator(pad_id=0)
    data = {
        "train": train,
        "validation": {"lm": validation},
        "collator": collator,
        "metrics": {},
        "probe_ids": collator([validation[i] for i in range(min(4, len(validation)))])["input_ids"],
        "tokens_per_step": args.batch_size * args.block_size,
        "bytes_per_token": bytes_per_token,
    }
    setup = {
        "vocab_size": -(-corpus.vocab_size // 8) * 8,
        "max_position_embeddings": args.block_size,
        "corpus": summary,
        "block_size": args.block_size,
        "train_tokens": size * args.block_size,
        "train_epochs": size / train.num_blocks,
        "val_tokens": len(validation) * args.block_size,
        "bytes_per_predicted_token": bytes_per_token,
    }
    return data, setup


def prepare_synthetic(args) -> tuple[dict, dict]:
    vocab = TaskVocab(args.task_config)
    max_len = max(args.task_config.max_length(t) for t in args.tasks)
    size = args.steps * args.batch_size
    train = SyntheticDataset(args.tasks, size, args.data_seed, "train", vocab)
    validation = {t: SyntheticDataset([t], args.val_size, args.data_seed, "validation", vocab) for t in args.tasks}
    train_tokens = answer_tokens = 0
    for i in range(size):
        example = train[i]
        train_tokens += len(example["input_ids"])
        answer_tokens += sum(label != -100 for label in example["labels"])
    for t in args.tasks:
        print(f"example {t}: {vocab.decode(validation[t][0]['input_ids'])}")
    print(f"training: {size:,} sequences, {train_tokens:,} tokens ({answer_tokens:,} answers), the same for every run")
    collator = PadCollator(pad_id=vocab.pad_id)
    first = validation[args.tasks[0]]
    data = {
        "train": train,
        "validation": validation,
        "collator": collator,
        "metrics": {task: make_compute_metrics(task, vocab, args.task_config) for task in args.tasks},
        "probe_ids": collator([first[i] for i in range(min(4, len(first)))])["input_ids"],
        "tokens_per_step": train_tokens / args.steps,
        "bytes_per_token": None,
    }
    setup = {
        "vocab_size": vocab.model_vocab_size,
        "symbols": len(vocab),
        "max_position_embeddings": -(-max_len // 8) * 8,
        "task_config": {k: v for k, v in vars(args.task_config).items()},
        "train_tokens": train_tokens,
        "train_answer_tokens": answer_tokens,
    }
    return data, setup


# ----------------------------------------------------------------------------------------------------------------
