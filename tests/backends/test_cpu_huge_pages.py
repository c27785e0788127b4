import ctypes
import mmap
import sys

import pytest
import torch

from pagedllm.backends.cpu.runner import huge_pages
from pagedllm.backends.cpu.runner.huge_pages import HUGE_PAGE
from pagedllm.utils import cdiv


def test_regions_cover_every_byte_of_the_spans():
    spans = [(3 * 2**20 + 100, 2 * 2**20), (8 * 2**20, 1)]
    assert huge_pages.huge_page_regions(spans) == [2 * 2**20, 4 * 2**20, 8 * 2**20]


def test_weight_spans_skip_small_tensors_and_count_tied_weights_once():
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.LayerNorm(512), torch.nn.Linear(512, 512))
    model[2].weight = model[0].weight  # tied
    spans = huge_pages.weight_spans(model)
    assert spans == [(model[0].weight.data_ptr(), 512 * 512 * 4)]


def test_large_models_are_left_on_small_pages():
    model = torch.nn.Linear(1024, 1024)
    assert huge_pages.weights_on_huge_pages(model, max_bytes=2**20).startswith("weights on 4 KiB pages (0.0 GiB")


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping that holds ``address``, from /proc/self/smaps."""
    inside = False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            inside = lo <= address < hi
        elif inside and fields[0] == "AnonHugePages:":
            return int(fields[1])
    return 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_COLLAPSE is Linux's")
def test_collapse_moves_memory_onto_a_huge_page_and_keeps_its_bytes():
    region = mmap.mmap(-1, 3 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        region.madvise(mmap.MADV_NOHUGEPAGE)  # faulted in on 4 KiB pages, whatever the THP mode
    data = torch.frombuffer(region, dtype=torch.uint8)
    data.copy_(torch.arange(data.numel()) % 251)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    start = cdiv(base, HUGE_PAGE) * HUGE_PAGE
    assert _anon_huge_kib(start) == 0
    done, reason = huge_pages.collapse([start])
    if done == 0 and reason is not None and reason.startswith(("EINVAL", "EAGAIN")):
        pytest.skip(f"no MADV_COLLAPSE here: {reason}")
    assert (done, reason) == (1, None)
    assert _anon_huge_kib(start) >= HUGE_PAGE // 1024
    assert torch.equal(data, torch.arange(data.numel()) % 251)
    del data
    region.close()
