"""dcformer_research (synthetic_tasks, ablation, runner, report) and examples/compare_small.py:
the generated answers are right and unique
(checked by brute-force solvers written here, independent of the generators), deterministic, masked except the
answers; the two models' parameter counts match; the whole comparison runs end to end."""

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

from modeling_dcformer import DCFormerForCausalLM
from dcformer_research import compare as compare_small  # examples/compare_small.py's command line
from dcformer_research.ablation import GPTNeoXForCausalLM, matched_configs
from dcformer_research.report import reach_step
from dcformer_research.runner import make_compute_metrics
from dcformer_research.synthetic_tasks import (
    IGNORE_INDEX,
    PadCollator,
    SyntheticDataset,
    TaskConfig,
    TaskVocab,
    mqar_example,
    twohop_example,
)

torch.set_num_threads(1)
N_CHECK = 1500


def names(vocab, ids):
    return [vocab.names[i] for i in ids]


def solve_mqar(vocab, ids):
    """Brute force from the token names alone: the pairs before '|', then every (query key, answer) after it.
    Returns [(answer position, expected value)] and checks every queried key occurs exactly once in the pairs."""
    toks = names(vocab, ids)
    assert toks[0] == "<|endoftext|>"
    sep = toks.index("|")
    assert toks.count("|") == 1
    pairs = toks[1:sep]
    assert len(pairs) % 2 == 0
    keys, values = pairs[0::2], pairs[1::2]
    assert all(k.startswith("k") for k in keys) and all(v.startswith("v") for v in values)
    queries = toks[sep + 1 :]
    answers = []
    for j in range(0, len(queries), 2):
        key, shown = queries[j], queries[j + 1]
        hits = [i for i, k in enumerate(keys) if k == key]
        assert len(hits) == 1, f"key {key} occurs {len(hits)} times among the pairs"
        assert shown == values[hits[0]]
        answers.append((sep + 1 + j + 1, vocab.ids[values[hits[0]]]))
    return answers, len(keys), [queries[j] for j in range(0, len(queries), 2)]


def solve_twohop(vocab, ids):
    """Brute force: read the facts 'h R t .', then for every query '? x R1 R2 =' enumerate all paths
    x -R1-> y -R2-> z over the facts as a list (no dict: duplicates would show). Returns
    [(answer position, the unique z)] and the facts."""
    toks = names(vocab, ids)
    assert toks[0] == "<|endoftext|>"
    facts, i = [], 1
    while toks[i] != "?":
        h, r, t, dot = toks[i : i + 4]
        assert h.startswith("e") and r.startswith("R") and t.startswith("e") and dot == "."
        facts.append((h, r, t))
        i += 4
    answers = []
    while i < len(toks):
        q, x, r1, r2, eq, shown = toks[i : i + 6]
        assert q == "?" and eq == "=" and x.startswith("e") and r1.startswith("R") and r2.startswith("R")
        paths = [(y, z) for (h1, ra, y) in facts if (h1, ra) == (x, r1) for (h2, rb, z) in facts if (h2, rb) == (y, r2)]
        assert len(paths) == 1, f"query {x} {r1} {r2}: {len(paths)} paths in {facts}"
        assert shown == paths[0][1]
        answers.append((i + 5, vocab.ids[paths[0][1]]))
        i += 6
    return answers, facts


def check_labels(example, answers):
    ids, labels = example["input_ids"], example["labels"]
    assert len(ids) == len(labels)
    expected = [IGNORE_INDEX] * len(ids)
    for pos, value in answers:
        expected[pos] = value
        assert ids[pos] == value  # labels hold the token itself; the models shift
    assert labels == expected  # -100 everywhere except the answers


@pytest.fixture(scope="module")
def vocab():
    return TaskVocab(TaskConfig())


def test_mqar_answers_are_correct_and_unique(vocab):
    rng = random.Random(0)
    seen_pairs = set()
    for _ in range(N_CHECK):
        example = mqar_example(rng, vocab)
        answers, n_pairs, queried = solve_mqar(vocab, example["input_ids"])
        check_labels(example, answers)
        assert example["difficulty"] == n_pairs == len(answers)
        assert sorted(queried) == sorted(names(vocab, example["input_ids"][1 : 1 + 2 * n_pairs : 2]))  # each key once
        assert len(example["input_ids"]) <= vocab.config.max_length("mqar")
        seen_pairs.add(n_pairs)
    lo, hi = vocab.config.mqar_pairs
    assert seen_pairs == set(range(lo, hi + 1))  # the whole difficulty mixture occurs


def test_twohop_answers_are_unique_with_distractors(vocab):
    rng = random.Random(1)
    n_facts_seen, decoy_head, decoy_middle, decoy_chain = set(), 0, 0, 0
    for _ in range(N_CHECK):
        example = twohop_example(rng, vocab)
        answers, facts = solve_twohop(vocab, example["input_ids"])
        check_labels(example, answers)
        assert example["difficulty"] == len(facts)
        assert len(answers) == vocab.config.twohop_queries
        assert len(example["input_ids"]) <= vocab.config.max_length("twohop")
        n_facts_seen.add(len(facts))
        toks = names(vocab, example["input_ids"])
        start = 1 + 4 * len(facts)
        for i in range(start, len(toks), 6):
            x, r1, r2 = toks[i + 1 : i + 4]
            (y,) = [t for h, r, t in facts if (h, r) == (x, r1)]
            decoy_head += any(h == x and r != r1 for h, r, _ in facts)
            decoy_middle += any(h == y and r != r2 for h, r, _ in facts)
            decoy_chain += any(
                h != x and r == r1 and any(h2 == t and rb == r2 for h2, rb, _ in facts) for h, r, t in facts
            )
    lo, hi = vocab.config.twohop_facts
    assert n_facts_seen == set(range(lo, hi + 1))
    # every kind of distractor occurs often: the answer needs x, R1 and R2, not just "a chain from x"
    queries = N_CHECK * vocab.config.twohop_queries
    assert min(decoy_head, decoy_middle, decoy_chain) > queries * 0.2, (decoy_head, decoy_middle, decoy_chain)


def test_generators_hold_for_other_sizes():
    config = TaskConfig(
        mqar_keys=16,
        mqar_values=4,
        mqar_pairs=(16, 16),
        twohop_entities=33,
        twohop_relations=2,
        twohop_facts=(6, 12),
        twohop_queries=3,
    )  # the fewest entities allowed
    small = TaskVocab(config)
    rng = random.Random(2)
    for _ in range(300):
        example = mqar_example(rng, small)
        check_labels(example, solve_mqar(small, example["input_ids"])[0])
        example = twohop_example(rng, small)
        check_labels(example, solve_twohop(small, example["input_ids"])[0])


def test_bad_task_configs_are_refused():
    with pytest.raises(ValueError, match="distinct keys"):
        TaskConfig(mqar_keys=8, mqar_pairs=(4, 16))
    with pytest.raises(ValueError, match="LO-HI"):
        TaskConfig(mqar_pairs="4-x")
    with pytest.raises(ValueError, match="entities"):
        TaskConfig(twohop_entities=10)
    with pytest.raises(ValueError, match="at least 2 relations"):
        TaskConfig(twohop_relations=1)


def test_dataset_is_deterministic_and_splits_differ(vocab):
    a = SyntheticDataset(["mqar", "twohop"], 50, 7, "train", vocab)
    b = SyntheticDataset(["mqar", "twohop"], 50, 7, "train", vocab)
    assert [a[i] for i in range(50)] == [b[i] for i in reversed(range(50))][::-1]  # any access order
    assert [a[i]["task"] for i in range(4)] == ["mqar", "twohop", "mqar", "twohop"]
    other_seed = SyntheticDataset(["mqar", "twohop"], 50, 8, "train", vocab)
    validation = SyntheticDataset(["mqar", "twohop"], 50, 7, "validation", vocab)
    assert all(a[i]["input_ids"] != other_seed[i]["input_ids"] for i in range(50))
    train_set = {
        tuple(SyntheticDataset(["mqar", "twohop"], 2000, 7, "train", vocab)[i]["input_ids"]) for i in range(2000)
    }
    assert not any(tuple(validation[i]["input_ids"]) in train_set for i in range(50))  # held out
    with pytest.raises(ValueError, match="unknown task"):
        SyntheticDataset(["nope"], 5, 0, "train", vocab)


def test_collator_pads_right_and_masks(vocab):
    data = SyntheticDataset(["mqar", "twohop"], 4, 0, "train", vocab)
    batch = PadCollator(pad_id=vocab.pad_id)([data[i] for i in range(4)])
    assert set(batch) == {"input_ids", "labels"}
    assert batch["input_ids"].shape[1] % 8 == 0
    for row in range(4):
        n = len(data[row]["input_ids"])
        assert batch["input_ids"][row, :n].tolist() == data[row]["input_ids"]
        assert (batch["input_ids"][row, n:] == vocab.pad_id).all() and (batch["labels"][row, n:] == IGNORE_INDEX).all()


def test_parameter_counts_match_for_default_shape(capsys):
    args = compare_small.parse_args([])
    vocab = TaskVocab(args.task_config)
    neox, dc, info = matched_configs(args.shape_dict, vocab.model_vocab_size, 72)
    assert abs(info["relative_difference"]) <= 0.02
    assert info["transformer_params"] == sum(p.numel() for p in GPTNeoXForCausalLM(neox).parameters())
    assert info["dcformer_params"] == sum(p.numel() for p in DCFormerForCausalLM(dc).parameters())
    # same shape apart from the Transformer's MLP, widened only to pay for DCMHA's parameters
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        assert getattr(neox, key) == getattr(dc, key)
    assert (
        neox.rotary_pct == 0.25
        if hasattr(neox, "rotary_pct")
        else neox.rope_parameters["partial_rotary_factor"] == 0.25
    )
    assert dc.partial_rotary_factor == 0.25 and dc.use_parallel_residual and neox.use_parallel_residual
    assert dc.intermediate_size == 512 <= neox.intermediate_size
    # identical shapes are 4.9% apart at hidden 128 / 4 heads: refused loudly
    with pytest.raises(ValueError, match="differ by"):
        matched_configs(args.shape_dict, vocab.model_vocab_size, 72, param_match="none")
    # a Pythia-70m-shaped pair is within 2% with identical shapes
    shape = compare_small.parse_args(["--shape", "dcpythia-pythia-70m"]).shape_dict
    neox, dc, info = matched_configs(shape, 50304, 2048, param_match="none")
    assert neox.intermediate_size == dc.intermediate_size == 2048 and abs(info["relative_difference"]) < 0.02


def test_metrics_on_known_predictions(vocab):
    data = SyntheticDataset(["mqar"], 3, 0, "validation", vocab)
    batch = PadCollator()([data[i] for i in range(3)])
    ids, labels = batch["input_ids"].numpy(), batch["labels"].numpy()
    perfect = np.concatenate([ids[:, 1:], ids[:, :1]], axis=1)  # logits at i predict token i + 1
    metric = make_compute_metrics("mqar", vocab, vocab.config)

    class Pred:
        predictions, label_ids, inputs = perfect, labels, ids

    assert metric(Pred)["accuracy"] == 1.0 and metric(Pred)["seq_accuracy"] == 1.0
    Pred.predictions = np.zeros_like(perfect)
    assert metric(Pred)["accuracy"] == 0.0
    assert reach_step([(0, 4.0), (10, 2.0), (20, 1.0)], 3.0) == 5.0
    assert reach_step([(0, 4.0), (10, 2.0)], 1.0) is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seeds", "0"], "--seeds"),
        (["--tasks", "mqar,foo"], "--tasks"),
        (["--heads", "3"], "divisible"),
        (["--warmup", "900"], "--warmup"),
        (["--steps", "-5"], "positive integer"),
        (["--shape", "no-such-preset"], "--shape"),
        (["--mqar-pairs", "4-100"], "distinct keys"),
        (["--dc-overrides", "hidden_size=64"], "shared shape"),
        (["--window-type", "LGLL"], "give --window too"),
        (["--task", "lm", "--window", "128", "--block-size", "128"], "smaller than --block-size"),
        (["--qk-norm", "--dc-overrides", "use_qk_norm=false"], "but --qk-norm says True"),
        (["--lr-sweep", "1e-3"], "at least two distinct"),
        (["--sizes", "128"], "HIDDEN/HEADS"),
        (["--sizes", "128/4", "--hidden", "64"], "leave out --shape, --hidden"),
        (["--ablation", "--models", "dcformer"], "leave out --models"),
        (["--task", "lm", "--tasks", "mqar"], "does not apply to --task lm"),
        (["--corpus", "x.txt"], "--corpus is for --task lm"),
    ],
)
def test_bad_flags_give_clear_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        compare_small.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_smoke_run_writes_table_json_and_png(tmp_path):
    out = tmp_path / "cmp"
    report = compare_small.main(
        [
            "--steps",
            "10",
            "--eval-every",
            "5",
            "--warmup",
            "1",
            "--seeds",
            "2",
            "--batch-size",
            "8",
            "--val-size",
            "8",
            "--hidden",
            "32",
            "--layers",
            "1",
            "--heads",
            "2",
            "--mqar-pairs",
            "2-4",
            "--twohop-facts",
            "4-6",
            "--quiet",
            "--out",
            str(out),
        ]
    )
    for name in ("results.md", "results.json", "curves.png"):
        assert (out / name).stat().st_size > 0
    data = json.loads((out / "results.json").read_text())
    assert len(data["runs"]) == 4 and {r["model"] for r in data["runs"]} == {"transformer", "dcformer"}
    for kind in ("transformer", "dcformer"):
        for task in ("mqar", "twohop"):
            stats = data["aggregate"]["models"][kind][task]
            assert stats["loss"]["n"] == 2 and np.isfinite(stats["loss"]["mean"])
            assert 0.0 <= stats["accuracy"]["mean"] <= 1.0
    for run in data["runs"]:
        assert [s for s, _ in run["curves"]["mqar_loss"]] == [0, 5, 10]
    # same data, same init seed: the two seeds of a model differ, the runs are otherwise reproducible
    table = (out / "results.md").read_text()
    assert "| mqar | Transformer" in table and "| twohop | DCFormer" in table
    assert abs(data["parameters"]["relative_difference"]) <= 0.02
    assert report["wall_seconds"] > 0
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # 2 tasks, 2 seeds, the norms, the three axes
    assert "Per run" in table and table.count("| DCFormer (DCMHA) | ") == 2 + 2 + 1 + 1
    assert (out / "dyn_norms.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the report can be rebuilt from the JSON alone (e.g. of an interrupted run)
    (out / "results.md").unlink()
    (out / "curves.png").unlink()
    rebuilt = compare_small.main(["--report-only", "--out", str(out)])
    assert (out / "results.md").read_text() == table and (out / "curves.png").is_file()
    assert rebuilt["aggregate"] == data["aggregate"]
    with pytest.raises(SystemExit, match="no .*results.json"):
        compare_small.main(["--report-only", "--out", str(tmp_path / "empty")])


def test_dc_overrides_use_qk_norm(capsys):
    """The advertised `--dc-overrides use_qk_norm=true` failed with "got multiple values for
    keyword argument 'use_qk_norm'"."""
    args = compare_small.parse_args(["--dc-overrides", "use_qk_norm=true,window_size=16,window_type=LGLL"])
    vocab = TaskVocab(args.task_config)
    neox, dc, info = matched_configs(
        args.shape_dict, vocab.model_vocab_size, 72, dc_overrides=args.dc_overrides
    )
    assert dc.use_qk_norm and dc.window_size == 16
    assert dc.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert abs(info["relative_difference"]) <= 0.02
    attention = DCFormerForCausalLM(dc).model.layers[0].self_attn
    assert attention.q_norm.weight.shape == (dc.head_dim,)


def test_recipe_flags_reach_the_dcformer_config_only():
    args = compare_small.parse_args(
        ["--task", "lm", "--qk-norm", "--window", "16", "--window-type", "LGLL", "--dc-init", "normal"]
    )
    expected = {"dynamic_init": "normal", "use_qk_norm": True, "window_size": 16, "window_type": "LGLL"}
    assert args.dc_overrides == expected
    neox, dc, _ = matched_configs(args.shape_dict, 264, 128, dc_overrides=args.dc_overrides)
    assert dc.use_qk_norm and dc.dynamic_init == "normal"
    assert dc.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert not hasattr(neox, "window_size") or neox.window_size is None
    # without the flags: the config's defaults (the authors' init), no qk-norm, every layer global
    args = compare_small.parse_args(["--task", "lm"])
    assert args.dc_overrides == {} and args.tasks == ["lm"] and args.eval_batch_size == args.batch_size
    _, dc, _ = matched_configs(args.shape_dict, 264, 128, dc_overrides=args.dc_overrides)
    assert dc.dynamic_init == "authors" and not dc.use_qk_norm and set(dc.layer_types) == {"full_attention"}
    # the same value through both routes is accepted
    args = compare_small.parse_args(["--qk-norm", "--dc-overrides", "use_qk_norm=true"])
    assert args.dc_overrides == {"use_qk_norm": True}
