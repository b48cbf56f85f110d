# Two entry points for a fresh machine: `make run` (the main job) and `make test`.
# Both create .venv and install everything on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: setup lock run test test-fast test-hostile test-vllm test-latest lint package-check docs bench bench-smoke bench-baseline bench-vllm-env mutation clean

setup: $(STAMP)

# Installs come from the locks in requirements/ (tools/setup.sh says how, per role: cpu or cuda).
$(STAMP): pyproject.toml tools/setup.sh requirements/cpu.txt requirements/torch-cpu.txt requirements/cuda.txt requirements/model.txt
	tools/setup.sh $(VENV)
	touch $(STAMP)

# Regenerate the locks from pyproject.toml's ranges (needs uv: pip install uv). TORCH_CPU_INDEX=
# (empty) where pip's local wheel folder has torch's CPU build.
lock:
	tools/lock.sh

# The operator console over the embedded model, with the built-in load running. A small KV pool
# (160 blocks) makes the block map, prefix hits and preemption visible; the chat tab answers too.
run: $(STAMP)
	$(VENV)/bin/lmc tui --load --rate 1 --num-blocks 160 --max-model-len 1024

test: $(STAMP)
	$(PY) -m pytest -q

# The unit level, under 2 minutes on 2 cores: the tests not marked slow (slow: starts an engine
# process, a server, a subprocess or Ray, or runs the embedded model); `make test` (and CI) runs
# everything.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

# Hostile input and slow clients against a real server (huge prompts, hostile JSON, decompression
# bombs, slow headers and bodies, oversized constraints, private image URLs): each must get a clear
# 4xx while /health keeps answering. `make test` runs them too.
test-hostile: $(STAMP)
	$(PY) -m pytest -q -m hostile

# The console against a real vLLM server (tests marked vllm): vLLM's CPU build in a venv of its own
# (tools/vllm_env.sh; VLLM_VENV), started over the embedded model with KV events on. Not in `make test`
# or CI: on a busy 2-core machine the install took 3 minutes (3.5 GB, warm pip cache) and the tests
# 5.3 minutes, most of it vLLM's start (docs/development.md).
VLLM_VENV ?= .venv-vllm
test-vllm: $(STAMP)
	tools/vllm_env.sh $(VLLM_VENV)
	LMC_TEST_VLLM_VENV=$(abspath $(VLLM_VENV)) $(PY) -m pytest -q -p no:randomly -m vllm

# ruff and mypy, configured in pyproject.toml (installed by the [test] extra).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# The package as users get it: build the wheel and the sdist, install the wheel (not editable)
# into two fresh virtualenvs, console only and with the engine, and smoke-test each (.ci/package_check.sh).
package-check: $(STAMP)
	PY=$(abspath $(PY)) .ci/package_check.sh

# The newest releases that pyproject.toml's ranges admit, unlocked, in a second venv (.venv-latest;
# torch stays at the lock's version): the first-run test and the fast tests, so that the next
# upstream release that breaks us shows up here before a user meets it.
test-latest:
	tools/test_latest.sh

# The documentation site (docs/, mkdocs.yml; the [docs] extra): --strict fails on a broken link or
# reference. The configuration, CLI and benchmark pages are generated from the code at build time.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# The headline benchmarks, one after the other; each writes its JSON (with the machine's fingerprint:
# lm_console/bench/fingerprint.py) to bench-results/ and appends it to benchmarks/history.jsonl.
# vs_vllm runs where .venv-vllm exists (make bench-vllm-env). Wall-clock figures need a quiet machine:
# the load average is recorded beside them.
BENCH_OUT ?= bench-results
bench: $(STAMP)
	mkdir -p $(BENCH_OUT)
	-$(PY) benchmarks/perf_smoke.py --save-result $(BENCH_OUT)/perf_smoke.json
	$(PY) benchmarks/vs_llamacpp.py --rounds 1 --skip cold --save-result $(BENCH_OUT)/vs_llamacpp.json
	if [ -x .venv-vllm/bin/python ]; then $(PY) benchmarks/vs_vllm.py --save-result $(BENCH_OUT)/vs_vllm.json; fi
	$(PY) benchmarks/shared_machine.py --save-result $(BENCH_OUT)/shared_machine.json
	$(PY) benchmarks/throughput.py --save-result $(BENCH_OUT)/throughput.json

# CI's perf smoke (benchmarks/perf_smoke.py): output tokens per CPU-second of the dense bf16 and the
# default paths against this machine's baseline (benchmarks/baselines/<fingerprint id>.json, recorded
# on the first run); a drop of more than 25% fails. bench-baseline records the baseline anew: run it
# deliberately, on a machine as quiet as it gets, and commit the file.
bench-smoke: $(STAMP)
	$(PY) benchmarks/perf_smoke.py

bench-baseline: $(STAMP)
	$(PY) benchmarks/perf_smoke.py --update-baseline

# vLLM's own CPU build in .venv-vllm (tools/vllm_env.sh), for benchmarks/vs_vllm.py.
bench-vllm-env:
	tools/vllm_env.sh .venv-vllm

# Mutation testing (cosmic-ray) of the KV cache, the block hashing, the scheduler, the sampler and
# the detokenizer against their tests; reports in mutation/. Not in CI (hours on 2 cores):
# MUTATION_MODULES=kv_cache_hashing MUTATION_SAMPLE=80 make mutation runs a part (tools/mutation.sh).
mutation: $(STAMP)
	PY=$(abspath $(PY)) tools/mutation.sh

clean:
	rm -rf $(VENV) .venv-latest site
