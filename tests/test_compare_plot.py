"""benchmarks/compare_vllm.py --plot: a bar chart from the run's summary, or from an earlier summary.json."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="--plot needs matplotlib (the [plot] and [test] extras)")
from matplotlib.image import imread  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
HARNESS = ROOT / "benchmarks" / "compare_vllm.py"


def harness(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HARNESS), *args], capture_output=True, text=True, timeout=timeout)


def assert_chart(path: Path, panels: int) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = imread(str(path)).shape[:2]
    assert height > 200 and width > 300 * min(panels, 4)  # 3.3 inches at 110 dpi per panel, up to four in a row


def test_an_earlier_summary_is_drawn_without_running_anything(tmp_path):
    summary = {"engines": ["pagedllm", "vllm", "pagedllm-openvino"], "dtype": "float32", "rounds": 3, "smoke": False,
               "model": "SmolLM2-135M-Instruct", "rows": [
                   {"metric": "W1 output tok/s", "format": ".1f", "pagedllm": 119.9, "vllm": 121.6,
                    "pagedllm-openvino": None},
                   {"metric": "W1 start-up s", "format": ".1f", "lower_is_better": True, "pagedllm": 9.5,
                    "vllm": 134.0, "pagedllm-openvino": 8.6},
                   {"metric": "serve TTFT p50 ms", "format": ".0f", "lower_is_better": True, "pagedllm": 120,
                    "vllm": 150, "pagedllm-openvino": 110},
                   {"metric": "W2 start-up s", "format": ".1f", "pagedllm": None, "vllm": None,
                    "pagedllm-openvino": None}]}  # no numbers at all: left out
    source = tmp_path / "summary.json"
    source.write_text(json.dumps(summary))
    chart = tmp_path / "charts" / "results.png"
    proc = harness("--plot", str(chart), "--from-summary", str(source), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"chart: {chart}"
    assert_chart(chart, panels=3)


def test_from_summary_needs_plot(tmp_path):
    proc = harness("--from-summary", str(tmp_path / "summary.json"), timeout=120)
    assert proc.returncode == 2 and "--from-summary draws an earlier run's summary: add --plot PNG" in proc.stderr
