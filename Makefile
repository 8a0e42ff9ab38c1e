# The README's commands. Each sets itself up on a fresh machine: a .venv, torch 2.13.0 first
# (a CPU build is on disk here; letting pip choose would pull gigabytes of CUDA packages),
# then this package with its dev extras.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test report bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

report: $(STAMP)
	$(VENV)/bin/interp report --model toy --out reports/toy

bench: $(STAMP)
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) reports .pytest_cache
