"""Synthetic in-context tasks for small DCFormer vs Transformer comparisons (used by `compare_small.py`).

Two tasks over one small symbolic vocabulary built here (integer token ids, no tokenizer: `TaskVocab.decode`
turns ids back into readable symbols):

* **MQAR** (multi-query associative recall, Zoology-style): `k3 v17 k9 v2 ... | k9 v2 k3 v17 ...` — a list
  of key->value pairs (distinct keys, values drawn with replacement), a separator, then every key once more
  in a random order, each followed by its value. The model must produce each queried value. Difficulty:
  the number of pairs (uniform in `mqar_pairs`) and the key/value vocabulary sizes.
* **Two-hop** (the paper's kind of compositional task): facts `h R t .` then queries `? x R1 R2 = z`, where
  `x R1 y` and `y R2 z` are facts of the context ("R1 of R2 of x", like "the father of the father").
  Relations are functional within a context (at most one fact per (head, relation)), so the answer of every
  query is unique; distractor facts are added around each target chain: the same head with another relation
  (possibly continued by R2, a decoy path), the same middle entity with another relation, the same two
  relations from another head (a decoy chain), and random facts. The facts are shuffled, so the second
  hop can come before the first. Difficulty: the number of facts (uniform in `twohop_facts`), the number of
  queries, the entity and relation vocabulary sizes.

Every example is a dict with `input_ids`, `labels` (the token id at answer positions, -100 everywhere else:
the loss is on the answers only, the contexts are random and unpredictable), `task` and `difficulty`
(pairs or facts). Position i of `labels` holds the id of token i (transformers' causal-LM models shift
labels themselves), so the answer at position i is predicted from the logits at position i - 1.

Example i of a `SyntheticDataset` is generated on demand from `random.Random(f"{seed}/{split}/{i}")`: the
same seed gives the same examples in any order, in any process, and the "train" and "validation" splits are
independent streams.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

IGNORE_INDEX = -100
SPECIALS = ("<|endoftext|>", "|", "?", "=", ".")  # id 0 is bos and padding (Pythia's convention: id 0)
TASKS = ("mqar", "twohop")


def parse_range(text: str | tuple[int, int], name: str = "range") -> tuple[int, int]:
    """'4-16' -> (4, 16); '8' -> (8, 8); a (lo, hi) pair is checked and returned."""
    if isinstance(text, (tuple, list)):
        lo, hi = text
    else:
        parts = str(text).split("-")
        try:
            if len(parts) == 1:
                lo = hi = int(parts[0])
            elif len(parts) == 2:
                lo, hi = int(parts[0]), int(parts[1])
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"{name}: expected 'N' or 'LO-HI' (positive integers), got {text!r}") from None
    if not (isinstance(lo, int) and isinstance(hi, int)) or lo < 1 or hi < lo:
        raise ValueError(f"{name}: expected 1 <= LO <= HI, got {text!r}")
    return lo, hi


@dataclass
class TaskConfig:
    """Sizes of the symbol sets and the difficulty ranges of both tasks."""

    mqar_keys: int = 16
    mqar_values: int = 16
    mqar_pairs: tuple[int, int] = (2, 8)
    twohop_entities: int = 32
    twohop_relations: int = 4
    twohop_facts: tuple[int, int] = (6, 10)
    twohop_queries: int = 2

    def __post_init__(self):
        self.mqar_pairs = parse_range(self.mqar_pairs, "mqar_pairs")
        self.twohop_facts = parse_range(self.twohop_facts, "twohop_facts")
        for name in ("mqar_keys", "mqar_values", "twohop_entities", "twohop_relations", "twohop_queries"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.mqar_pairs[1] > self.mqar_keys:
            raise ValueError(
                f"MQAR needs distinct keys: at most mqar_keys={self.mqar_keys} pairs, asked for up to {self.mqar_pairs[1]}"
            )
        if self.twohop_relations < 2:
            raise ValueError("two-hop needs at least 2 relations (distractors use another relation than the query's)")
        if self.twohop_facts[0] < 2 * self.twohop_queries:
            raise ValueError(
                f"two-hop: each of the {self.twohop_queries} queries needs 2 facts, so twohop_facts must start at "
                f">= {2 * self.twohop_queries}, got {self.twohop_facts}"
            )
        # every fact may bring up to 2 new entities; 3 per target chain
        needed = 3 * self.twohop_queries + 2 * self.twohop_facts[1]
        if self.twohop_entities < needed:
            raise ValueError(
                f"two-hop: {self.twohop_facts[1]} facts and {self.twohop_queries} queries may need {needed} distinct "
                f"entities, but twohop_entities={self.twohop_entities}"
            )

    def max_length(self, task: str) -> int:
        if task == "mqar":
            return 1 + 2 * self.mqar_pairs[1] + 1 + 2 * self.mqar_pairs[1]
        if task == "twohop":
            return 1 + 4 * self.twohop_facts[1] + 6 * self.twohop_queries
        raise ValueError(f"unknown task {task!r}; choose from {TASKS}")

    def difficulty_range(self, task: str) -> tuple[int, int]:
        return self.mqar_pairs if task == "mqar" else self.twohop_facts


@dataclass
class TaskVocab:
    """The symbols: specials, MQAR keys `k*` and values `v*`, two-hop entities `e*` and relations `R*`."""

    config: TaskConfig = field(default_factory=TaskConfig)

    def __post_init__(self):
        c = self.config
        names = list(SPECIALS)
        self.key_ids = self._add(names, "k", c.mqar_keys)
        self.value_ids = self._add(names, "v", c.mqar_values)
        self.entity_ids = self._add(names, "e", c.twohop_entities)
        self.relation_ids = self._add(names, "R", c.twohop_relations)
        self.names = names
        self.ids = {name: i for i, name in enumerate(names)}
        self.pad_id = self.bos_id = 0
        self.sep_id, self.query_id, self.equals_id, self.dot_id = (self.ids[s] for s in SPECIALS[1:])

    @staticmethod
    def _add(names: list[str], prefix: str, count: int) -> range:
        start = len(names)
        names += [f"{prefix}{i}" for i in range(count)]
        return range(start, start + count)

    def __len__(self) -> int:
        return len(self.names)

    @property
    def model_vocab_size(self) -> int:
        """The vocabulary size given to both models: the symbols, rounded up to a multiple of 8."""
        return -(-len(self.names) // 8) * 8

    def decode(self, ids) -> str:
        return " ".join(self.names[int(i)] for i in ids)


def mqar_example(rng: random.Random, vocab: TaskVocab) -> dict:
    c = vocab.config
    n = rng.randint(*c.mqar_pairs)
    keys = rng.sample(list(vocab.key_ids), n)
    values = [rng.choice(vocab.value_ids) for _ in range(n)]
    ids = [vocab.bos_id]
    for k, v in zip(keys, values):
        ids += [k, v]
    ids.append(vocab.sep_id)
    labels = [IGNORE_INDEX] * len(ids)
    for j in rng.sample(range(n), n):  # every key queried once, in a random order
        ids += [keys[j], values[j]]
        labels += [IGNORE_INDEX, values[j]]
    return {"input_ids": ids, "labels": labels, "task": "mqar", "difficulty": n}


def twohop_example(rng: random.Random, vocab: TaskVocab) -> dict:
    c = vocab.config
    n_facts = rng.randint(*c.twohop_facts)
    n_queries = c.twohop_queries
    relations = list(vocab.relation_ids)
    unused = list(vocab.entity_ids)
    rng.shuffle(unused)
    used: list[int] = []
    facts: dict[tuple[int, int], int] = {}  # (head, relation) -> tail: functional, so answers are unique

    def fresh() -> int:
        entity = unused.pop()
        used.append(entity)
        return entity

    def room(head: int, relation: int, n: int = 1) -> bool:
        return n_facts - len(facts) >= n and (head, relation) not in facts

    def add(head: int, relation: int, tail: int) -> None:
        assert head != tail and (head, relation) not in facts and len(facts) < n_facts
        facts[(head, relation)] = tail

    def other(*exclude: int) -> int:  # a known entity, or a new one when none is left to pick
        choices = [e for e in used if e not in exclude]
        return rng.choice(choices) if choices else fresh()

    chains = []
    for _ in range(n_queries):
        x, y, z = fresh(), fresh(), fresh()
        r1, r2 = rng.choice(relations), rng.choice(relations)
        add(x, r1, y)
        add(y, r2, z)
        chains.append((x, r1, y, r2, z))
    # Distractors. New entities are taken only for facts that are placed, so at most 2 per fact.
    attempts = 0
    while len(facts) < n_facts:
        attempts += 1
        if attempts > 10_000:  # cannot happen with the TaskConfig checks; never loop forever
            raise RuntimeError("two-hop generator could not place its distractors")
        x, r1, y, r2, z = rng.choice(chains)
        kind = rng.randrange(4)
        if kind == 0:  # same head, another relation; sometimes continued by the query's second relation
            r = rng.choice([r for r in relations if r != r1])
            if room(x, r):
                y2 = fresh() if rng.random() < 0.7 else other(x, y)
                add(x, r, y2)
                if rng.random() < 0.5 and room(y2, r2):
                    add(y2, r2, fresh())
        elif kind == 1:  # the middle entity with another relation
            r = rng.choice([r for r in relations if r != r2])
            if room(y, r):
                add(y, r, fresh() if rng.random() < 0.5 else other(y))
        elif kind == 2:  # the same two relations from another head: a decoy chain
            if room(-1, -1, 2):
                u, w = fresh(), fresh()
                add(u, r1, w)
                add(w, r2, fresh())
        else:  # a random fact between known or new entities
            head = other() if rng.random() < 0.5 else fresh()
            r = rng.choice(relations)
            if room(head, r):
                add(head, r, other(head) if rng.random() < 0.5 else fresh())
    fact_list = [(h, r, t) for (h, r), t in facts.items()]
    rng.shuffle(fact_list)
    ids = [vocab.bos_id]
    for h, r, t in fact_list:
        ids += [h, r, t, vocab.dot_id]
    labels = [IGNORE_INDEX] * len(ids)
    for x, r1, _, r2, z in rng.sample(chains, len(chains)):
        ids += [vocab.query_id, x, r1, r2, vocab.equals_id, z]
        labels += [IGNORE_INDEX] * 5 + [z]
    return {"input_ids": ids, "labels": labels, "task": "twohop", "difficulty": n_facts}


GENERATORS = {"mqar": mqar_example, "twohop": twohop_example}


class SyntheticDataset(torch.utils.data.Dataset):
    """`size` examples of the given tasks (example i is of task `tasks[i % len(tasks)]`), each generated on
    demand from (`seed`, `split`, i): deterministic, order-independent, no storage."""

    def __init__(self, tasks, size: int, seed: int, split: str, vocab: TaskVocab):
        tasks = [tasks] if isinstance(tasks, str) else list(tasks)
        for task in tasks:
            if task not in GENERATORS:
                raise ValueError(f"unknown task {task!r}; choose from {TASKS}")
        if size < 1:
            raise ValueError(f"dataset size must be positive, got {size}")
        self.tasks, self.size, self.seed, self.split, self.vocab = tasks, size, seed, split, vocab

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.size:
            raise IndexError(i)
        task = self.tasks[i % len(self.tasks)]
        return GENERATORS[task](random.Random(f"{self.seed}/{self.split}/{task}/{i}"), self.vocab)


class PadCollator:
    """Right-pads a batch to its longest example (rounded up to a multiple of `multiple`): `input_ids` with the
    pad id 0, `labels` with -100. No attention mask: the models are causal and padding only follows the real
    tokens, so it never changes a real position's output, and padded positions carry no loss."""

    def __init__(self, pad_id: int = 0, multiple: int = 8):
        self.pad_id, self.multiple = pad_id, multiple

    def __call__(self, examples: list[dict]) -> dict:
        length = max(len(e["input_ids"]) for e in examples)
        length = -(-length // self.multiple) * self.multiple
        ids = torch.full((len(examples), length), self.pad_id, dtype=torch.long)
        labels = torch.full((len(examples), length), IGNORE_INDEX, dtype=torch.long)
        for row, e in enumerate(examples):
            ids[row, : len(e["input_ids"])] = torch.tensor(e["input_ids"])
            labels[row, : len(e["labels"])] = torch.tensor(e["labels"])
        return {"input_ids": ids, "labels": labels}


__all__ = [
    "GENERATORS",
    "IGNORE_INDEX",
    "PadCollator",
    "SyntheticDataset",
    "TASKS",
    "TaskConfig",
    "TaskVocab",
    "mqar_example",
    "parse_range",
    "twohop_example",
]
