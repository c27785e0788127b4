"""Small helpers every layer may use; part of the backend contract (imports nothing)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """The ceiling of a / b for positive b: how many b-sized blocks hold a items."""
    return -(a // -b)
