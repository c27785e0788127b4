"""Scores of text pairs from embeddings, as vLLM's score API pairs and scores them for embedding models."""

from __future__ import annotations

import math
from typing import Sequence


def score_pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> tuple[list[str], list[str]]:
    """vLLM's pairing of score inputs: one first text against each second one, or two lists pairwise."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second) or not second:
        raise ValueError(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as many as "
                         f"text_2")
    return first, second


def unique_texts(first: list[str], second: list[str]) -> list[str]:
    """Each text once, in order of first appearance: a text in several pairs is embedded once."""
    return list(dict.fromkeys([*first, *second]))


def pair_scores(first: list[str], second: list[str], vectors: dict[str, list[float]]) -> list[float]:
    """The cosine of each pair's embeddings; 0 where it is undefined (a zero or non-finite vector)."""
    return [_finite(cosine(vectors[a], vectors[b])) for a, b in zip(first, second)]


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


def _finite(x: float) -> float:
    return x if math.isfinite(x) else 0.0
