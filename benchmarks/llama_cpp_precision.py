"""llama.cpp's side of precision.py: the same measures against transformers' float32 goldens, on a GGUF file, through
llama-cpp-python's bindings; runs inside the llama.cpp venv (llama_cpp_env.py), with no pagedllm there.

Each golden prompt is decoded alone (48 greedy tokens, EOS ignored); teacher-forced top-1 agreement and the first
token's logprob come from one pass over the prompt and its golden continuation, every position's logits kept.

    python llama_cpp_precision.py --model FILE.gguf --goldens precision_goldens.json --threads 2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from precision import matching_prefix


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="GGUF file")
    parser.add_argument("--goldens", required=True, type=Path, help="precision.py's goldens file")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    from llama_cpp import Llama

    goldens = json.loads(args.goldens.read_text())
    new_tokens = goldens["new_tokens"]
    goldens = goldens["goldens"]
    longest = max(len(g["prompt_token_ids"]) + new_tokens for g in goldens)
    llm = Llama(model_path=args.model, n_ctx=longest + 16, n_batch=512, n_threads=args.threads,
                n_threads_batch=args.threads, logits_all=True, verbose=False)
    prefixes, agreement, errors = [], [], []
    for g in goldens:
        prompt, golden = g["prompt_token_ids"], g["token_ids"]
        llm.reset()
        llm.eval(prompt)
        tokens = []
        for _ in range(new_tokens):
            tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval(tokens[-1:])
        prefixes.append(matching_prefix(tokens, golden))
        llm.reset()
        llm.eval(prompt + golden[:-1])  # logits after each golden prefix: the next token teacher-forced
        forced = llm.scores[len(prompt) - 1:len(prompt) - 1 + new_tokens]
        agreement.append(np.mean(forced.argmax(-1) == np.array(golden)))
        errors.append(abs(float(log_softmax(forced[0])[golden[0]]) - g["first_logprob"]))
    print(json.dumps({"exact": sum(p == new_tokens for p in prefixes), "prompts": len(goldens),
                      "mean_prefix": float(np.mean(prefixes)), "teacher_forced_top1": float(np.mean(agreement)),
                      "first_logprob_error": float(np.mean(errors)), "max_first_logprob_error": max(errors)}))


if __name__ == "__main__":
    main()
