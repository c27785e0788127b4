"""Offline throughput of pagedllm: the same as ``pagedllm bench throughput`` (see --help)."""

import sys

from pagedllm.bench import main

if __name__ == "__main__":
    sys.exit(main(["throughput", *sys.argv[1:]]))
