# `make run` and `make test` do all the set-up on a fresh machine; both are idempotent.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
KVSERVE := $(VENV)/bin/kvserve
MODEL ?= smollm2
PROMPT ?= What is the capital of France?

.PHONY: run test setup test-setup model lint clean

$(VENV)/.setup: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU build of torch 2.13.0 is on disk here; elsewhere pip picks the build for the machine.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e .
	touch $@

$(VENV)/.test-setup: $(VENV)/.setup pyproject.toml
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

setup: $(VENV)/.setup

test-setup: $(VENV)/.test-setup

model: setup
	$(KVSERVE) pull $(MODEL)

# On a terminal: an interactive chat. Otherwise: answer one question, streaming, with timings.
run: model
	@if [ -t 0 ]; then $(KVSERVE) run $(MODEL); \
	else $(KVSERVE) run $(MODEL) "$(PROMPT)" --temperature 0; fi

test: test-setup
	$(KVSERVE) pull smollm2
	$(KVSERVE) pull gemma3-270m
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
