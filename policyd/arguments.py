"""Argument types shared by the command lines (a light module: the evaluation scripts import it
without the daemon's command line)."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def int_list(minimum: int = 0) -> Callable[[str], list[int]]:
    """An argparse type: comma-separated integers, each at least ``minimum``."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated integers, got {text!r}"
            ) from None
        if not values or any(v < minimum for v in values):
            what = "non-negative integers" if minimum == 0 else f"integers of at least {minimum}"
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return values

    return parse
