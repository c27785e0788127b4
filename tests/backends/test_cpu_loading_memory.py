"""Loading keeps no more than the model: the checkpoint's mapped pages go back once its weights are copied (packed,
quantized), a GGUF file's pages as each tensor is read, and a tied embedding of a quantized head is not held dense."""

import ctypes
import mmap
import sys

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.backends.common.memory import checkpoint_mappings, drop_checkpoint_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")


def mapped_kib(suffix: str) -> tuple[int, int]:
    """(resident KiB, mappings) of this process's mappings of files ending with ``suffix``."""
    resident, count, inside = 0, 0, False
    with open("/proc/self/smaps", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                inside = len(fields) == 6 and fields[5].endswith(suffix)
                count += inside
            elif inside and fields[0] == "Rss:":
                resident += int(fields[1])
    return resident, count


def test_a_written_private_mapping_is_never_dropped(tmp_path):
    path = tmp_path / "weights.safetensors"
    path.write_bytes(b"\1" * 4 * mmap.PAGESIZE)
    with open(path, "r+b") as f:
        region = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    view = ctypes.c_char.from_buffer(region)
    address = ctypes.addressof(view)
    assert region[0] == 1 and (address, address + 4 * mmap.PAGESIZE) in checkpoint_mappings()  # read: droppable
    region[0] = 7  # written: the page is the process's own now
    assert (address, address + 4 * mmap.PAGESIZE) not in checkpoint_mappings()
    drop_checkpoint_pages(checkpoint_mappings())
    assert region[0] == 7 and region[mmap.PAGESIZE] == 1
    del view
    region.close()


def test_loading_a_folder_leaves_its_files_pages_behind(tiny_llama):
    """bf16 from a float32 file: every weight is a copy, so none of the file stays resident (float32 weights would
    be the file's own pages, read by every step)."""
    llm = LLM(str(tiny_llama), dtype="bfloat16", max_model_len=128, kv_cache_space=0.01)
    resident, _ = mapped_kib(str(tiny_llama / "model.safetensors"))
    assert resident == 0
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    llm.shutdown()
