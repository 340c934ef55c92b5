# Two entry points on a fresh machine: `make demo` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast bench pod-scale lint wheel docs clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,bench,docs]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) scripts/demo.py

test: $(STAMP)
	$(PY) -m pytest -q
	$(MAKE) docs

# The API reference (docs/api.md: every public name's docstring) as HTML in site/, offline;
# --strict turns every warning (a docstring naming a parameter the signature lacks) into a failure.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --quiet

# The inner loop (<= 60 s on a quiet 2-core machine): in-process tests only, no emulators, notebooks,
# process groups, subprocesses, Orbax or Flax (tests/conftest.py marks those heavy).
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not multiprocess and not emulator and not notebook and not heavy"

bench: $(STAMP)
	$(PY) scripts/benchmark.py

# Issue 12's pod-scale targets at 1.1 M pieces (docs/scaling.md): minutes, ~6.3 GB peak RSS.
# Exits 1 while a target fails. Another size: make pod-scale POD_SCALE_ARGS="--devices 2048 --leaves 220"
pod-scale: $(STAMP)
	$(PY) scripts/pod_scale.py $(POD_SCALE_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check tpu_ckpt tests scripts

# dist/tpu_ckpt-<version>-py3-none-any.whl, for machines without a clone (the notebooks' first cell).
wheel: $(STAMP)
	$(PY) -m pip wheel --quiet --no-deps --wheel-dir dist .

clean:
	rm -rf $(VENV) build dist site *.egg-info
