# graphsafe developer tasks. `make demo` and `make test` are all a fresh machine needs.
#
# Overridable:
#   PYTHON      interpreter used to create .venv          (default: python3)
#   TORCH_SPEC  what pip installs for torch, before the package.  The default pin
#               matches the CPU wheel that lies on this workplace's machines; an
#               unpinned `torch` would download a multi-GB CUDA build.
#   EXTRAS      extras of the package to install           (default: test)

PYTHON     ?= python3
TORCH_SPEC ?= torch==2.13.0
EXTRAS     ?= test

VENV := .venv
BIN  := $(VENV)/bin

# The stamp's name hashes pyproject.toml's content and the install knobs, so editing
# the dependencies (or overriding TORCH_SPEC / EXTRAS) reinstalls, and nothing else
# does (not even a touch or a branch switch that leaves the content alone).
INSTALL_HASH := $(shell { cat pyproject.toml; echo '$(TORCH_SPEC) [$(EXTRAS)]'; } | sha256sum | cut -c1-12)
STAMP := $(VENV)/.installed-$(INSTALL_HASH)

.PHONY: venv demo test lint typecheck pytest gpu-test bench clean distclean

venv: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): | $(BIN)/python
	$(BIN)/python -m pip install '$(TORCH_SPEC)'
	$(BIN)/python -m pip install -e '.[$(EXTRAS)]'
	rm -f $(VENV)/.installed-*
	touch $@

demo: venv
	$(BIN)/graphsafe demo

lint: venv
	$(BIN)/ruff check src tests

typecheck: venv
	$(BIN)/mypy --strict src/graphsafe

pytest: venv
	$(BIN)/python -m pytest -q

# Lint, type-check, then the whole suite (slow tests included), in that order.
test: venv
	$(BIN)/ruff check src tests
	$(BIN)/mypy --strict src/graphsafe
	$(BIN)/python -m pytest -q

# For the GPU machine: its system python3 already has torch (CUDA) and pytest,
# and nothing can be installed there, so no venv.
gpu-test:
	PYTHONPATH=src python3 -m pytest tests/gpu -q

bench: venv
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
