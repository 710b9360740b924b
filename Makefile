# `make run` and `make test` do all the set-up on a fresh machine; both are idempotent.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
KVSERVE := $(VENV)/bin/kvserve
MODEL ?= smollm2
PROMPT ?= What is the capital of France?

.PHONY: run test bench llama-cpp setup test-setup cross-tools browser agents model lint clean

# `make run` installs no torch: the CPU runtime needs none. The tests compare with it (transformers, the torch
# forward): the CPU build of torch 2.13.0 is on disk here; elsewhere pip picks the build for the machine.
$(VENV)/.setup: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	touch $@

$(VENV)/.test-setup: $(VENV)/.setup pyproject.toml
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,torch]'
	touch $@

setup: $(VENV)/.setup

test-setup: $(VENV)/.test-setup

model: setup
	$(KVSERVE) pull $(MODEL)

# On a terminal: an interactive chat. Otherwise: answer one question, streaming, with timings.
run: model
	@if [ -t 0 ]; then $(KVSERVE) run $(MODEL); \
	else $(KVSERVE) run $(MODEL) "$(PROMPT)" --temperature 0; fi

# Debian's aarch64 cross compiler and qemu-user (the ARM kernel tests, tests/native/test_arm.py) and clang
# (a build without OpenMP); where they cannot be installed those tests report themselves skipped.
cross-tools:
	@if ! command -v qemu-aarch64 >/dev/null || ! command -v aarch64-linux-gnu-gcc >/dev/null \
			|| ! command -v clang >/dev/null; then \
		if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
			(apt-get update -qq && apt-get install -y -qq gcc-aarch64-linux-gnu qemu-user clang >/dev/null) \
				|| echo "note: aarch64 cross tools not installed: the ARM kernel tests will be skipped"; \
		else echo "note: no aarch64 cross tools: the ARM kernel tests will be skipped"; fi; \
	fi

# Debian's Chromium and its driver for the web page's tests (tests/browser; Selenium is given this
# chromedriver, so nothing downloads a browser); where they cannot be installed those tests report
# themselves skipped.
browser:
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
		if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
			(apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null) \
				|| echo "note: chromium not installed: the web page's browser tests will be skipped"; \
		else echo "note: no chromium: the web page's browser tests will be skipped"; fi; \
	fi

# Claude Code, Codex CLI and Qwen Code from the npm registry, at the versions tests/agents/package.json pins,
# into build/agents (their platform binaries come as npm packages); without npm the agent tests are skipped.
AGENTS := build/agents/.installed
agents:
	@if command -v npm >/dev/null; then $(MAKE) --no-print-directory $(AGENTS); \
	else echo "note: no npm: the coding-agent tests will be skipped"; fi

$(AGENTS): tests/agents/package.json
	mkdir -p build/agents && cp tests/agents/package.json build/agents/package.json
	cd build/agents && npm install --no-audit --no-fund --loglevel=error
	touch $@

# lint first: CI runs `make test`, and a rule broken fails it in seconds, not after the suite
test: test-setup lint cross-tools browser agents
	$(KVSERVE) pull smollm2
	$(KVSERVE) pull gemma3-270m
	$(KVSERVE) pull qwen2.5-coder-0.5b
	$(KVSERVE) pull all-minilm
	$(PY) -m pytest -q --durations=30

# llama.cpp's own llama-bench, llama-batched-bench, llama-server and llama-perplexity, built for this CPU from
# the llama-cpp-python source package into build/llama.cpp/bin (~20 minutes on 2 cores, once): the peer of
# `kvserve bench --compare llama.cpp` and `kvserve eval --compare llama.cpp`. Never part of `make test`.
llama-cpp: setup
	@test -x build/llama.cpp/bin/llama-perplexity || PYTHON=$(PY) bench/build_llama_cpp.sh

# Side-by-side speed against llama.cpp's own tools.
bench: model llama-cpp
	$(KVSERVE) bench $(MODEL) --compare llama.cpp --prompt-lens 128,512,1024,2048 --gen 64 --cache-types f16 \
		--json docs/bench.json --plot docs/bench.png

# ruff over the code, the tests and the benchmarks, and the import floors (both configured in pyproject.toml)
lint: test-setup
	$(PY) -m ruff check src tests bench
	$(VENV)/bin/lint-imports --no-cache

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
