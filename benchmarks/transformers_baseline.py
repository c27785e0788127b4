"""Offline throughput of plain transformers ``generate`` on a pagedllm workload file: a yardstick with no paged
KV cache and no continuous batching.

Requests run in batches (left-padded to the longest prompt), greedy, EOS never ending a row; a batch generates up to its
longest output length, and only the tokens each request asked for are counted. The results JSON uses the field
names of ``pagedllm bench throughput``.

    python transformers_baseline.py --model HF_FOLDER --workload W.json --output-json out.json [--batch-size 64]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from rates import rate_fields, write_results
from tqdm import tqdm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="Hugging Face model folder")
    parser.add_argument("--workload", required=True, help="pagedllm workload file (pagedllm bench --save-workload)")
    parser.add_argument("--output-json", required=True)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--batch-size", type=int, default=64, help="requests per generate call (default 64)")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    workload = json.loads(Path(args.workload).read_text())
    requests = workload["requests"]
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    model.eval()
    startup = time.perf_counter() - start
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    start = time.perf_counter()
    with torch.inference_mode():
        for i in tqdm(range(0, len(requests), args.batch_size), desc="Batches"):
            batch = requests[i:i + args.batch_size]
            width = max(len(r["prompt_token_ids"]) for r in batch)
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, r in enumerate(batch):
                n = len(r["prompt_token_ids"])
                ids[row, width - n:] = torch.tensor(r["prompt_token_ids"])
                mask[row, width - n:] = 1
            longest = max(r["output_len"] for r in batch)
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                           do_sample=False, pad_token_id=pad_id)  # min_new_tokens: EOS cannot end a row
    elapsed = time.perf_counter() - start

    num_prompt = sum(len(r["prompt_token_ids"]) for r in requests)
    num_output = sum(r["output_len"] for r in requests)
    results = {
        **rate_fields(workload["name"], len(requests), num_prompt, num_output, elapsed, startup),
        "engine": {"name": "transformers", "model": args.model, "dtype": args.dtype, "batch_size": args.batch_size,
                   "threads": torch.get_num_threads()},
    }
    write_results(args.output_json, results, "transformers generate")


if __name__ == "__main__":
    main()
