"""Argument types the command lines share: argparse reports a bad value as a usage error
naming the option, before any work starts."""
from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An integer of at least 1 (thread counts: torch refuses 0 or fewer with a traceback)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
