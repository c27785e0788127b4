"""How benchmark results leave: an aligned block of lines on stdout, and a JSON file."""

from __future__ import annotations

import json
from pathlib import Path


def print_report(title: str, lines: list[tuple[str, str]]) -> None:
    width = max(len(label) for label, _ in lines)
    print(f"============ {title} ============")
    for label, value in lines:
        print(f"{label + ':':<{width + 2}}{value}")
    print("=" * (len(title) + 26), flush=True)


def write_json(path: str | Path, results: dict) -> None:
    Path(path).write_text(json.dumps(results, indent=2) + "\n")
