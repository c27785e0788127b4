"""Times the cpu backend's paged decode attention kernel alone, at the shapes of W1's and W2's decode steps.

Each case fills 30 layers' key and value caches (as the engine allocates them) and runs the kernel over all of them,
as one step would: W1's 64 sequences at context 316 reading scattered blocks, and W2's 32 sequences at context 584
whose first 512 tokens are a shared prefix (with and without the kernel's shared-prefix path). Beside them, a plain
sequential read of the same bytes gives the memory floor of the first case on this machine.

    python benchmarks/decode_attention.py                # bf16 (the kernels of this CPU's ISA level)
    python benchmarks/decode_attention.py --dtype float32 --repeat 30
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm.utils import cdiv

HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, LAYERS = 9, 3, 64, 8, 30  # SmolLM2-135M


def make_case(num_seqs: int, context: int, shared_blocks: int, dtype: torch.dtype):
    """(per-layer caches, block table, lengths, queries) with each sequence's own blocks scattered at random."""
    from pagedllm.backends.cpu.layers.kv_cache import lazy_zeros

    per_seq = cdiv(context, BLOCK_SIZE)
    total = shared_blocks + num_seqs * (per_seq - shared_blocks) + 8

    def cache():
        data = lazy_zeros((total, KV_HEADS, BLOCK_SIZE, HEAD_SIZE), dtype)
        data.copy_(torch.randn(data.shape))
        return data

    caches = [(cache(), cache()) for _ in range(LAYERS)]
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
    args = parser.parse_args()
    from pagedllm.backends.cpu.runner.kernels import load_kernels

    torch.set_num_threads(args.threads)
    kernels, description = load_kernels("kernel")
    dtype = getattr(torch, args.dtype)
    print(f"{description}; {args.dtype}, {args.threads} threads, {LAYERS} layers per step")
    for name, seqs, context, prefix in (("W1 decode", 64, 316, 0), ("W2 decode", 32, 584, 64)):
        caches, table, lens, q = make_case(seqs, context, prefix, dtype)
        out = torch.empty_like(q)
        for shared in sorted({0, prefix}):
            def step():
                for keys, values in caches:
                    kernels.paged_decode_attention(out, q, keys, values, None, None, None, None, table, lens,
                                                   HEAD_SIZE ** -0.5, -1, None, None, None, shared)

            ms = median_ms(step, args.repeat)
            read = 2 * seqs * (context - shared * BLOCK_SIZE) + 2 * shared * BLOCK_SIZE
            mb = read * KV_HEADS * HEAD_SIZE * q.element_size() * LAYERS / 1e6
            label = f"{name}, {seqs} x {context}" + (f", shared prefix {shared * BLOCK_SIZE}" if shared else "")
            print(f"  {label:<45} {ms:7.1f} ms   {mb:6.0f} MB of keys and values, {mb / ms:5.1f} GB/s")
        if name == "W1 decode":
            flat = [torch.cat([k.view(-1), v.view(-1)]) for k, v in caches]
            ms = median_ms(lambda: [t.sum() for t in flat], args.repeat)
            mb = sum(t.numel() * t.element_size() for t in flat) / 1e6
            print(f"  {'a sequential read of the same caches':<45} {ms:7.1f} ms   {mb:6.0f} MB, {mb / ms:5.1f} GB/s")


if __name__ == "__main__":
    main()
