"""Argument checks shared by the ``python -m bench.*`` profiling scripts."""

from __future__ import annotations

import argparse


def positive(text: str) -> int:
    """argparse ``type=``: a whole number of at least 1 (a count of blocks or cycles)."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a whole number of at least 1, not {text!r}")
    return int(text)
