# Set-up and entry points. `make demo` and `make test` create and reuse .venv themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
export OMP_NUM_THREADS ?= 1
export PYTHONPATH := $(CURDIR)

.PHONY: demo test test-fast test-gpu lint bench venv dist docs clean

# torch first and on its own (the CPU wheel: an unpinned torch pulls a multi-GB CUDA build), then the pinned
# set (requirements.txt), then this checkout, editable, with no dependency resolution of its own.
$(VENV)/.installed: requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check $(TORCH_SPEC)
	$(PY) -m pip install -q --disable-pip-version-check $(TORCH_SPEC) -r requirements.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $@

venv: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) scripts/demo.py

# Both cores (pytest-xdist), one session: the multi-process tests a file at a time per worker, the longest first,
# and the unit test files last, filling in behind them (tests/conftest.py's scheduler). The checkout's modules are
# byte-compiled first: with PYTHONDONTWRITEBYTECODE set, each of the suite's several hundred processes would
# otherwise compile them again from source (~0.4 s CPU each).
test: $(VENV)/.installed
	$(PY) -m ruff check tenplex_megatron scripts tests examples
	$(PY) -m compileall -q tenplex_megatron scripts tests examples
	$(PY) -m pytest -q --durations=15 -n 2 --dist loadfile tests

test-fast: $(VENV)/.installed
	$(PY) -m compileall -q tenplex_megatron tests
	$(PY) -m pytest -q -n 2 tests/unit

test-gpu: $(VENV)/.installed
	$(PY) -m pytest -q -m gpu tests

lint: $(VENV)/.installed
	$(PY) -m ruff check tenplex_megatron scripts tests examples

bench: $(VENV)/.installed
	$(PY) scripts/bench_reshard.py --quick

# The documentation site (mkdocs.yml, docs/) into site/. Strict: a broken link or anchor, or a page missing from the
# navigation, fails the build. The flag reference (docs/reference.md) is checked first: it must be what
# `python -m tenplex_megatron.docs_reference` writes from tenplex_megatron/flags.py.
docs: $(VENV)/.installed
	$(PY) -m tenplex_megatron.docs_reference --check
	$(PY) -m mkdocs build --strict --quiet

# The sdist and the wheel (from the sdist), as a user's pip would get them.
dist: $(VENV)/.installed
	$(PY) -m build --no-isolation --outdir dist .

clean:
	rm -rf $(VENV) build dist site *.egg-info
