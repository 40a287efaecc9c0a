"""A real-text corpus for small language-modelling comparisons (`compare_small.py --task lm`), offline.

Documents: every `.txt`, `.rst` or `.md` file under the paths given (a file counts as one document). Without
paths, the reStructuredText sources of Python's documentation as Debian ships them
(`apt-get install python3.11-doc`: 497 files, 12 MB of English prose and examples under
`/usr/share/doc/python3.11/html/_sources`). Nothing is downloaded and nothing is cached.

Split, by document: a document's name is its path relative to the folder it was found in (or the file name
for a file given directly); the documents whose names have the lowest SHA-256 hashes go to validation
(`round(val_fraction * n)` of them, at least one each side). The split depends only on the names: not on the
order the files are listed in, the machine, or their contents.

Tokenisers: `byte` (UTF-8 bytes, ids 1..256; id 0 is `<|endoftext|>`, put after every document) or `bpe`, a
byte-level BPE trained on the training documents only (`tokenizer_utils.build_tiny_tokenizer`, id 0 is
`<|endoftext|>` too). Each split becomes one token stream: its documents in name order, each followed by id 0.

    python -m dcformer_research.lm_corpus   # summary of the default corpus and its split
    python -m dcformer_research.lm_corpus my_texts/ --tokenizer bpe --bpe-vocab 2048
"""

from __future__ import annotations

import argparse
import hashlib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

SUFFIXES = (".txt", ".rst", ".md")
DOCS_GLOB = "/usr/share/doc/python3.X/html/_sources"
INSTALL_HINT = "apt-get install python3.11-doc (Debian/Ubuntu; any python3.X-doc), or give --corpus PATH..."
EOS_ID = 0
TOKENIZERS = ("byte", "bpe")


@dataclass(frozen=True)
class Document:
    name: str
    path: Path


def default_corpus() -> Path | None:
    """The newest Python documentation sources installed by Debian's python3.X-doc, if any."""
    docs = Path("/usr/share/doc")
    found = [p for p in docs.glob("python3.*/html/_sources") if re.fullmatch(r"python3\.\d+", p.parts[-3])]
    return max(found, key=lambda p: int(p.parts[-3].split(".")[1])) if found else None


def find_documents(paths: list[str | Path] | None = None) -> list[Document]:
    """The documents under `paths` (files or folders, searched recursively), sorted by name."""
    if not paths:
        docs_dir = default_corpus()
        if docs_dir is None:
            raise FileNotFoundError(f"no corpus given and no Python documentation found at {DOCS_GLOB}: {INSTALL_HINT}")
        paths = [docs_dir]
    documents = {}
    for given in paths:
        root = Path(given)
        if not root.exists():
            raise FileNotFoundError(f"corpus path {str(given)!r} does not exist")
        if root.is_file():
            found = [(root.name, root)]
        else:
            files = sorted(p for p in root.rglob("*") if p.is_file() and p.name.endswith(SUFFIXES))
            if not files:
                raise ValueError(f"corpus folder {str(given)!r} holds no {'/'.join(SUFFIXES)} files")
            found = [(p.relative_to(root).as_posix(), p) for p in files]
        for name, path in found:
            if name in documents and documents[name].path.resolve() != path.resolve():
                raise ValueError(f"two corpus documents have the same name {name!r}: {documents[name].path} and {path}")
            documents[name] = Document(name, path)
    return [documents[name] for name in sorted(documents)]


def name_hash(name: str) -> str:
    return hashlib.sha256(name.encode("utf-8")).hexdigest()


def split_documents(documents: list[Document], val_fraction: float = 0.1) -> tuple[list[Document], list[Document]]:
    """(train, validation): the documents whose names hash lowest go to validation; both sorted by name."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction!r}")
    if len(documents) < 2:
        raise ValueError(
            f"the corpus has {len(documents)} document(s); the split is by document, so it needs at least 2 "
            "(give several files, or a folder of them)"
        )
    ranked = sorted(documents, key=lambda d: name_hash(d.name))
    n_val = min(len(documents) - 1, max(1, round(val_fraction * len(documents))))
    by_name = lambda d: d.name  # noqa: E731
    return sorted(ranked[n_val:], key=by_name), sorted(ranked[:n_val], key=by_name)


def read_document(document: Document) -> str:
    """The text of a document (UTF-8; undecodable bytes become U+FFFD)."""
    return document.path.read_text(encoding="utf-8", errors="replace")


class ByteTokenizer:
    """UTF-8 bytes as ids 1..256; id 0 is `<|endoftext|>`."""

    name = "byte"
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return (np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64) + 1).tolist()

    def decode(self, ids) -> str:
        return bytes(int(i) - 1 for i in ids if int(i) != EOS_ID).decode("utf-8", errors="replace")

    def bytes_per_token(self) -> np.ndarray:
        """Bytes of text each id stands for (0 for `<|endoftext|>`)."""
        return np.array([0] + [1] * 256, dtype=np.int64)


class BPETokenizer:
    """A byte-level BPE of at most `vocab_size` ids trained on `texts` (id 0 is `<|endoftext|>`)."""

    name = "bpe"

    def __init__(self, texts: list[str], vocab_size: int):
        from modeling_dcformer.training.tokenizer import build_tiny_tokenizer

        self.tokenizer = build_tiny_tokenizer(texts, vocab_size)
        self.vocab_size = len(self.tokenizer)
        if self.tokenizer.convert_tokens_to_ids("<|endoftext|>") != EOS_ID:
            raise RuntimeError("the trained tokenizer does not give <|endoftext|> the id 0")

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.backend_tokenizer.encode(text).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def bytes_per_token(self) -> np.ndarray:
        """Bytes of text each id stands for: one character of the byte-level alphabet is one byte."""
        lengths = np.zeros(self.vocab_size, dtype=np.int64)
        for token, index in self.tokenizer.get_vocab().items():
            lengths[index] = 0 if index == EOS_ID else len(token)
        return lengths


def encode_documents(texts: list[str], tokenizer) -> np.ndarray:
    """One stream: each text's ids followed by `<|endoftext|>`."""
    ids = []
    for text in texts:
        ids += tokenizer.encode(text)
        ids.append(EOS_ID)
    return np.array(ids, dtype=np.int64)


@dataclass
class LMCorpus:
    tokenizer: object
    train_documents: list[Document]
    val_documents: list[Document]
    train_ids: np.ndarray
    val_ids: np.ndarray
    train_bytes: int
    val_bytes: int
    sources: list[str] = field(default_factory=list)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def fingerprint(self) -> str:
        """SHA-256 of both token streams: equal fingerprints, equal data."""
        digest = hashlib.sha256()
        for ids in (self.train_ids, self.val_ids):
            digest.update(ids.astype("<i8").tobytes())
        return digest.hexdigest()

    def summary(self) -> dict:
        return {
            "sources": self.sources,
            "tokenizer": self.tokenizer.name,
            "vocab_size": self.vocab_size,
            "train_documents": len(self.train_documents),
            "val_documents": len(self.val_documents),
            "train_tokens": int(len(self.train_ids)),
            "val_tokens": int(len(self.val_ids)),
            "train_bytes": self.train_bytes,
            "val_bytes": self.val_bytes,
            "val_document_names": [d.name for d in self.val_documents],
            "fingerprint": self.fingerprint(),
        }


def load_corpus(
    paths: list[str | Path] | None = None,
    tokenizer: str = "byte",
    bpe_vocab: int = 2048,
    val_fraction: float = 0.1,
) -> LMCorpus:
    """Find, split and tokenise a corpus (see the module docstring)."""
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"tokenizer must be one of {TOKENIZERS}, got {tokenizer!r}")
    documents = find_documents(paths)
    train_docs, val_docs = split_documents(documents, val_fraction)
    train_texts = [read_document(d) for d in train_docs]
    val_texts = [read_document(d) for d in val_docs]
    tok = ByteTokenizer() if tokenizer == "byte" else BPETokenizer(train_texts, bpe_vocab)
    return LMCorpus(
        tokenizer=tok,
        train_documents=train_docs,
        val_documents=val_docs,
        train_ids=encode_documents(train_texts, tok),
        val_ids=encode_documents(val_texts, tok),
        train_bytes=sum(len(t.encode("utf-8")) for t in train_texts),
        val_bytes=sum(len(t.encode("utf-8")) for t in val_texts),
        sources=[str(p) for p in (paths or [default_corpus()])],
    )


class BlockDataset(torch.utils.data.Dataset):
    """Blocks of `block_size` tokens cut from a stream without overlap, as causal-LM examples
    (`labels` = `input_ids`; the model shifts).

    Training (`seed` given): `length` examples; pass e over the stream visits the blocks in the order of
    `numpy.random.default_rng([seed, e]).permutation`, so the order depends only on the seed. Validation
    (`seed` None): `length` blocks spread evenly over the stream, in stream order.
    """

    def __init__(self, ids: np.ndarray, block_size: int, length: int, seed: int | None = None):
        self.ids, self.block_size, self.length, self.seed = ids, block_size, length, seed
        self.num_blocks = len(ids) // block_size
        if self.num_blocks < 1:
            raise ValueError(f"the token stream ({len(ids)} tokens) is shorter than one block of {block_size}")
        if seed is None:
            if length > self.num_blocks:
                raise ValueError(f"{length} validation blocks asked for, the stream holds {self.num_blocks}")
            self.order = np.unique(np.linspace(0, self.num_blocks - 1, length).round().astype(np.int64))
        self._permutations: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.length

    def block_index(self, i: int) -> int:
        if not 0 <= i < self.length:
            raise IndexError(i)
        if self.seed is None:
            return int(self.order[i])
        epoch, j = divmod(i, self.num_blocks)
        if epoch not in self._permutations:
            self._permutations[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.num_blocks)
        return int(self._permutations[epoch][j])

    def __getitem__(self, i: int) -> dict:
        start = self.block_index(i) * self.block_size
        block = self.ids[start : start + self.block_size].tolist()
        return {"input_ids": block, "labels": block}


def predicted_bytes_per_token(dataset: BlockDataset, bytes_per_token: np.ndarray) -> float:
    """Mean bytes of text per predicted token (every token of a block but the first) over a dataset."""
    total_bytes = total_tokens = 0
    for i in range(len(dataset)):
        ids = np.asarray(dataset[i]["input_ids"][1:])
        total_bytes += int(bytes_per_token[ids].sum())
        total_tokens += len(ids)
    return total_bytes / max(total_tokens, 1)


def bits_per_byte(loss_nats: float, bytes_per_predicted_token: float) -> float:
    return loss_nats / math.log(2) / bytes_per_predicted_token


def main(argv=None):
    parser = argparse.ArgumentParser(description="Summarise a corpus and its train/validation split.")
    parser.add_argument("corpus", nargs="*", help=f"files or folders (default: {DOCS_GLOB})")
    parser.add_argument("--tokenizer", choices=TOKENIZERS, default="byte")
    parser.add_argument("--bpe-vocab", type=int, default=2048)
    parser.add_argument("--val-fraction", type=float, default=0.1)
    args = parser.parse_args(argv)
    try:
        corpus = load_corpus(args.corpus or None, args.tokenizer, args.bpe_vocab, args.val_fraction)
    except (FileNotFoundError, ValueError) as err:
        parser.error(str(err))
    summary = corpus.summary()
    names = summary.pop("val_document_names")
    for key, value in summary.items():
        print(f"{key}: {value}")
    print(f"validation documents: {', '.join(names[:10])}{', ...' if len(names) > 10 else ''}")
    print(f"sample: {corpus.tokenizer.decode(corpus.train_ids[:200])!r}")


if __name__ == "__main__":
    main()
