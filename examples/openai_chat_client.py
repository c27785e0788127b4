"""Chat with a running `pagedllm serve`, the reply streamed token by token, with the official `openai` client.

    pagedllm serve &
    python examples/openai_chat_client.py "What is the capital of France?"
"""

import argparse
import os

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", nargs="?", default="What is the capital of France?")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()

    # OPENAI_BASE_URL and OPENAI_API_KEY (the server's --api-key, if it has one) as for any OpenAI-compatible server
    client = OpenAI(base_url=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"),
                    api_key=os.environ.get("OPENAI_API_KEY", "none"))
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": args.question}], max_tokens=args.max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True})
    usage = None
    for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
        if chunk.usage:  # the last chunk, asked for with include_usage
            usage = chunk.usage
    print(f"\n[{usage.completion_tokens} tokens streamed]")


if __name__ == "__main__":
    main()
