"""Argument types shared by the command lines (a light module: the evaluation scripts import it
without the daemon's command line)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

N = TypeVar("N", int, float)


def _number_list(
    convert: Callable[[str], N], kind: str, valid: Callable[[N], bool], what: str
) -> Callable[[str], list[N]]:
    """An argparse type: comma-separated ``kind`` (parsed by ``convert``), at least one, each
    ``valid`` (else: "expected ``what``")."""

    def parse(text: str) -> list[N]:
        try:
            values = [convert(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated {kind}, got {text!r}"
            ) from None
        if not values or not all(valid(v) for v in values):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return values

    return parse


def int_list(minimum: int = 0) -> Callable[[str], list[int]]:
    """Comma-separated integers, each at least ``minimum``."""
    what = "non-negative integers" if minimum == 0 else f"integers of at least {minimum}"
    return _number_list(int, "integers", lambda v: v >= minimum, what)


def int_at_least(minimum: int = 0) -> Callable[[str], int]:
    """One integer, at least ``minimum``.

    >>> int_at_least(1)("3")
    3
    >>> int_at_least(1)("0")
    Traceback (most recent call last):
    argparse.ArgumentTypeError: expected an integer of at least 1, got '0'
    """
    what = "a non-negative integer" if minimum == 0 else f"an integer of at least {minimum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


def tier_list() -> Callable[[str], list[int | str]]:
    """Comma-separated tier sizes: blocks (a non-negative integer), or a multiple of each
    point's GPU tier (a non-negative number and ``x``: ``1x``, ``0.5x``), kept as written.

    >>> tier_list()("0,16384,1x,0.5x")
    [0, 16384, '1x', '0.5x']
    >>> tier_list()("x2")
    Traceback (most recent call last):
    argparse.ArgumentTypeError: expected blocks or a multiple of the GPU tier (1x, 0.5x), got 'x2'
    """

    def size(text: str) -> int | str:
        if text.endswith("x"):
            gpu_multiple(text)  # (raises when it is not one)
            return text
        blocks = int(text)
        if blocks < 0:
            raise ValueError(text)
        return blocks

    def parse(text: str) -> list[int | str]:
        try:
            sizes = [size(v.strip()) for v in text.split(",") if v.strip()]
        except ValueError:
            sizes = []
        if not sizes:
            raise argparse.ArgumentTypeError(
                f"expected blocks or a multiple of the GPU tier (1x, 0.5x), got {text!r}"
            )
        return sizes

    return parse


def gpu_multiple(size: str) -> float:
    """The factor of a tier size written as a multiple of the GPU tier (``"2x"`` -> 2.0);
    ValueError when it is not one."""
    try:
        factor = float(size.removesuffix("x")) if size.endswith("x") else float("nan")
    except ValueError:
        factor = float("nan")
    if not 0.0 <= factor < float("inf"):
        raise ValueError(f"not a multiple of the GPU tier: {size!r}")
    return factor


def fraction_list() -> Callable[[str], list[float]]:
    """Comma-separated numbers, each in [0, 1]."""
    return _number_list(float, "numbers", lambda v: 0.0 <= v <= 1.0, "fractions in [0, 1]")
