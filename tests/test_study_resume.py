"""The longer study's driver (`dcformer_research.study`): the queue skips finished runs,
continues an interrupted run from its last complete checkpoint (and ends where an uninterrupted run ends), ignores
a half-written checkpoint, and chooses the rates of later phases by its written rule."""

import json
from pathlib import Path

import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, TrainerCallback, TrainingArguments

from dcformer_research import runner, study

pytestmark = pytest.mark.usefixtures("one_thread_per_module")

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "examples" / "data" / "harbour_train.txt"


class Interrupted(Exception):
    pass


class StopAt(TrainerCallback):
    """Raises (like a kill) after step `step` of the run whose checkpoint folder is `run`."""

    def __init__(self, run: str, step: int):
        self.run, self.step = run, step

    def on_step_end(self, args, state, control, **kwargs):
        if Path(args.output_dir).name == self.run and state.global_step == self.step:
            raise Interrupted(self.run)


class StartSteps(TrainerCallback):
    """Records (run, the global step training started from) for every run trained."""

    def __init__(self):
        self.starts = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.starts.append((Path(args.output_dir).name, state.global_step))


def tiny_spec(corpus: Path) -> dict:
    return {
        "common": ["--task", "lm", "--corpus", str(corpus), "--tokenizer", "byte", "--val-fraction", "0.25",
                   "--block-size", "32", "--batch-size", "4", "--val-size", "4", "--eval-every", "2", "--quiet"],
        "short_steps": 4,
        "long_steps": 8,
        "warmup_fraction": 0.1,
        "save_every": 2,
        "sizes": [[32, 2, 1]],
        "models": ["transformer", "dcformer"],
        "sweep": {"transformer": [1e-3], "dcformer": [1e-3]},
        "seeds": [0, 1],
        "grid": [1e-3],
        "import_from": None,
        "order": ["32:sweep", "32:long", "32:lower", "32:seeds"],
    }  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    lines = FIXTURE.read_text(encoding="utf-8").splitlines()
    for i in range(8):
        (folder / f"doc{i}.txt").write_text("\n".join(lines[i * 20 :][:20]) + "\n", encoding="utf-8")
    return folder


def test_interrupted_study_resumes_without_redoing_or_losing_work(tmp_path, corpus):
    spec, out = tiny_spec(corpus), tmp_path / "study"
    rid = lambda model, seed, steps: study.run_id(32, model, 1e-3, seed, steps)  # noqa: E731
    short_t, short, long_t, long0 = rid("transformer", 0, 4), rid("dcformer", 0, 4), rid("transformer", 0, 8), rid(
        "dcformer", 0, 8
    )
    with pytest.raises(Interrupted):  # killed at step 5 of the fourth run: its checkpoint of step 4 is complete
        study.run_study(out, spec, max_runs=10, extra_callbacks=(StopAt(long0, 5),))
    assert sorted(p.stem for p in (out / "runs").glob("*.json")) == sorted([short_t, short, long_t])
    assert (out / "ckpt" / long0 / "checkpoint-4" / study.STUDY_STATE).is_file()
    first = {i: (out / "runs" / f"{i}.json").read_bytes() for i in (short_t, short, long_t)}
    plan = json.loads((out / "plan.json").read_text())["plan"]
    assert [(e["id"], e["status"]) for e in plan] == [
        (short_t, "done"), (short, "done"), (long_t, "done"), (long0, "pending"), (rid("transformer", 1, 8), "pending"),
        (None, "waiting"),
    ]  # fmt: skip

    starts = StartSteps()
    assert study.run_study(out, spec, max_runs=10, extra_callbacks=(starts,)) == 3  # bounded: a rerun fails
    # the finished runs are not trained again; long0 continues at step 4
    assert starts.starts == [(long0, 4), (rid("transformer", 1, 8), 0), (rid("dcformer", 1, 8), 0)]
    assert all((out / "runs" / f"{i}.json").read_bytes() == first[i] for i in first)
    record = json.loads((out / "runs" / f"{long0}.json").read_text())["run"]
    assert record["resumed_from_step"] == 4
    assert [s for s, _ in record["curves"]["lm_loss"]] == [0, 2, 4, 6, 8]  # the evaluations before the kill kept
    assert [s for s, _ in record["train_seconds_at_step"]] == [0, 2, 4, 6, 8]
    assert all(a[1] < b[1] for a, b in zip(record["train_seconds_at_step"], record["train_seconds_at_step"][1:]))
    assert [s for s, _ in record["train_cpu_seconds_at_step"]] == [0, 2, 4, 6, 8]
    assert [e["step"] for e in record["dyn_norms"]] == [0, 2, 4, 6, 8]
    assert not (out / "ckpt" / long0).exists()
    assert all(e["status"] == "done" for e in json.loads((out / "plan.json").read_text())["plan"])
    assert study.run_study(out, spec) == 0  # nothing left

    # the report: the sweep, the long comparison (2 seeds) and the three-axis folder, seconds from a calibration
    calibration = {"step_seconds": {"32": {"transformer": 9.0, "dcformer": 9.0}},  # wall (loaded): not used
                   "step_cpu_seconds": {"32": {"transformer": 0.5, "dcformer": 1.0}}}
    (out / "calibration.json").write_text(json.dumps(calibration))
    text = study.write_study_report(out, spec)
    assert "| 32 | DCFormer | 1e-3 |".replace("1e-3", "0.001") in text and "(2 seeds)" in text
    folder = json.loads((out / "h32-long-dcformer" / "results.json").read_text())
    assert {tuple(p) for r in folder["runs"] for p in r["train_seconds_at_step"] if r["model"] == "dcformer"} == {
        (0, 0.0), (2, 2.0), (4, 4.0), (6, 6.0), (8, 8.0)
    }  # fmt: skip
    assert (out / "h32-long-dcformer" / "curves_axes.png").is_file()

    # the resumed run ends where the same run without the interruption ends
    fresh = study.train_entry(spec, {**json.loads((out / "runs" / f"{long0}.json").read_text())["entry"]},
                              tmp_path / "fresh")  # fmt: skip
    assert [s for s, _ in fresh["run"]["curves"]["lm_loss"]] == [0, 2, 4, 6, 8]
    resumed_losses = [v for _, v in record["curves"]["lm_loss"]]
    assert [v for _, v in fresh["run"]["curves"]["lm_loss"]] == pytest.approx(resumed_losses, rel=1e-3)


def test_half_written_checkpoint_is_ignored(tmp_path):
    good, bad = tmp_path / "checkpoint-2", tmp_path / "checkpoint-4"
    for folder in (good, bad):
        folder.mkdir()
        (folder / "trainer_state.json").write_text("{}")
    (good / study.STUDY_STATE).write_text("{}")  # bad: killed before its sidecar was written
    assert study.last_complete_checkpoint(tmp_path) == good
    assert not bad.exists()
    assert study.last_complete_checkpoint(tmp_path / "missing") is None


def fake(loss):
    return {"run": {"final": {"lm_loss": loss}}}


def test_plan_brackets_each_best_rate_and_waits_for_it():
    spec = study.default_spec()
    spec["sizes"], spec["models"], spec["seeds"] = [[512, 8, 3]], ["dcformer"], [0, 1]
    spec["sweep"] = {"dcformer": [3e-4, 1e-3]}
    spec["order"] = ["512:sweep", "512:long", "512:lower", "512:seeds"]
    plan = study.build_plan(spec, {})
    assert [(e["lr"], e["steps"], e["status"]) for e in plan] == [
        (3e-4, 150, "pending"), (1e-3, 150, "pending"), (None, 600, "waiting"), (None, 600, "waiting"),
        (None, 600, "waiting"),
    ]  # fmt: skip
    rid = lambda lr, steps, seed=0: study.run_id(512, "dcformer", lr, seed, steps)  # noqa: E731
    # the lowest rate is best: the sweep goes one grid step lower; a diverged run (NaN) ranks last
    results = {rid(3e-4, 150): fake(4.3), rid(1e-3, 150): fake(float("nan"))}
    plan = study.build_plan(spec, results)
    assert [e["lr"] for e in plan if e["steps"] == 150] == [1e-4, 3e-4, 1e-3]
    results[rid(1e-4, 150)] = fake(4.5)  # bracketed: 3e-4 is best, worse on both sides
    plan = study.build_plan(spec, results)
    long = [(e["lr"], e["seed"], e["status"]) for e in plan if e["steps"] == 600]
    assert long == [(3e-4, 0, "pending"), (1e-4, 0, "pending"), (None, 1, "waiting")]
    results[rid(3e-4, 600)], results[rid(1e-4, 600)] = fake(4.0), fake(4.0)  # a tie: the lower rate
    plan = study.build_plan(spec, results)
    assert [(e["lr"], e["seed"]) for e in plan if e["steps"] == 600] == [(3e-4, 0), (1e-4, 0), (1e-4, 1)]


def test_the_transformer_baseline_resumes_with_every_weight(tmp_path):
    """transformers 5 saves GPT-NeoX's `lm_head` as `embed_out`, and Trainer's own resume loaded the file under its
    saved names: the Transformer resumed with its output layer as initialised (a warning only). The study's trainer
    resumes it with every saved weight."""
    config = GPTNeoXConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=32, tie_word_embeddings=False)  # fmt: skip
    ids = torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]

    def trainer(model):
        args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, save_steps=2, per_device_train_batch_size=4,
                                 learning_rate=1e-2, report_to=[], use_cpu=True, disable_tqdm=True)  # fmt: skip
        return runner.MultiTaskTrainer(model=model, args=args, train_dataset=data, task_metrics={})

    torch.manual_seed(0)
    trained = GPTNeoXForCausalLM(config)
    trainer(trained).train()
    torch.manual_seed(1)
    resumed = GPTNeoXForCausalLM(config)
    assert not torch.equal(resumed.lm_head.weight, trained.lm_head.weight)
    trainer(resumed).train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))  # at max_steps: loads, trains none
    expected = trained.state_dict()
    for name, tensor in resumed.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_calibrating_some_sizes_keeps_the_others():
    """`study calibrate --sizes 256,512` after a calibration of 128, 256 and 512: 256 and 512 replaced, 128 kept as it
    was, and each size says when it was measured."""
    earlier = {"date": "day 1", "load_average_before": [1.0], "load_average_after": [1.1],
               "step_seconds": {s: {"transformer": 1.0, "dcformer": 2.0} for s in ("128", "256", "512")},
               "step_cpu_seconds": {s: {"transformer": 0.9, "dcformer": 1.9} for s in ("128", "256", "512")}}  # fmt: skip
    new = {"date": "day 2", "load_average_before": [0.1], "load_average_after": [0.2],
           "step_seconds": {s: {"transformer": 3.0, "dcformer": 4.0} for s in ("256", "512")},
           "step_cpu_seconds": {s: {"transformer": 2.9, "dcformer": 3.9} for s in ("256", "512")}}  # fmt: skip
    merged = study.merge_calibration(earlier, new)
    assert merged["step_seconds"]["128"] == {"transformer": 1.0, "dcformer": 2.0}
    assert merged["step_cpu_seconds"]["128"] == {"transformer": 0.9, "dcformer": 1.9}
    assert merged["step_seconds"]["256"] == merged["step_seconds"]["512"] == {"transformer": 3.0, "dcformer": 4.0}
    assert merged["measured"]["128"]["date"] == "day 1" and merged["measured"]["512"]["date"] == "day 2"
    assert merged["date"] == "day 2"
    again = study.merge_calibration(merged, {**new, "date": "day 3"})  # a third calibration keeps 128's own date
    assert again["measured"]["128"]["date"] == "day 1" and again["measured"]["256"]["date"] == "day 3"
    assert study.merge_calibration(None, new)["step_seconds"] == new["step_seconds"]


def test_calibration_interleaves_the_models_step_by_step(monkeypatch):
    """`calibrate` times `steps * rounds` steps of each model after `warmup` each, one step of each model in turn
    (T, DC, DC-qk, T, ...), so that a change of load hits all three alike; it reports a median per model."""
    calls = []

    class Recorder(torch.nn.Module):
        def __init__(self, kind):
            super().__init__()
            self.kind, self.weight = kind, torch.nn.Parameter(torch.ones(1))

        def forward(self, input_ids, labels, use_cache):
            calls.append(self.kind)
            return type("Out", (), {"loss": (self.weight * input_ids.float().mean()).sum()})()

    configs = {"transformer": "T", "dcformer": "DC", "dcformer-qk": "DCqk"}
    monkeypatch.setattr(study, "calibration_configs", lambda *shape: configs)
    monkeypatch.setattr(study, "build_model", lambda kind, config: (Recorder(config), None))
    result = study.calibrate(Path("."), [128], steps=2, warmup=1, rounds=2)
    assert calls == ["T", "DC", "DCqk"] * 5
    assert set(result["step_seconds"]["128"]) == set(configs) and result["interleaved"] == "step"
    assert all(v >= 0 for v in result["step_cpu_seconds"]["128"].values())
