"""Times the cpu backend's paged decode attention kernel alone, at the shapes of W1's and W2's decode steps.

Each case fills 30 layers' key and value caches (as the engine allocates them) and runs the kernel over all of them,
as one step would: W1's 64 sequences at context 316 reading scattered blocks, and W2's 32 sequences at context 584
whose first 512 tokens are a shared prefix (with and without the kernel's shared-prefix path), and one request at
context 8192 (an agent's long conversation: fewer (sequence, KV head) items than threads can share, so the kernel
cuts the sequence into runs). Beside them, a plain sequential read of the same bytes gives the memory floor of the
first case on this machine.

    python benchmarks/decode_attention.py                # bf16 (the kernels of this CPU's ISA level)
    python benchmarks/decode_attention.py --dtype float32 --repeat 30
    python benchmarks/decode_attention.py --kv-cache u8    # the u8 cache (float32 queries)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm.utils import cdiv

HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, LAYERS = 9, 3, 64, 16, 30  # SmolLM2-135M, the backend's blocks


def make_case(num_seqs: int, context: int, shared_blocks: int, dtype: torch.dtype, u8: bool):
    """(per-layer caches as the kernel's keyword arguments, block table, lengths, queries) with each sequence's own
    blocks scattered at random."""
    from pagedllm.backends.cpu.layers import kv_cache

    per_seq = cdiv(context, BLOCK_SIZE)
    total = shared_blocks + num_seqs * (per_seq - shared_blocks) + 8

    def layer():
        keys, values = kv_cache.make_layer_caches("u8" if u8 else "plain", total, KV_HEADS, BLOCK_SIZE, HEAD_SIZE,
                                                  dtype)
        for cache in (keys, values):
            if u8:
                cache.data.copy_(torch.randint(0, 256, cache.data.shape, dtype=torch.uint8))
                cache.scale.fill_(0.02)
                cache.minimum.fill_(-2.5)
            else:
                cache.data.copy_(torch.randn(cache.data.shape))
        return kv_cache.kernel_arguments(keys, values)

    caches = [layer() for _ in range(LAYERS)]
    own = torch.randperm(total - shared_blocks)[: num_seqs * (per_seq - shared_blocks)].view(num_seqs, -1)
    table = torch.cat([torch.arange(shared_blocks).expand(num_seqs, -1), own + shared_blocks], 1).contiguous()
    lens = torch.full((num_seqs,), context, dtype=torch.long)
    return caches, table, lens, torch.randn(num_seqs, HEADS, HEAD_SIZE).to(dtype)


def median_ms(fn, repeat: int) -> float:
    fn()  # warm-up: brgemm kernels and first touches
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-cache", default="plain", choices=("plain", "u8"),
                        help="plain: the cache in --dtype; u8: the u8 cache")
    args = parser.parse_args()
    from pagedllm.backends.cpu.runner.kernels import load_kernels

    torch.set_num_threads(args.threads)
    kernels, description = load_kernels("kernel")
    dtype = getattr(torch, args.dtype)
    u8 = args.kv_cache == "u8"
    print(f"{description}; {args.dtype} queries, {'u8' if u8 else args.dtype} cache, {args.threads} threads, "
          f"{LAYERS} layers per step")
    cases = (("W1 decode", 64, 316, 0), ("W2 decode", 32, 584, 512 // BLOCK_SIZE), ("one long decode", 1, 8192, 0))
    for name, seqs, context, prefix in cases:
        caches, table, lens, q = make_case(seqs, context, prefix, dtype, u8)
        out = torch.empty_like(q)
        for shared in sorted({0, prefix}):
            def step():
                for layer in caches:
                    kernels.paged_decode_attention(out=out, query=q, **layer, block_table=table, seq_lens=lens,
                                                   scale=HEAD_SIZE ** -0.5, window=-1, shared_blocks=shared)

            ms = median_ms(step, args.repeat)
            read = 2 * seqs * (context - shared * BLOCK_SIZE) + 2 * shared * BLOCK_SIZE
            mb = read * KV_HEADS * HEAD_SIZE * caches[0]["key_cache"].element_size() * LAYERS / 1e6
            label = f"{name}, {seqs} x {context}" + (f", shared prefix {shared * BLOCK_SIZE}" if shared else "")
            print(f"  {label:<45} {ms:7.1f} ms   {mb:6.0f} MB of keys and values, {mb / ms:5.1f} GB/s")
        if name == "W1 decode":
            flat = [torch.cat([layer["key_cache"].view(-1), layer["value_cache"].view(-1)]) for layer in caches]
            ms = median_ms(lambda: [t.sum() for t in flat], args.repeat)
            mb = sum(t.numel() * t.element_size() for t in flat) / 1e6
            print(f"  {'a sequential read of the same caches':<45} {ms:7.1f} ms   {mb:6.0f} MB, {mb / ms:5.1f} GB/s")


if __name__ == "__main__":
    main()
