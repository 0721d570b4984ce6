"""The benchmarks: tenplex measured against its peers on the same machine, files and run, each a module run with
``python -m`` from the repository's root (``make bench`` runs the first in its quick mode).

=============================  ===================================================================================
``python -m benchmarks.X``     what it measures
=============================  ===================================================================================
``reshard``                    a save at layout A and a load at B: tenplex, megatron-core dist_checkpointing (both
                               formats), Megatron's checkpoint adopted in place, a centralized baseline
``deepspeed``                  DeepSpeed ZeRO at a DP change: its universal-checkpoint route against tenplex
``memory``                     host-memory snapshots against the synchronous save and megatron-core's async save
``elastic``                    a GPU-allocation trace replayed by torchrun elastic agents, one run per policy
``faults``                     a job through a schedule of faults (killed ranks, ENOSPC, lost agents, flipped bytes)
``gpu_reshard``                one rank's share re-sharded into device memory: staged, per-piece, megatron-core
``hf``                         Hugging Face export and import against ``from_pretrained``/``save_pretrained``
``pages``                      the memory directory's page size: a snapshot's file operations per filesystem
``verify``                     ``tenplex-megatron verify`` against a sequential read of the same files
``build_dataset``              ``scripts/build_dataset.py`` against Megatron-LM's ``tools/preprocess_data.py``
=============================  ===================================================================================

Each prints a table and ``RATIO <metric> <case> tenplex/<peer> = X.XX`` lines and writes JSON; the measuring they
share is :mod:`benchmarks.kit`. The package is not part of the installed wheel (``pyproject.toml`` packages
``tenplex_megatron`` only): it runs from a checkout, with the checkout importable (``PYTHONPATH=.``, as the
Makefile sets, or ``pip install -e .``). Figures, with the machine, command, date and commit that produced them,
are in ``docs/performance.md``, never here.
"""
