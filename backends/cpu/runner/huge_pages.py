"""A small model's weights moved onto 2 MiB pages once they are loaded and packed.

The weights come from malloc, on 4 KiB pages. A decode step streams all of them through small GEMMs, and in a VM
each TLB miss walks two levels of page tables: small GEMMs wait on page walks as well as on the bytes. Linux's
MADV_COLLAPSE (6.1+) rebuilds the pages under the weights as huge pages in place. The rebuild copies the weights
once, so it is done only up to MAX_BYTES: larger models are bound by memory bandwidth, where huge pages gain little
and the copy costs seconds.
"""

from __future__ import annotations

import sys
import time

import torch

from pagedllm.backends.common.memory import madvise

HUGE_PAGE = 2 << 20
MAX_BYTES = 1 << 30
MIN_BYTES = 256 << 10  # smaller tensors (norm weights, biases) take a TLB entry or two: not worth a 2 MiB copy
MADV_HUGEPAGE = 14  # asm-generic/mman-common.h
MADV_COLLAPSE = 25
_ERRORS = {11: "EAGAIN, no free huge page", 12: "ENOMEM", 22: "EINVAL, Linux older than 6.1 or THP disabled"}


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of a tensor's memory; oneDNN-packed weights are opaque tensors with their own buffer."""
    if tensor.is_mkldnn:
        return torch.ops.mkldnn.data_ptr(tensor), torch.ops.mkldnn._nbytes(tensor)
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def weight_spans(model: torch.nn.Module, min_bytes: int = MIN_BYTES) -> list[tuple[int, int]]:
    """(address, bytes) of each parameter and buffer of at least ``min_bytes`` (tied weights once)."""
    spans = {_span(t) for t in (*model.parameters(), *model.buffers()) if t.device.type == "cpu"}
    return sorted(span for span in spans if span[1] >= min_bytes)


def huge_page_regions(spans: list[tuple[int, int]]) -> list[int]:
    """The start of every 2 MiB region that holds a byte of the spans, sorted."""
    starts = set()
    for address, nbytes in spans:
        starts.update(range(address // HUGE_PAGE * HUGE_PAGE, address + nbytes, HUGE_PAGE))
    return sorted(starts)


def collapse(regions: list[int]) -> tuple[int, str | None]:
    """Rebuild each 2 MiB region as one huge page now. Returns how many were, and why not for the rest (the last
    error seen), or None when all were."""
    if not regions:
        return 0, None
    if not sys.platform.startswith("linux"):
        return 0, "not Linux"
    done, reason = 0, None
    for start in regions:
        # MADV_HUGEPAGE too, so that khugepaged keeps the region huge (and collapses it later where COLLAPSE failed).
        madvise(start, HUGE_PAGE, MADV_HUGEPAGE)
        errno = madvise(start, HUGE_PAGE, MADV_COLLAPSE)
        if errno == 0:
            done += 1
        else:
            reason = _ERRORS.get(errno, f"errno {errno}")
    return done, reason


def weights_on_huge_pages(model: torch.nn.Module, max_bytes: int = MAX_BYTES) -> str:
    """Collapse the memory under the model's weights into huge pages if they are small enough; returns a line for
    the log."""
    spans = weight_spans(model)
    total = sum(nbytes for _, nbytes in spans)
    if total > max_bytes:
        return (f"weights on 4 KiB pages ({total / 2**30:.1f} GiB; moved onto 2 MiB pages only up to "
                f"{max_bytes / 2**30:.0f} GiB)")
    regions = huge_page_regions(spans)
    start = time.perf_counter()
    done, reason = collapse(regions)
    if done == 0 and reason is not None:
        return f"weights on 4 KiB pages (MADV_COLLAPSE: {reason})"
    text = f"weights on 2 MiB pages: {done * HUGE_PAGE >> 20} MiB in {time.perf_counter() - start:.2f} s"
    # The regions that fail after others succeeded straddle the end of a tensor's own mapping.
    return text if done == len(regions) else f"{text} ({len(regions) - done} partial regions left on 4 KiB pages)"
