#!/usr/bin/env bash
# The GPU check (issue #33): one command for a session lent a GPU machine.
#
#   bash scripts/gpu_check.sh [OUTDIR] [--cpu-dry-run] [--steps ...] [--budget SECONDS]   # OUTDIR: out/gpu-check
#
# What it needs there: Python 3.12 with its own CUDA torch (system-wide), and the wheels below carried in .whl/
# of this checkout (ignored by git). Nothing is fetched: the wheels the system lacks (or has older) are
# installed with `pip install --no-index --no-deps --target` (unzipped where there is no pip) into a scratch
# directory put first on PYTHONPATH; torch and its own dependencies stay the system's.
#
# The carried wheels (scripts/gpu_wheels.txt, cp312 manylinux x86-64, ~21 MB):
#   megatron-core==0.16.1 numpy==2.4.6 packaging==26.4 psutil==7.2.2 isal==1.9.1
#   pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pygments==2.21.0
# fetched on a machine with network access (`make gpu-wheels` runs the same):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl -r scripts/gpu_wheels.txt
# For the mlm step, Megatron-LM's own training code (~1.8 MB, ignored by git) in .mlm/ of this checkout:
#   pretrain_gpt.py gpt_builders.py model_provider.py megatron/{training,legacy,rl,post_training} (core_v0.16.1)
# copied there by `make gpu-mlm` (run by `make gpu-wheels`) from MEGATRON_LM_PATH or a clone; without it the
# step reports skip. --megatron-lm DIR or MEGATRON_LM_PATH name another checkout.
# Not needed there: Transformer Engine and apex (megatron-core falls back to torch), hypothesis and
# pytest-xdist (tests/gpu imports neither), safetensors, transformers, deepspeed.
#
# It runs, within --budget seconds (default 530, under 9 minutes): pytest -m gpu tests/gpu; staged load and
# save on CUDA byte-identical to the direct path; a host-memory snapshot of CUDA tensors through the pinned
# ring; tiny TP2, PP2, DP2 and TP2-bf16 checkpoints made on the CPU (CUDA hidden, 2 gloo ranks) resumed at
# world size 1 on the GPU against the CPU; python -m benchmarks.gpu_reshard --device cuda:0 at GPT-3 1.3B and 2.7B; Megatron-LM's own
# pretrain_gpt.py (patched, --tenplex, bf16) saving TP2 on the CPU, resumed at world size 1 on the GPU against the CPU.
# Every figure goes to OUTDIR/gpu_check.json, the table to OUTDIR/gpu_check.md, each step's output to
# OUTDIR/gpu_check.log. See scripts/gpu_check.py and docs/gpu.md.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the checkout: gpu_check.py imports its steps (scripts/gpu_steps/)
exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
