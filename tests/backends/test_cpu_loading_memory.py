"""Loading keeps no more than the model: a checkpoint's mapped pages go back once its weights are copied (packed),
and only pages that hold nothing but the file's bytes, in ranges still mapped as they were, are ever dropped."""

import ctypes
import mmap
import sys

import pytest
import torch

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


def mapped_ranges() -> set[tuple[int, int]]:
    return {tuple(int(bound, 16) for bound in line.split()[0].split("-")) for line in checkpoint_mappings()}


def test_a_written_private_mapping_is_never_dropped(tmp_path):
    path = tmp_path / "weights.safetensors"
    path.write_bytes(b"\1" * 4 * mmap.PAGESIZE)
    with open(path, "r+b") as f:
        region = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    view = ctypes.c_char.from_buffer(region)
    address = ctypes.addressof(view)
    assert region[0] == 1 and (address, address + 4 * mmap.PAGESIZE) in mapped_ranges()  # read: droppable
    region[0] = 7  # written: the page is the process's own now
    assert (address, address + 4 * mmap.PAGESIZE) not in mapped_ranges()
    drop_checkpoint_pages(checkpoint_mappings())
    assert region[0] == 7 and region[mmap.PAGESIZE] == 1
    del view
    region.close()


def test_a_mapping_gone_since_is_left_alone(tmp_path, monkeypatch):
    """Its range may hold other memory by now, where dropping pages would zero them."""
    from pagedllm.backends.common import memory

    path = tmp_path / "gone.safetensors"
    path.write_bytes(b"\1" * mmap.PAGESIZE)
    with open(path, "rb") as f:
        region = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    assert region[0] == 1
    regions = [line for line in checkpoint_mappings() if line.endswith(str(path))]
    assert len(regions) == 1
    dropped = []
    monkeypatch.setattr(memory, "madvise", lambda address, nbytes, advice: dropped.append((nbytes, advice)))
    drop_checkpoint_pages(regions)
    assert dropped == [(mmap.PAGESIZE, memory.MADV_DONTNEED)]  # still mapped: dropped
    region.close()
    drop_checkpoint_pages(regions)
    assert len(dropped) == 1


def test_packing_a_folders_weights_leaves_its_files_pages_behind(tiny_llama, tmp_path):
    """bf16 files into a bf16 model: transformers keeps the parameters as views of the mapped file, and packing reads
    every page of a weight into a copy of its own; those pages go back as each weight is packed."""
    from transformers import AutoModelForCausalLM

    from pagedllm.backends.cpu.layers.packed_linear import use_packed_linears
    from pagedllm.backends.cpu.runner.kernels import load_kernels

    kernels, _ = load_kernels("auto")
    if kernels is None or not kernels.linear_bf16_available():
        pytest.skip("bf16 weights are packed only with the AVX512_BF16 kernels")
    AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    file = str(tmp_path / "model.safetensors")
    assert mapped_kib(file)[1] >= 1  # the parameters view the mapped file
    for module in model.modules():  # read every weight, as packing does
        if isinstance(module, torch.nn.Linear):
            module.weight.float().sum()
    assert mapped_kib(file)[0] > 0
    counts = use_packed_linears(model, kernels)
    assert counts["brgemm"] + counts["brgemm+silu"] > 0
    assert mapped_kib(file) == (0, 1)  # still mapped (the embedding views it), none of it resident
    with torch.inference_mode():  # what still views it faults back in from the file
        logits = model(torch.tensor([[5, 6, 7]])).logits
    assert torch.isfinite(logits).all()
