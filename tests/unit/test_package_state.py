"""No module of ``tenplex_megatron`` keeps mutable state of its own: a job's state lives in the objects that use it
(its Checkpointer, the memory tier, the module or function it patches), so an in-process restart can drop them and
build them again. Every module of the package is imported and its globals looked at (the check of
``test_frontdoor_state.py``), and every module's source is read for ``global`` statements (a module variable rebound
from a function is state even when each value it holds is immutable). A module that needs an optional dependency
this environment lacks is skipped, and only then; most of the package must have been looked at."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import pkgutil
import types

import pytest

import tenplex_megatron
from tests.unit.test_frontdoor_state import _mutable_globals

#: modules set aside for good, each with why
ASIDE = {
    "tenplex_megatron.log": "the one logger: whether its records propagate is the process's logging configuration",
}
#: state on its way into the object that uses it, left in place while that work is under way elsewhere
BEING_MOVED: dict[str, str] = {}
TABLES_BEING_REWRITTEN: dict[str, tuple[str, ...]] = {}
#: globals that hold a mutable object and are no job's state, each with why (a lock guarding what the whole process
#: shares would be listed here)
ALLOWED = {
    "tenplex_megatron.storage.prefetch._libc": "the C library, loaded once: code, like a module",
    "tenplex_megatron.storage.prefetch._madvise": "libc's madvise with its signature set at import: code",
}
#: modules not imported, each with why (their source is still read for ``global`` statements)
NOT_IMPORTED = {
    "tenplex_megatron.__main__": "importing it runs the command line (``sys.exit(main())``)",
}
#: modules that must be among those looked at, whatever optional dependencies are missing
CORE = ("tenplex_megatron.memory.peers", "tenplex_megatron.memory.state", "tenplex_megatron.engine.orphan",
        "tenplex_megatron.training.cpu_shim", "tenplex_megatron.frontdoor.checkpointer",
        "tenplex_megatron.integrations.megatron_core.extra_state", "tenplex_megatron.plan.planner",
        "tenplex_megatron.execute.executor", "tenplex_megatron.storage.parallel_read")


def _walk(path: list[str], prefix: str) -> list[tuple[str, str]]:
    """(module name, source file) of every module under ``path``, found without importing any."""
    out = []
    for m in sorted(pkgutil.iter_modules(path), key=lambda m: m.name):
        where = os.path.join(path[0], m.name)
        out.append((prefix + m.name, os.path.join(where, "__init__.py") if m.ispkg else where + ".py"))
        if m.ispkg:
            out += _walk([where], prefix + m.name + ".")
    return out


def package_modules() -> list[tuple[str, str]]:
    """Every module of the package, the package itself first."""
    return [(tenplex_megatron.__name__, tenplex_megatron.__file__ or "")] + _walk(
        list(tenplex_megatron.__path__), tenplex_megatron.__name__ + ".")


def _optional_missing(e: ImportError) -> bool:
    """Whether an import failed for want of another distribution, not installed here (a module of this package that
    fails to import is an error, and so is a dependency that is installed but fails)."""
    name = e.name or ""
    top = name.split(".")[0]
    return bool(top) and top != tenplex_megatron.__name__ and importlib.util.find_spec(top) is None


def _import_all() -> tuple[list[types.ModuleType], list[str]]:
    """The package's modules imported (NOT_IMPORTED aside), and the names of those skipped for a missing optional
    dependency."""
    modules, skipped = [], []
    for name, _ in package_modules():
        if name in NOT_IMPORTED:
            continue
        try:
            modules.append(importlib.import_module(name))
        except ImportError as e:
            if not _optional_missing(e):
                raise
            skipped.append(name)
    return modules, skipped


def global_statements(name: str, source: str) -> list[str]:
    """The ``global`` statements of a module's source, each as ``module:line: global names``."""
    return [f"{name}:{node.lineno}: global {', '.join(node.names)}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Global)]


def _exempt(found: str) -> bool:
    """Whether a finding (``module.name: type``, or ``module:line: ...``) falls under an exemption."""
    where = found.split(": ")[0]
    module = where.split(":")[0] if ":" in where else where.rsplit(".", 1)[0]
    if module in ASIDE or module in BEING_MOVED or where in ALLOWED:
        return True
    return where.rsplit(".", 1)[-1] in TABLES_BEING_REWRITTEN.get(module, ())


@pytest.fixture(scope="module")
def imported() -> tuple[list[types.ModuleType], list[str]]:
    return _import_all()


def test_every_module_is_looked_at_but_those_lacking_an_optional_dependency(imported) -> None:
    modules, skipped = imported
    names = {m.__name__ for m in modules}
    walked = [n for n, _ in package_modules() if n not in NOT_IMPORTED]
    assert names | set(skipped) == set(walked)
    assert set(CORE) <= names, f"core modules not looked at: {sorted(set(CORE) - names)}"
    assert len(names) >= 0.8 * len(walked), f"only {len(names)} of {len(walked)} modules imported; skipped: {skipped}"


def test_no_module_holds_mutable_state(imported) -> None:
    modules, _ = imported
    found = [g for m in modules for g in _mutable_globals(m) if not _exempt(g)]
    assert found == [], "module-level mutable state (give it to the object that uses it):\n" + "\n".join(found)


def test_no_function_rebinds_a_module_variable() -> None:
    found = [g for name, path in package_modules() for g in global_statements(name, open(path).read())
             if not _exempt(g)]
    assert found == [], "global statements (keep the value on the object that uses it):\n" + "\n".join(found)


def test_every_exemption_is_still_needed(imported) -> None:
    """A module set aside or being moved still holds state, and each listed table and allowed global is still found:
    an exemption whose state is gone fails here, to be taken off."""
    modules, skipped = imported
    by_name = {m.__name__: m for m in modules}
    sources = dict(package_modules())

    def mutable(module: str) -> set[str]:
        return {g.split(": ")[0].rsplit(".", 1)[-1] for g in _mutable_globals(by_name[module])}

    exempted = {*ASIDE, *BEING_MOVED, *TABLES_BEING_REWRITTEN, *(a.rsplit(".", 1)[0] for a in ALLOWED)}
    assert exempted <= set(by_name) | set(skipped), f"exempted modules gone: {sorted(exempted - set(by_name))}"
    assert set(NOT_IMPORTED) <= set(sources), f"modules gone: {sorted(set(NOT_IMPORTED) - set(sources))}"
    for module in (m for m in (*ASIDE, *BEING_MOVED) if m in by_name):
        assert mutable(module) or global_statements(module, open(sources[module]).read()), \
            f"{module} holds no state any more: take it off the exemptions"
    for module, tables in TABLES_BEING_REWRITTEN.items():
        if module in by_name:
            assert set(tables) <= mutable(module), f"{module}: {sorted(set(tables) - mutable(module))} read-only now"
    for name in ALLOWED:
        module, var = name.rsplit(".", 1)
        if module in by_name:
            assert var in mutable(module), f"{name} is gone or holds no mutable object: take it off ALLOWED"


def test_the_checks_find_state(tmp_path, monkeypatch) -> None:
    """The checks themselves, on a module written here: a rebound flag is found by its ``global`` statement, a
    compiled pattern is not state; a missing distribution is a skip, a broken module of the package is not."""
    src = "import re\nFLAG = False\nP = re.compile('x')\n\ndef install():\n    global FLAG\n    FLAG = True\n"
    (tmp_path / "state_probe.py").write_text(src)
    monkeypatch.syspath_prepend(str(tmp_path))
    probe = importlib.import_module("state_probe")
    assert _mutable_globals(probe) == []
    assert global_statements("state_probe", src) == ["state_probe:6: global FLAG"]
    assert _optional_missing(ModuleNotFoundError("no deepspeed_probe_xyz", name="deepspeed_probe_xyz"))
    assert not _optional_missing(ModuleNotFoundError("broken", name="tenplex_megatron.nothing_here"))
    assert not _optional_missing(ModuleNotFoundError("installed, failing", name="torch.nothing_here"))
