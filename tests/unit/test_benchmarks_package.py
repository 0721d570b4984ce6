"""The benchmarks as one package: every command that names one names a module that exists, each module of the kit
and each benchmark documented in its one place, one import style, and nothing editing ``sys.path``."""

from __future__ import annotations

import glob
import os
import re

from tests.harness import ROOT

BENCHMARKS = os.path.join(ROOT, "benchmarks")
#: the modules of the package that are not benchmarks of their own
NOT_BENCHMARKS = {"__init__", "memory_worker"}
#: run_megatron_lm.py runs Megatron-LM's pretrain_gpt.py as ``python pretrain_gpt.py`` would: that script's
#: directory first on sys.path is the interpreter's behaviour it reproduces, not a path set-up of ours
RUNS_A_SCRIPT = {os.path.join("tests", "megatron_lm", "run_megatron_lm.py")}


def _files(*patterns: str) -> list[str]:
    return sorted(f for p in patterns for f in glob.glob(os.path.join(ROOT, p), recursive=True) if os.path.isfile(f))


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _modules(where: str) -> set[str]:
    return {os.path.basename(f)[:-3] for f in glob.glob(os.path.join(where, "*.py"))}


# Where commands and references live: the README, the docs' pages, the Makefile, the scripts, the tests, the
# benchmarks themselves, the library's docstrings and the traces' descriptions (not the stored reports under
# docs/bench*, whose "command" is the record of what was run at their commit).
WHERE = ("README.md", "Makefile", "docs/*.md", "scripts/*", "tests/**/*.py", "tests/README.md", "benchmarks/**/*.py",
         "tenplex_megatron/**/*.py", "configs/traces/*.json", "pyproject.toml")


def test_every_benchmark_command_names_a_module_that_exists() -> None:
    modules = _modules(BENCHMARKS)
    named = 0
    for path in _files(*WHERE):
        for name in re.findall(r"-m benchmarks\.([a-z_]+)", _read(path)):
            named += 1
            assert name in modules, f"{os.path.relpath(path, ROOT)}: python -m benchmarks.{name}: no such module"
    assert named >= len(modules - NOT_BENCHMARKS), "the docs name every benchmark's command"


def test_no_reference_to_the_old_layout() -> None:
    old = re.compile(r"scripts/bench|scripts\.bench|\bfrom bench\b|\bimport bench\b|\bbench_[a-z_]+\.py\b")
    me = os.path.abspath(__file__)
    for path in _files(*WHERE):
        if path == me:
            continue
        for n, line in enumerate(_read(path).splitlines(), 1):
            hit = old.search(line.replace("test_bench_", "test_"))  # the tests' own file names stay
            assert not hit, f"{os.path.relpath(path, ROOT)}:{n}: {hit.group(0)!r}: the benchmarks are benchmarks/"


def test_nothing_edits_sys_path() -> None:
    edit = re.compile(r"sys\.path\.(insert|append|extend|remove)\(|sys\.path\s*(\[[^]]*\])?\s*[+]?=[^=]")
    for path in _files("benchmarks/**/*.py", "scripts/*.py", "tests/**/*.py", "tenplex_megatron/**/*.py",
                       "examples/**/*.py"):
        rel = os.path.relpath(path, ROOT)
        if rel in RUNS_A_SCRIPT or path == os.path.abspath(__file__):
            continue
        hit = edit.search(_read(path))
        assert not hit, f"{rel}: {hit.group(0)!r}: import the checkout as a package (PYTHONPATH or pip install -e .)"


def test_the_kit_and_the_benchmarks_are_each_documented_in_one_place() -> None:
    import benchmarks.kit

    doc = benchmarks.kit.__doc__ or ""
    for name in sorted(_modules(os.path.join(BENCHMARKS, "kit")) - {"__init__"}):
        assert re.search(rf"^  {name}\s", doc, re.M), f"benchmarks/kit/__init__.py does not describe {name}"
    table = _read(os.path.join(ROOT, "docs", "performance.md"))
    for name in sorted(_modules(BENCHMARKS) - NOT_BENCHMARKS):
        assert f"| `benchmarks.{name}` |" in table, f"docs/performance.md's table of benchmarks lacks {name}"
