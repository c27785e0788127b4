"""Offline throughput of llama.cpp on a pagedllm workload file; runs inside the llama.cpp venv (llama_cpp_env.py),
through llama-cpp-python's bindings of llama.cpp's C API (no pagedllm there).

All requests run at once as llama.cpp's own batched decoding does (its ``batched`` example and its server's
slots): one context with a sequence per request, prompts fed in batches of up to ``--n-batch`` tokens, then one
``llama_decode`` per step with the next token of every unfinished sequence. Greedy (argmax of the logits) with EOS
ignored, exactly as ``pagedllm bench throughput --workload`` runs them; the results JSON uses the same field names,
plus the process's peak RSS.

    python llama_cpp_offline.py --model FILE.gguf --workload W.json --output-json out.json --threads 2
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time
from pathlib import Path

import numpy as np

from rates import rate_fields, write_results


def request_amx_permission() -> None:
    """Linux gives a process AMX's tile registers only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM); this build
    of llama.cpp's AMX kernels uses them without asking, and dies of SIGILL on the first tile load otherwise."""
    import platform

    if platform.system() == "Linux" and platform.machine() == "x86_64":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall(158, 0x1023, 18)  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA; harmless without AMX


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="GGUF file")
    parser.add_argument("--workload", required=True, help="pagedllm workload file (pagedllm bench --save-workload)")
    parser.add_argument("--output-json", required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-batch", type=int, default=2048, help="tokens per llama_decode call at most")
    args = parser.parse_args()

    workload = json.loads(Path(args.workload).read_text())
    requests = workload["requests"]
    start = time.perf_counter()
    import llama_cpp as lc

    request_amx_permission()
    lc.llama_backend_init()
    model_params = lc.llama_model_default_params()
    model = lc.llama_model_load_from_file(args.model.encode(), model_params)
    if not model:
        raise SystemExit(f"llama.cpp could not load {args.model}")
    vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    params = lc.llama_context_default_params()
    params.n_seq_max = len(requests)
    params.n_ctx = len(requests) * (max(len(r["prompt_token_ids"]) + r["output_len"] for r in requests) + 16)
    params.n_batch = params.n_ubatch = args.n_batch
    params.n_threads = params.n_threads_batch = args.threads
    # a KV stream per sequence, as llama-server's parallel slots use by default: with one unified cache every token
    # attends over all cells of all sequences (masked), whose cost grows with the number of sequences
    params.kv_unified = False
    ctx = lc.llama_init_from_model(model, params)
    if not ctx:
        raise SystemExit("llama.cpp could not make a context of that size")
    batch = lc.llama_batch_init(args.n_batch, 0, 1)
    startup = time.perf_counter() - start

    def decode(items: list[tuple[int, int, int, bool]]) -> list[int]:
        """One llama_decode over (token, position, sequence, wants logits); the argmax of each wanted row."""
        batch.n_tokens = len(items)
        for i, (token, pos, seq, logits) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        if lc.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")
        rows = [i for i, item in enumerate(items) if item[3]]
        return [int(np.ctypeslib.as_array(ctypes.cast(lc.llama_get_logits_ith(ctx, i), ctypes.POINTER(ctypes.c_float)),
                                          shape=(vocab,)).argmax()) for i in rows]

    outputs = [[] for _ in requests]
    start = time.perf_counter()
    # prompts: every token of every prompt, in batches; the last token of each prompt gives its first output
    pending = [(token, pos, seq, pos == len(r["prompt_token_ids"]) - 1)
               for seq, r in enumerate(requests) for pos, token in enumerate(r["prompt_token_ids"])]
    for first in range(0, len(pending), args.n_batch):
        items = pending[first:first + args.n_batch]
        for item, token in zip([i for i in items if i[3]], decode(items)):
            outputs[item[2]].append(token)
    while True:
        items = [(out[-1], len(r["prompt_token_ids"]) + len(out) - 1, seq, True)
                 for seq, (r, out) in enumerate(zip(requests, outputs)) if len(out) < r["output_len"]]
        if not items:
            break
        for first in range(0, len(items), args.n_batch):
            part = items[first:first + args.n_batch]
            for item, token in zip(part, decode(part)):
                outputs[item[2]].append(token)
    elapsed = time.perf_counter() - start

    num_prompt = sum(len(r["prompt_token_ids"]) for r in requests)
    results = {
        **rate_fields(workload["name"], len(requests), num_prompt, sum(len(o) for o in outputs), elapsed, startup),
        "first_output_token_ids": outputs[0][:16],
        "engine": {"name": "llama.cpp", "version": lc.__version__, "model": args.model, "threads": args.threads,
                   "n_batch": args.n_batch},
    }
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(model)
    write_results(args.output_json, results, f"llama.cpp (llama-cpp-python {lc.__version__})")


if __name__ == "__main__":
    main()
