"""A tiny byte-level BPE tokenizer trained locally, for demos and tests that must not download anything.

    python -m modeling_dcformer.training.tokenizer examples/data/harbour_train.txt --vocab-size 512 \
        --out ./tiny-tokenizer

The result is an ordinary `transformers` tokenizer directory (`AutoTokenizer.from_pretrained(out_dir)`), with
GPT-NeoX/Pythia conventions: byte-level pre-tokenisation (no unknown tokens) and one special token
`<|endoftext|>` with id 0, used as bos, eos and unk (the DCFormer presets use 0 for bos and eos).
"""

import argparse
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

ENDOFTEXT = "<|endoftext|>"


def build_tiny_tokenizer(
    texts: Iterable[str], vocab_size: int, out_dir: str | Path | None = None
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer of at most `vocab_size` tokens on `texts`; save it to `out_dir` if given.

    `vocab_size` counts the 256 byte tokens and `<|endoftext|>` (id 0); a small corpus may yield fewer merges
    than asked for, so `len(tokenizer)` can be below `vocab_size`.
    """
    if vocab_size < 257:
        raise ValueError(
            f"a byte-level BPE vocabulary needs at least 257 tokens (256 bytes + {ENDOFTEXT}), got {vocab_size}"
        )
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[ENDOFTEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator((t for t in texts if t), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=ENDOFTEXT, eos_token=ENDOFTEXT, unk_token=ENDOFTEXT
    )
    if out_dir is not None:
        tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def read_lines(paths: Iterable[str | Path]) -> list[str]:
    lines = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            lines += [line.rstrip("\n") for line in f]
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="text files, one example a line")
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--out", required=True, help="directory to save the tokenizer to")
    args = parser.parse_args(argv)
    tokenizer = build_tiny_tokenizer(read_lines(args.files), args.vocab_size, args.out)
    print(f"saved a {len(tokenizer)}-token tokenizer to {args.out}")


if __name__ == "__main__":
    main()
