"""Ask a running `pagedllm serve` for completions with the official `openai` client.

    pagedllm serve &
    python examples/openai_completion_client.py     # OPENAI_BASE_URL=http://HOST:PORT/v1 for another server
"""

import argparse
import os

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    # OPENAI_BASE_URL and OPENAI_API_KEY (the server's --api-key, if it has one) as for any OpenAI-compatible server
    client = OpenAI(base_url=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"),
                    api_key=os.environ.get("OPENAI_API_KEY", "none"))
    model = client.models.list().data[0].id  # the server's --served-model-name, or its model's name
    completion = client.completions.create(
        model=model, prompt=["The capital of France is", "Once upon a time"], max_tokens=args.max_tokens,
        temperature=0, logprobs=1)
    for choice in completion.choices:
        print(f"[{choice.index}] {choice.text!r} (finish_reason {choice.finish_reason}, "
              f"first token logprob {choice.logprobs.token_logprobs[0]:.3f})")
    usage = completion.usage
    print(f"model {completion.model}: {usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens")


if __name__ == "__main__":
    main()
