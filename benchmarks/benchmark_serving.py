"""Serving latency of an OpenAI-compatible server: the same as ``pagedllm bench serve`` (see --help)."""

import sys

from pagedllm.bench import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
