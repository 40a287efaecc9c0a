"""argparse types of the experiment scripts: each refuses a bad value with a message naming it."""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def fraction(text: str) -> float:
    value = positive_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {text!r}")
    return value


def seed_list(text: str) -> list[int]:
    """'3' -> [0, 1, 2] (a count); '0,5,7' -> [0, 5, 7] (explicit seeds)."""
    try:
        if "," in text:
            seeds = [int(s) for s in text.split(",") if s.strip()]
            if len(set(seeds)) != len(seeds) or any(s < 0 for s in seeds) or not seeds:
                raise ValueError
            return seeds
        return list(range(positive_int(text)))
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(
            f"--seeds takes a count (3 -> seeds 0,1,2) or distinct non-negative seeds separated by commas, got {text!r}"
        ) from None


def lr_list(text: str) -> list[float]:
    """'1e-3,3e-3' -> [0.001, 0.003]: at least two distinct positive learning rates."""
    try:
        rates = [positive_float(s) for s in text.split(",") if s.strip()]
    except argparse.ArgumentTypeError:
        rates = []
    if len(rates) < 2 or len(set(rates)) != len(rates):
        raise argparse.ArgumentTypeError(
            f"--lr-sweep takes at least two distinct positive learning rates separated by commas, got {text!r}"
        )
    return sorted(rates)


def size_list(text: str) -> list[tuple[int, int, int | None]]:
    """'128/4,256/8/6' -> [(128, 4, None), (256, 8, 6)]: hidden/heads[/layers] per size."""
    sizes = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        parts = item.split("/")
        try:
            if len(parts) not in (2, 3):
                raise ValueError
            numbers = [positive_int(p) for p in parts]
        except (ValueError, argparse.ArgumentTypeError):
            raise argparse.ArgumentTypeError(
                f"--sizes takes HIDDEN/HEADS[/LAYERS] items separated by commas (e.g. 128/4,256/8), got {item!r}"
            ) from None
        sizes.append((numbers[0], numbers[1], numbers[2] if len(numbers) == 3 else None))
    if not sizes:
        raise argparse.ArgumentTypeError(f"--sizes: no size given in {text!r}")
    return sizes

