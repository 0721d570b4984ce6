"""The benchmarks: tenplex measured against its peers in one run, on the same machine and files. Each is a module
run from the repository's root with ``python -m benchmarks.NAME`` (its docstring says what it measures, how, and
its flags; ``make bench`` runs ``benchmarks.reshard --quick``; ``memory_worker`` is not one: it is the ranks
``benchmarks.memory`` starts); the table of them and their figures are in
``docs/performance.md``, each figure with its command, machine, date and commit.

What they share (launching workers, the timed call, statistics, the report and its RATIO lines) is
:mod:`benchmarks.kit`. The package is not in the installed wheel (``pyproject.toml`` packages ``tenplex_megatron``
only): it runs from a checkout with the checkout importable (``PYTHONPATH=.``, as the Makefile sets, or
``pip install -e .``).
"""
