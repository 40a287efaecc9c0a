"""evals/fixtures: the bundled PIQA and HellaSwag rows carry no answer-length cue.

lm-eval's `acc` picks the choice with the highest summed log-likelihood, which favours short choices for a model
that has learned nothing; `acc_norm` divides by the length in bytes. When the right answer is the longer one in
(nearly) every row, an untrained model scores 0.000 on `acc` and looks broken. So: the right PIQA solution is the
longer one in about half the rows, the right HellaSwag ending is the longest (or the shortest) in about a quarter,
both in the evaluation files and in the few-shot `.train` files; and a random tiny model scored through the harness
lands near chance on both tasks. Nothing is downloaded: the tokenizer is trained here on the fixtures' text.
"""

from __future__ import annotations

import os

for _key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):  # before datasets / lm_eval load
    os.environ.setdefault(_key, "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("lm_eval")
from lm_eval.tasks.hellaswag.utils import preprocess  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from helpers import build_model, make_config  # noqa: E402
from modeling_dcformer.evals import harness  # noqa: E402
from modeling_dcformer.evals.tasks import local_data  # noqa: E402

FIXTURES = Path(__file__).resolve().parent.parent / "evals" / "fixtures"


def piqa_choices(row: dict) -> tuple[list[str], int]:
    return [row["sol1"], row["sol2"]], int(row["label"])


def hellaswag_choices(row: dict) -> tuple[list[str], int]:
    """The choices as lm-eval scores them (upstream's preprocessing strips the WikiHow [title] / [step] marks)."""
    return [preprocess(ending) for ending in row["endings"]], int(row["label"])


def length_baselines(name: str) -> tuple[float, float, int]:
    """(accuracy of "pick the longest choice", of "pick the shortest choice", rows) on a fixture file; a tie for
    the longest (shortest) counts as a miss."""
    choices_of = piqa_choices if name.startswith("piqa") else hellaswag_choices
    rows = local_data.read_jsonl(FIXTURES / name)
    longest = shortest = 0
    for row in rows:
        choices, gold = choices_of(row)
        lengths = [len(choice) for choice in choices]
        others = lengths[:gold] + lengths[gold + 1:]
        longest += lengths[gold] > max(others)
        shortest += lengths[gold] < min(others)
    return longest / len(rows), shortest / len(rows), len(rows)


@pytest.mark.parametrize("name", ["piqa.jsonl", "piqa.train.jsonl"])
def test_piqa_right_answer_is_the_longer_one_in_about_half_the_rows(name):
    longest, shortest, rows = length_baselines(name)
    assert 0.35 <= longest <= 0.65, f"{name}: the right solution is the longer one in {longest * rows:.0f}/{rows}"
    assert longest + shortest == pytest.approx(1.0), f"{name}: two solutions of the same length"
    labels = [int(row["label"]) for row in local_data.read_jsonl(FIXTURES / name)]
    assert 0.35 <= sum(labels) / len(labels) <= 0.65, f"{name}: the right solution is mostly in one place"


@pytest.mark.parametrize("name", ["hellaswag.jsonl", "hellaswag.train.jsonl"])
def test_hellaswag_right_ending_is_rarely_the_longest_or_the_shortest(name):
    longest, shortest, rows = length_baselines(name)
    assert longest <= 0.40, f"{name}: the right ending is the longest in {longest * rows:.0f}/{rows}"
    assert shortest <= 0.40, f"{name}: the right ending is the shortest in {shortest * rows:.0f}/{rows}"
    if rows >= 20:  # the evaluation file: each length rank about a quarter of the rows
        assert longest >= 0.15 and shortest >= 0.15, (name, longest, shortest)


@pytest.fixture(scope="module")
def random_model():
    """A tiny DCFormer with random weights and a byte-level BPE tokenizer trained on the fixtures' text."""
    texts = [value for path in sorted(FIXTURES.glob("*.jsonl")) for row in local_data.read_jsonl(path)
             for field in row.values() for value in (field if isinstance(field, list) else [field])
             if isinstance(value, str)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    ))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    config = make_config(vocab_size=len(tokenizer), num_hidden_layers=2, max_position_embeddings=512)
    return build_model(config, seed=0), tokenizer


def test_a_random_model_scores_near_chance(random_model, monkeypatch):
    """Through the harness, on every row: PIQA (chance 0.5) and HellaSwag (chance 0.25), acc and acc_norm."""
    monkeypatch.delenv(local_data.ENV_VAR, raising=False)
    model, tokenizer = random_model
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = harness.evaluate(model, tokenizer, ["piqa_local", "hellaswag_local"], batch_size=8,
                                   bootstrap_iters=0)["results"]
    finally:
        torch.set_num_threads(threads)
    for metric in ("acc,none", "acc_norm,none"):
        assert 0.2 <= results["piqa_local"][metric] <= 0.8, (metric, results["piqa_local"])
        assert 0.05 <= results["hellaswag_local"][metric] <= 0.5, (metric, results["hellaswag_local"])
