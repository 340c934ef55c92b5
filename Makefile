# Two entry points on a fresh machine: `make demo` and `make test`. Both build .venv first:
# `make demo` (and `make wheel`) with only what they need, `make test` with everything.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-flax
# pytest-xdist workers of `make test`; `make test WORKERS=0` runs the suite in one process.
WORKERS ?= 2
# loadgroup: the multi-process tests one at a time, on one worker (tests/conftest.py); `load`: anywhere.
DIST ?= loadgroup
# The oldest supported versions (constraints-oldest.txt) get a virtualenv of their own.
COMPAT := .venv-compat
COMPAT_STAMP := $(COMPAT)/.installed
FAST_TIER := not slow and not multiprocess and not emulator and not notebook and not heavy

# PYTHONDONTWRITEBYTECODE emptied for the suites, where the environment sets it: their ~400
# interpreters (process groups, CLI runs, probes) then read the library and the tests as bytecode
# written once, instead of each compiling them again (~0.2 s of CPU each).
test test-fast test-compat: export PYTHONDONTWRITEBYTECODE =

.PHONY: demo test test-fast test-compat bench pod-scale lint wheel docs clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# The library and Flax: what the demo imports (about a minute, where everything takes four).
$(DEMO_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e ".[flax]"
	touch $(DEMO_STAMP)

$(STAMP): pyproject.toml constraints-test.txt | $(PY)
	$(PY) -m pip install --quiet -e ".[test,bench,docs]" -c constraints-test.txt
	touch $(STAMP) $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(PY) scripts/demo.py

# Both virtualenvs first, side by side (pip waits on the network and the disk as much as it computes).
# Multi-process and emulator tests each run on one worker (tests/conftest.py: xdist_group), the rest
# wherever a worker is free (`make test WORKERS=0`: serially, in one process).
# Then the compatibility tier, the docs and the linters side by side (-O: each one's output in one piece).
test:
	$(MAKE) -j2 $(STAMP) $(COMPAT_STAMP)
	$(PY) -m pytest -q --durations=25 -n $(WORKERS) --dist $(DIST)
	$(MAKE) -j3 -O test-compat docs lint

# The API reference (docs/api.md: every public name's docstring) as HTML in site/, offline;
# --strict turns every warning (a docstring naming a parameter the signature lacks) into a failure.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --quiet

# The inner loop (<= 45 s on a quiet 2-core machine): in-process tests only, no emulators, notebooks,
# process groups, subprocesses, Orbax or Flax (tests/conftest.py marks those heavy and leaves them uncollected).
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "$(FAST_TIER)" -n $(WORKERS)

# The fast tier again, on the oldest versions pyproject.toml accepts (a couple of minutes to
# build the first time, then about a minute): the supported range's lower end, tested.
# Only the library and pytest (.[test-fast]): the fast tier collects no module that imports more.
$(COMPAT_STAMP): pyproject.toml constraints-oldest.txt
	$(PYTHON) -m venv $(COMPAT)
	$(COMPAT)/bin/python -m pip install --quiet --upgrade pip
	$(COMPAT)/bin/python -m pip install --quiet -e ".[test-fast]" -c constraints-oldest.txt
	touch $(COMPAT_STAMP)

test-compat: $(COMPAT_STAMP)
	$(COMPAT)/bin/python -m pytest -q -m "$(FAST_TIER)" -n $(WORKERS)

bench: $(STAMP)
	$(PY) benchmarks/benchmark.py

# The pod-scale targets at 1.1 M pieces in one process (docs/scaling.md): minutes, ~6.3 GB peak RSS.
# Exits 1 while a target fails. Another size: make pod-scale POD_SCALE_ARGS="--devices 2048 --leaves 220";
# the per-host run, 8 real processes x 64 devices beside 1 x 64: POD_SCALE_ARGS="--processes 8"
pod-scale: $(STAMP)
	$(PY) benchmarks/pod_scale.py $(POD_SCALE_ARGS)

# ruff, and mypy over the library (pyproject.toml's [tool.mypy]): both must report nothing.
lint: $(STAMP)
	$(VENV)/bin/ruff check tpu_ckpt tests scripts benchmarks
	$(VENV)/bin/mypy tpu_ckpt

# dist/tpu_ckpt-<version>-py3-none-any.whl, for machines without a clone (the notebooks' first cell).
# Needs pip alone (it builds with flit_core, in isolation), not the library's dependencies.
wheel: | $(PY)
	$(PY) -m pip wheel --quiet --no-deps --wheel-dir dist .

clean:
	rm -rf $(VENV) $(COMPAT) build dist site *.egg-info
