"""Generate for a batch of prompts with the Python API, on any installed backend.

    python examples/offline_inference.py
    python examples/offline_inference.py --backend openvino --max-tokens 32
"""

import argparse

from pagedllm import LLM, SamplingParams

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "The future of AI is",
    "Tell me about Paris",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="Hugging Face folder, GGUF file or OpenVINO export (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--backend", default=None, help="cpu (default), openvino, ...: see `pagedllm backends`")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    llm = LLM(args.model, backend=args.backend)
    # seed: the same text on every run of the same batch (in float32, whatever else is in the batch)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_tokens=args.max_tokens)
    for output in llm.generate(PROMPTS, params, use_tqdm=False):
        print(f"{output.prompt!r} -> {output.text!r} ({len(output.token_ids)} tokens, {output.finish_reason})")

    reply = llm.chat([{"role": "user", "content": "Say hello in French."}],
                     SamplingParams(temperature=0, max_tokens=args.max_tokens), use_tqdm=False)[0]
    print(f"chat -> {reply.text!r}")
    llm.shutdown()


if __name__ == "__main__":
    main()
