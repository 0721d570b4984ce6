# Set-up and entry points. `make demo` and `make test` create and reuse .venv themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
export OMP_NUM_THREADS ?= 1
export PYTHONPATH := $(CURDIR)

.PHONY: demo test test-bench test-compat test-fast test-gpu gpu-check gpu-wheels gpu-mlm lint bench venv dist docs clean etcd slurm

# torch first and on its own (the CPU wheel: an unpinned torch pulls a multi-GB CUDA build), then the pinned
# set (requirements.txt), then this checkout, editable, with no dependency resolution of its own.
$(VENV)/.installed: requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check $(TORCH_SPEC)
	$(PY) -m pip install -q --disable-pip-version-check $(TORCH_SPEC) -r requirements.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $@

venv: $(VENV)/.installed

# A real etcd server for the etcd-rendezvous test (tests/multiproc/test_cluster_safety.py, marker slow, run by
# make test-bench; never skipped): Debian's etcd-server (3.4, serves the v2 API torchrun's etcd-v2 backend speaks
# with --enable-v2). Installed once, quietly; without root or apt this fails here, naming the package, rather than
# skipping the test.
etcd:
	@command -v etcd >/dev/null 2>&1 || { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null 2>&1 \
	  || { apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null; }; } \
	  || { echo "make etcd: install Debian's etcd-server (as root: apt-get install etcd-server)" >&2; exit 1; }

# A real Slurm on this machine for the tests marked slurm (tests/multiproc/test_slurm.py, never skipped): munged,
# slurmctld and two slurmd nodes n1, n2 on localhost (scripts/slurm/start.sh: Debian's slurmctld, slurmd,
# slurm-client and munge installed once, quietly, as root; idempotent). scripts/slurm/stop.sh stops it; the tests
# start it through the same script when it is not running, and stop it after.
slurm:
	@bash scripts/slurm/start.sh

demo: $(VENV)/.installed
	$(PY) scripts/demo.py

# Both cores (pytest-xdist), one session: the multi-process tests a file at a time per worker, the longest first,
# and the unit test files last, filling in behind them (tests/conftest.py's scheduler). The checkout's modules are
# byte-compiled first: with PYTHONDONTWRITEBYTECODE set, each of the suite's several hundred processes would
# otherwise compile them again from source (~0.4 s CPU each).
test: $(VENV)/.installed
	$(PY) -m ruff check tenplex_megatron benchmarks scripts tests examples
	$(PY) -m compileall -q tenplex_megatron benchmarks scripts tests examples
	$(PY) -m pytest -q --durations=15 -n 2 --dist loadfile tests

# The benchmarks' --quick runs with their checks (tests/multiproc/test_bench_*.py, marker bench), the longer
# multi-process runs (marker slow: tests/README.md lists them) and the batch scripts of docs/slurm.md against a
# real local Slurm (marker slurm: the tests start it with scripts/slurm/start.sh, installing its packages where
# missing): every benchmark still runs end to end and its systems reproduce the losses, apart from make test's
# 15-minute budget.
test-bench: $(VENV)/.installed etcd
	$(PY) -m compileall -q tenplex_megatron benchmarks scripts tests
	$(PY) -m pytest -q --durations=10 -n 2 --dist loadfile -m "bench or slow or slurm" tests/multiproc

# Both ends of the supported megatron-core range (tenplex_megatron/mcore_versions.py), each in a venv of its own
# (scripts/compat_venv.sh: the pinned set with that megatron-core in place of 0.16.1): the re-shard matrix's core
# transitions, the adoption of Megatron's own checkpoints, the public API example, and a checkpoint crossing
# versions (written on the pinned 0.16.1 in .venv, resumed at another layout on the compat version, and back).
COMPAT_019 := .venv-compat019
COMPAT_015 := .venv-compat015
COMPAT_TESTS := tests/unit/test_mcore_versions.py tests/multiproc/test_reshard_matrix.py::test_transition \
	tests/multiproc/test_megatron_adopt.py tests/multiproc/test_public_api.py tests/multiproc/test_cross_version.py

$(COMPAT_019)/.installed: requirements.txt scripts/compat_venv.sh
	PYTHON=$(PYTHON) TORCH_SPEC=$(TORCH_SPEC) bash scripts/compat_venv.sh $(COMPAT_019) 0.19.0

$(COMPAT_015)/.installed: requirements.txt scripts/compat_venv.sh
	PYTHON=$(PYTHON) TORCH_SPEC=$(TORCH_SPEC) bash scripts/compat_venv.sh $(COMPAT_015) 0.15.3

test-compat: $(VENV)/.installed $(COMPAT_019)/.installed $(COMPAT_015)/.installed
	$(COMPAT_019)/bin/python -m compileall -q tenplex_megatron benchmarks scripts tests
	TENPLEX_CROSS_PYTHON=$(CURDIR)/$(PY) $(COMPAT_019)/bin/python -m pytest -q --durations=10 -n 2 --dist loadfile \
	  -m "not gpu and not megatron_lm" $(COMPAT_TESTS)
	TENPLEX_CROSS_PYTHON=$(CURDIR)/$(PY) $(COMPAT_015)/bin/python -m pytest -q --durations=10 -n 2 --dist loadfile \
	  -m "not gpu and not megatron_lm and not mcore_layout_fn" $(COMPAT_TESTS)

test-fast: $(VENV)/.installed
	$(PY) -m compileall -q tenplex_megatron tests
	$(PY) -m pytest -q -n 2 tests/unit

# On a GPU machine: the system's Python and its own CUDA torch (no .venv, whose torch is the CPU wheel), with the
# wheels carried in .whl/ (`make gpu-wheels` elsewhere), and only tests/gpu (tests/unit imports megatron-core and
# hypothesis at collection). `make gpu-check` runs the whole GPU check (scripts/gpu_check.sh, docs/gpu.md).
test-gpu:
	$(PYTHON) scripts/gpu_check.py out/test-gpu --steps wheels env pytest

gpu-check:
	bash scripts/gpu_check.sh out/gpu-check

# Where there is network access: the wheels a GPU machine's Python 3.12 lacks, into .whl/ (scripts/gpu_wheels.txt).
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl -r scripts/gpu_wheels.txt
	$(MAKE) gpu-mlm

# Megatron-LM's own training code for a GPU machine without a checkout or network (about 2 MB): pretrain_gpt.py,
# the modules it imports beside it, megatron/training and megatron/legacy, into .mlm/ (ignored by git). Copied from
# MEGATRON_LM_PATH where it is set, else archived from a git clone of Megatron-LM (MLM_REPO, tag MLM_TAG).
MLM_TAG ?= core_v0.16.1
MLM_REPO ?= https://github.com/NVIDIA/Megatron-LM.git
MLM_FILES = pretrain_gpt.py gpt_builders.py model_provider.py megatron/training megatron/legacy megatron/rl megatron/post_training
gpu-mlm:
	rm -rf .mlm && mkdir -p .mlm
	if [ -n "$(MEGATRON_LM_PATH)" ]; then \
		(cd "$(MEGATRON_LM_PATH)" && tar cf - --exclude=__pycache__ $(MLM_FILES)) | tar xf - -C .mlm; \
	elif [ -d "$(MLM_REPO)" ]; then \
		git --git-dir="$(MLM_REPO)" archive "$(MLM_TAG)" $(MLM_FILES) | tar xf - -C .mlm; \
	else \
		tmp=$$(mktemp -d) && git clone -q --depth 1 --branch "$(MLM_TAG)" "$(MLM_REPO)" "$$tmp/mlm" && \
		(cd "$$tmp/mlm" && tar cf - $(MLM_FILES)) | tar xf - -C .mlm; rc=$$?; rm -rf "$$tmp"; exit $$rc; \
	fi
	@du -sh .mlm

lint: $(VENV)/.installed
	$(PY) -m ruff check tenplex_megatron benchmarks scripts tests examples

bench: $(VENV)/.installed
	$(PY) -m benchmarks.reshard --quick

# The documentation site (mkdocs.yml, docs/) into site/. Strict: a broken link or anchor, or a page missing from the
# navigation, fails the build; scripts/check_site.py then fails on a page whose Markdown did not render (an
# extension mkdocs.yml does not enable: a literal `!!!`, a table shown as text). The flag reference
# (docs/reference.md), the CLI reference (docs/cli-reference.md) and the error types (docs/errors.md) are checked
# first: they must be what `python -m tenplex_megatron.docs_reference` writes from tenplex_megatron/flags.py, the
# CLI's parser and the package's exception classes (and docs/support.md's block of Megatron-LM's flags, from
# tenplex_megatron/plan/megatron_flags.py); so is README.md's support table, a copy of docs/support.md's (scripts/support_table.py).
docs: $(VENV)/.installed
	$(PY) -m tenplex_megatron.docs_reference --check
	$(PY) -m scripts.support_table --check
	$(PY) -m mkdocs build --strict
	$(PY) -m scripts.check_site site docs

# The sdist and the wheel (from the sdist), as a user's pip would get them.
dist: $(VENV)/.installed
	$(PY) -m build --no-isolation --outdir dist .

clean:
	rm -rf $(VENV) build dist site *.egg-info
