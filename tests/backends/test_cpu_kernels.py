"""The C++ paged attention kernels (decode, prompt chunks) against plain torch math on the same cache contents."""

import contextlib

import pytest
import torch

from pagedllm.backends.common.cpu_features import kernel_level, rank
from pagedllm.backends.cpu.layers.attention import shared_prefix_blocks
from pagedllm.backends.cpu.layers.kv_cache import (BlockCache, ChannelQuantizedBlockCache, QuantizedBlockCache,
                                                   slot_rows, write_u8)
from pagedllm.backends.cpu.runner.kernels import load_kernels
from pagedllm.utils import cdiv

pytestmark = [pytest.mark.skipif(load_kernels("auto")[0] is None, reason="the C++ kernels could not be built here"),
              pytest.mark.cpu_isa]
# Every build this CPU runs, but avx2 where the second CI pass (PAGEDLLM_CPU_ISA=avx2) runs it: the one in use here,
# the portable one, and AVX-512 without bf16.
LEVELS = sorted({kernel_level(), *(lvl for lvl in ("generic", "avx512") if rank(lvl) <= rank(kernel_level()))},
                key=rank)


@pytest.fixture(params=LEVELS, scope="module")
def kernels(request):
    return load_kernels("kernel", request.param)[0]

BS, HKV, GROUPS, D = 16, 3, 3, 64


def reference(q, keys, values, lens, scale, window):
    """q [B, Hq, D]; keys/values [B, Hkv, S, D] (already dequantized) -> [B, Hq, D]."""
    out = torch.empty_like(q, dtype=torch.float32)
    for b, n in enumerate(lens):
        first = max(0, n - window) if window > 0 else 0
        k = keys[b, :, first:n].float().repeat_interleave(GROUPS, 0)
        v = values[b, :, first:n].float().repeat_interleave(GROUPS, 0)
        w = torch.softmax((q[b].float().unsqueeze(1) @ k.transpose(1, 2)).squeeze(1) * scale, dim=-1)
        out[b] = (w.unsqueeze(1) @ v).squeeze(1)
    return out


def make_caches(cache: str, num_blocks: int, dim: int = D):
    if cache == "u8":
        return [ChannelQuantizedBlockCache(num_blocks, HKV, BS, dim), QuantizedBlockCache(num_blocks, HKV, BS, dim)]
    dtype = torch.float32 if cache == "fp32" else torch.bfloat16
    return [BlockCache(num_blocks, HKV, BS, dim, dtype) for _ in range(2)]


def fill_caches(caches, lengths: list[int], num_blocks: int) -> tuple[torch.Tensor, int]:
    """Random keys/values for sequences of these lengths in scattered blocks; (block table, its width)."""
    width = max(cdiv(n, BS) for n in lengths)
    perm = torch.randperm(num_blocks)
    table = torch.zeros(len(lengths), width, dtype=torch.long)
    used = 0
    for b, n in enumerate(lengths):
        nb = cdiv(n, BS)
        table[b, :nb] = perm[used:used + nb]
        used += nb
        positions = torch.arange(n)
        write_random(caches, table[b, positions // BS] * BS + positions % BS)
    return table, width


def write_random(caches, slots: torch.Tensor) -> None:
    """Random keys and values at the slots (a sequence's tokens, in position order) of one layer's caches."""
    dim = caches[1].data.shape[-1]
    if isinstance(caches[0], ChannelQuantizedBlockCache):
        write_u8(*caches, torch.randn(len(slots), HKV, dim), torch.randn(len(slots), HKV, dim), slots)
        return
    for c in caches:
        c.write(torch.randn(len(slots), HKV, dim), slot_rows(slots, HKV, BS))


@pytest.mark.parametrize("dtype, cache", [(torch.float32, "fp32"), (torch.bfloat16, "bf16"),
                                          (torch.float32, "u8"), (torch.bfloat16, "u8")])
@pytest.mark.parametrize("window", [-1, 20])
def test_kernel_matches_torch(dtype, cache, window, kernels):
    torch.manual_seed(0)
    lens = [1, 15, 16, 17, 40, 77]
    num_blocks = 64
    caches = make_caches(cache, num_blocks)
    table, width = fill_caches(caches, lens, num_blocks)
    q = torch.randn(len(lens), HKV * GROUPS, D).to(dtype)
    keys = caches[0].gather(table.reshape(-1), len(lens), width, torch.float32)
    values = caches[1].gather(table.reshape(-1), len(lens), width, torch.float32)
    scale = D ** -0.5
    expected = reference(q, keys, values, lens, scale, window)
    out = torch.empty_like(q)
    k, v = caches
    kernels.paged_decode_attention(out, q, k.data, v.data, getattr(k, "scale", None), getattr(k, "minimum", None),
                                   getattr(v, "scale", None), getattr(v, "minimum", None), table,
                                   torch.tensor(lens), scale, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@contextlib.contextmanager
def intra_op_threads(count: int):
    """The kernels cut a sequence into runs for threads that would otherwise idle: more threads than KV heads."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def attend_and_compare(kernels, dtype, caches, table, lens: list[int], window: int, shared_blocks: int = 0) -> None:
    width = table.shape[1]
    q = torch.randn(len(lens), HKV * GROUPS, D).to(dtype)
    keys = caches[0].gather(table.reshape(-1), len(lens), width, torch.float32)
    values = caches[1].gather(table.reshape(-1), len(lens), width, torch.float32)
    expected = reference(q, keys, values, lens, D ** -0.5, window)
    out = torch.empty_like(q)
    k, v = caches
    kernels.paged_decode_attention(out, q, k.data, v.data, getattr(k, "scale", None), getattr(k, "minimum", None),
                                   getattr(v, "scale", None), getattr(v, "minimum", None), table,
                                   torch.tensor(lens), D ** -0.5, window, shared_blocks=shared_blocks)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, cache", [(torch.float32, "fp32"), (torch.bfloat16, "bf16"),
                                          (torch.float32, "u8")])
@pytest.mark.parametrize("window", [-1, 700])
@pytest.mark.parametrize("threads", [1, 8])
def test_long_contexts_are_attended_chunk_by_chunk_and_in_runs(dtype, cache, window, threads, kernels):
    """Contexts of several chunks (128 KiB of a cache each: 512 float32 keys at head size 64, 1024 bf16, 2048 u8),
    a window that starts inside one, one sequence alone and a batch; with 8 threads a sequence's 3 KV heads leave
    threads idle, so each is cut into runs whose partial sums are merged."""
    torch.manual_seed(0)
    for lens in ([4500], [1, 17, 600, 1300, 4500]):
        num_blocks = sum(cdiv(n, BS) for n in lens) + 4
        caches = make_caches(cache, num_blocks)
        table, _ = fill_caches(caches, lens, num_blocks)
        with intra_op_threads(threads):
            attend_and_compare(kernels, dtype, caches, table, lens, window)


def test_without_runs_a_sequence_sums_alike_alone_and_in_a_batch(kernels):
    """split_runs=False (batch-invariant mode) keeps a long sequence's sums in one order, bitwise, whatever else is
    in the step; with runs, alone it is cut into several and merged."""
    torch.manual_seed(0)
    lens = [3000] + [40] * 7
    caches = make_caches("fp32", 300)
    table, _ = fill_caches(caches, lens, 300)
    q = torch.randn(len(lens), HKV * GROUPS, D)
    k, v = caches
    outs = {}
    with intra_op_threads(8):
        for split in (False, True):
            for count in (1, len(lens)):
                out = torch.empty_like(q[:count])
                kernels.paged_decode_attention(out, q[:count], k.data, v.data, None, None, None, None,
                                               table[:count].contiguous(), torch.tensor(lens[:count]), D ** -0.5, -1,
                                               split_runs=split)
                outs[split, count] = out[0]
    torch.testing.assert_close(outs[False, 1], outs[False, len(lens)], atol=0, rtol=0)
    assert not torch.equal(outs[True, 1], outs[True, len(lens)])  # cut into runs alone, whole in the batch
    torch.testing.assert_close(outs[True, 1], outs[False, 1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype, cache", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
def test_runs_merge_with_a_shared_prefix(dtype, cache, kernels):
    torch.manual_seed(0)
    lens = [1600, 2100, 1250, 1900]
    caches = make_caches(cache, 512)
    table = fill_shared_prefix(caches, 9, lens, 512)
    with intra_op_threads(8):
        attend_and_compare(kernels, dtype, caches, table, lens, -1, shared_blocks=9)


@pytest.mark.parametrize("dtype, cache", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                          (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("threads", [1, 8])
def test_kernel_stores_the_new_rows_it_is_given(dtype, cache, threads, kernels):
    """Given this step's keys and values, the kernel writes them into their slots before attending: the same
    cache contents and output as a row copy followed by the kernel (with 8 threads the longest sequence is cut into
    runs, and the run holding its newest token writes it)."""
    torch.manual_seed(1)
    lens = [1, 16, 17, 33, 2100]
    num_blocks = 700
    width = max(cdiv(n, BS) for n in lens)
    table = torch.randperm(num_blocks)[:len(lens) * width].view(len(lens), width).contiguous()
    positions = torch.tensor(lens) - 1
    slots = table[torch.arange(len(lens)), positions // BS] * BS + positions % BS
    q = torch.randn(len(lens), HKV * GROUPS, D).to(dtype)
    # [T, Hkv, D] views with the strides transformers hands over (head-major underneath)
    new_k = torch.randn(HKV, len(lens), D).to(dtype).transpose(0, 1)
    new_v = torch.randn(HKV, len(lens), D).to(dtype).transpose(0, 1)
    outputs, contents = [], []
    for in_kernel in (False, True):
        k, v = (BlockCache(num_blocks, HKV, BS, D, cache) for _ in range(2))
        torch.manual_seed(2)
        for c in (k, v):
            c.data.copy_(torch.randn(c.data.shape))
        if not in_kernel:
            rows = slot_rows(slots, HKV, BS)
            k.write(new_k, rows)
            v.write(new_v, rows)
        out = torch.empty_like(q)
        extra = dict(new_keys=new_k, new_values=new_v, slots=slots) if in_kernel else {}
        with intra_op_threads(threads):
            kernels.paged_decode_attention(out, q, k.data, v.data, None, None, None, None, table,
                                           torch.tensor(lens), D ** -0.5, -1, **extra)
        outputs.append(out)
        contents.append((k.data.clone(), v.data.clone()))
    torch.testing.assert_close(outputs[1], outputs[0], atol=0, rtol=0)
    torch.testing.assert_close(contents[1], contents[0], atol=0, rtol=0)


def check_prefill(kernels, dtype, caches, table, past_lens: list[int], q_lens: list[int], window: int) -> None:
    """The prefill kernel's output for these chunks equals attention over the gathered keys and values."""
    totals = [p + n for p, n in zip(past_lens, q_lens)]
    width = table.shape[1]
    starts = torch.tensor([0] + q_lens).cumsum(0)[:-1]
    dim = caches[1].data.shape[-1]
    q = torch.randn(HKV * GROUPS, sum(q_lens), dim).to(dtype).transpose(0, 1)  # [T, Hq, D], as transformers hands it
    keys = caches[0].gather(table.reshape(-1), len(totals), width, torch.float32)
    values = caches[1].gather(table.reshape(-1), len(totals), width, torch.float32)
    scale = dim ** -0.5
    expected = torch.zeros(q.shape)
    for b, (past, n) in enumerate(zip(past_lens, q_lens)):
        for j in range(n):
            pos = past + j
            row = int(starts[b]) + j
            expected[row] = reference(q[row:row + 1], keys[b:b + 1], values[b:b + 1], [pos + 1], scale, window)[0]
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    k, v = caches
    kernels.paged_prefill_attention(out, q, k.data, v.data, getattr(k, "scale", None), getattr(k, "minimum", None),
                                    getattr(v, "scale", None), getattr(v, "minimum", None), table,
                                    torch.tensor(past_lens), starts, torch.tensor(q_lens), scale, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, cache", [(torch.float32, "fp32"), (torch.bfloat16, "bf16"),
                                          (torch.float32, "u8"), (torch.float32, "bf16")])
@pytest.mark.parametrize("window", [-1, 20])
def test_prefill_kernel_matches_torch(dtype, cache, window, kernels):
    """Prompt chunks of several lengths, some behind cached tokens (prefix caching, earlier chunks): every query
    token sees the keys up to its own position (and within the window), read from the blocks in place."""
    torch.manual_seed(3)
    past_lens = [0, 0, 5, 16, 40, 0]
    q_lens = [1, 37, 3, 16, 21, 70]  # tiles of 16 tokens: whole, partial and single-token ones
    num_blocks = 64
    caches = make_caches(cache, num_blocks)
    table, _ = fill_caches(caches, [p + n for p, n in zip(past_lens, q_lens)], num_blocks)
    check_prefill(kernels, dtype, caches, table, past_lens, q_lens, window)


@pytest.mark.parametrize("dtype, cache", [(torch.float32, "fp32"), (torch.bfloat16, "bf16"), (torch.float32, "u8")])
@pytest.mark.parametrize("window", [-1, 700])
def test_prefill_behind_long_cached_contexts(dtype, cache, window, kernels):
    """Prompt chunks behind long cached contexts (an agent's conversation): a short chunk after 1000 and 2040
    cached tokens, a window that starts far inside the context, and a long chunk of its own."""
    torch.manual_seed(4)
    past_lens, q_lens = [1000, 2040, 0], [40, 30, 600]
    lengths = [p + n for p, n in zip(past_lens, q_lens)]
    num_blocks = sum(cdiv(n, BS) for n in lengths) + 4
    caches = make_caches(cache, num_blocks)
    table, _ = fill_caches(caches, lengths, num_blocks)
    check_prefill(kernels, dtype, caches, table, past_lens, q_lens, window)


@pytest.mark.parametrize("dim", [16, 48, 80, 128])
def test_prefill_kernel_matches_torch_at_other_head_sizes(dim, kernels):
    """bf16's tile GEMMs pack values 32 dimensions at a time, then the remainder one by one: head sizes that are and
    are not multiples of 32, and prompts whose last key tile is cut short of 64 keys."""
    torch.manual_seed(4)
    past_lens, q_lens = [0, 0, 7], [16, 90, 40]
    caches = make_caches("bf16", 64, dim)
    table, _ = fill_caches(caches, [p + n for p, n in zip(past_lens, q_lens)], 64)
    check_prefill(kernels, torch.bfloat16, caches, table, past_lens, q_lens, -1)


@pytest.mark.parametrize("dtype, cache", [(torch.float32, "fp32"), (torch.bfloat16, "bf16"), (torch.float32, "u8")])
def test_prefill_chunks_behind_a_shared_cached_prefix(dtype, cache, kernels):
    """Chunks whose first 144 tokens are the same cached blocks (a system prompt the prefix cache shares), the rest
    their own: the bf16 path packs each shared key tile once for all of them, and every chunk still reads its own
    tokens."""
    torch.manual_seed(4)
    past_lens = [144, 130, 190, 0, 200]
    q_lens = [5, 30, 8, 150, 1]
    caches = make_caches(cache, 128)
    table = fill_shared_prefix(caches, 144 // BS, [p + n for p, n in zip(past_lens, q_lens)], 128)
    check_prefill(kernels, dtype, caches, table, past_lens, q_lens, -1)


def fill_shared_prefix(caches, prefix_blocks: int, lengths: list[int], num_blocks: int) -> torch.Tensor:
    """Sequences that begin with the same ``prefix_blocks`` blocks (as the prefix cache shares them), then blocks
    of their own, random contents; returns the block table."""
    width = max(cdiv(n, BS) for n in lengths)
    perm = torch.randperm(num_blocks)
    table = torch.zeros(len(lengths), width, dtype=torch.long)
    table[:, :prefix_blocks] = perm[:prefix_blocks]
    used = prefix_blocks
    prefix = torch.arange(prefix_blocks * BS)
    write_random(caches, table[0, prefix // BS] * BS + prefix % BS)
    for b, n in enumerate(lengths):
        own = cdiv(n, BS) - prefix_blocks
        table[b, prefix_blocks:prefix_blocks + own] = perm[used:used + own]
        used += own
        positions = torch.arange(prefix_blocks * BS, n)
        write_random(caches, table[b, positions // BS] * BS + positions % BS)
    return table


@pytest.mark.parametrize("dtype, cache", [(torch.float32, "fp32"), (torch.bfloat16, "bf16"),
                                          (torch.float32, "u8")])
@pytest.mark.parametrize("prefix_blocks", [3, 9])  # 48 and 144 keys: one key tile of bf16's GEMMs, and three
def test_a_shared_prefix_is_attended_once_per_tile_with_the_same_result(dtype, cache, prefix_blocks, kernels):
    torch.manual_seed(0)
    lens = [49, 64, 65, 120, 50, 77, 90, 100, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62]  # two tiles of 16
    lens = [n + (prefix_blocks - 3) * BS for n in lens]
    caches = make_caches(cache, 128)
    table = fill_shared_prefix(caches, prefix_blocks, lens, 128)
    width = table.shape[1]
    q = torch.randn(len(lens), HKV * GROUPS, D).to(dtype)
    keys = caches[0].gather(table.reshape(-1), len(lens), width, torch.float32)
    values = caches[1].gather(table.reshape(-1), len(lens), width, torch.float32)
    expected = reference(q, keys, values, lens, D ** -0.5, -1)
    k, v = caches
    outs = []
    for shared_blocks in (0, prefix_blocks):
        out = torch.empty_like(q)
        kernels.paged_decode_attention(out, q, k.data, v.data, getattr(k, "scale", None),
                                       getattr(k, "minimum", None), getattr(v, "scale", None),
                                       getattr(v, "minimum", None), table, torch.tensor(lens), D ** -0.5, -1,
                                       shared_blocks=shared_blocks)
        outs.append(out.float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[1], expected, atol=tol, rtol=tol)
    torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)


def test_shared_blocks_are_checked(kernels):
    caches = make_caches("fp32", 32)
    table = fill_shared_prefix(caches, 2, [40, 33], 32)
    q, out = torch.randn(2, HKV * GROUPS, D), torch.empty(2, HKV * GROUPS, D)
    k, v = caches
    call = lambda lens, window, shared: kernels.paged_decode_attention(  # noqa: E731
        out, q, k.data, v.data, None, None, None, None, table, torch.tensor(lens), 0.125, window,
        shared_blocks=shared)
    with pytest.raises(RuntimeError, match="sliding window"):
        call([40, 33], 20, 2)
    with pytest.raises(RuntimeError, match="extend past"):
        call([40, 32], -1, 2)
    with pytest.raises(RuntimeError, match="out of range"):
        call([40, 33], -1, 9)


def test_shared_prefix_blocks_are_the_leading_columns_all_decodes_hold():
    table = torch.tensor([[7, 8, 9, 10, 11, 1], [7, 8, 9, 10, 11, 2], [7, 8, 9, 10, 11, 3], [7, 8, 9, 10, 12, 4]])
    lens = torch.tensor([48, 48, 48, 48])
    assert shared_prefix_blocks(table, lens, 8) == 4
    assert shared_prefix_blocks(table[:3], lens[:3], 8, min_seqs=3) == 5
    assert shared_prefix_blocks(table, torch.tensor([48, 48, 33, 48]), 8) == 4  # 33 tokens: 4 full blocks before
    assert shared_prefix_blocks(table, torch.tensor([48, 48, 32, 48]), 8) == 0  # its newest token is in block 3
    assert shared_prefix_blocks(table[:3], lens[:3], 8) == 0  # fewer than four sequences
    assert shared_prefix_blocks(table, lens, 8, min_tokens=40) == 0
    assert shared_prefix_blocks(table, lens * 2, 16) == 4  # the minimum is in tokens, not blocks
    assert shared_prefix_blocks(table, lens, 16) == 2  # the newest token is in block 2: 32 tokens, just enough
