"""The fault points' one registry (storage/faults.py): every point the package can fail at is registered and every
registered point exists; an unregistered point, or a TENPLEX_FAULT naming none, is refused with a clear error."""

from __future__ import annotations

import ast
import os

import pytest

from tenplex_megatron.storage import faults
from tenplex_megatron.storage.faults import ALL_POINTS, Fault, maybe_fail

PACKAGE = os.path.join(os.path.dirname(__file__), "..", "..", "tenplex_megatron")


def _fault_calls() -> tuple[dict[str, list[str]], list[str]]:
    """Literal points passed to ``maybe_fail`` or to a ``fault`` callback (storage/directory.commit's), each with
    where; and the ``maybe_fail`` calls whose point is neither a literal nor a lambda's forwarded parameter."""
    literal: dict[str, list[str]] = {}
    other: list[str] = []
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            tree = ast.parse(open(path).read(), path)
            forwarded = {a.arg for n in ast.walk(tree) if isinstance(n, ast.Lambda) for a in n.args.args}
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call) or not node.args:
                    continue
                fn = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
                if fn not in ("maybe_fail", "fault", "fault_kind"):
                    continue
                arg, where = node.args[0], f"{os.path.relpath(path, PACKAGE)}:{node.lineno}"
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    literal.setdefault(arg.value, []).append(where)
                elif fn == "maybe_fail" and not (isinstance(arg, ast.Name) and arg.id in forwarded):
                    other.append(where)
    return literal, other


def test_every_fault_point_in_the_package_is_registered_and_every_registered_one_is_used() -> None:
    literal, other = _fault_calls()
    assert not other, f"maybe_fail with a computed point (name it literally, registered): {other}"
    unregistered = {p: w for p, w in literal.items() if p not in ALL_POINTS}
    assert not unregistered, f"fault points missing from storage/faults.py ALL_POINTS: {unregistered}"
    assert set(ALL_POINTS) == set(literal), f"registered but never reached: {set(ALL_POINTS) - set(literal)}"
    assert set(faults.RANK0_ONLY) <= set(faults.POINTS) and len(set(ALL_POINTS)) == len(ALL_POINTS)


def test_an_unregistered_point_is_refused_even_without_a_fault_set(monkeypatch) -> None:
    monkeypatch.delenv("TENPLEX_FAULT", raising=False)
    with pytest.raises(ValueError, match=r"maybe_fail\('save.nowhere'\): not a registered fault point"):
        maybe_fail("save.nowhere", 0)
    maybe_fail("save.gather", 0)  # registered, nothing set: inert


@pytest.mark.parametrize("spec,why", [
    ("save.tensor@1", "unknown fault point 'save.tensor'"),
    ("save.tensors@1:explode", "unknown fault kind 'explode'"),
    ("save.tensors@one", "must be integers"),
    ("save.tensors#x", "must be integers"),
])
def test_a_tenplex_fault_naming_no_registered_point_or_kind_is_refused(monkeypatch, spec: str, why: str) -> None:
    monkeypatch.setenv("TENPLEX_FAULT", spec)
    with pytest.raises(ValueError, match="TENPLEX_FAULT=") as e:
        maybe_fail("save.gather", 0, 4)
    assert why in str(e.value) and repr(spec) in str(e.value)


def test_a_registered_fault_fires_only_where_it_is_aimed(monkeypatch) -> None:
    assert Fault.parse("load.copy@1#4:enospc") == Fault("load.copy", 1, 4, "enospc")
    assert Fault.parse("memory.write") == Fault("memory.write", None, None, "kill")
    monkeypatch.setenv("TENPLEX_FAULT", "load.copy@1#4:error")
    maybe_fail("load.copy", 0, 4)  # another rank
    maybe_fail("load.copy", 1, 5)  # another save
    maybe_fail("load.read", 1, 4)  # another point
    with pytest.raises(RuntimeError, match="injected fault at load.copy on rank 1"):
        maybe_fail("load.copy", 1, 4)
    monkeypatch.setenv("TENPLEX_FAULT", "lease.link:eperm")
    with pytest.raises(PermissionError):
        maybe_fail("lease.link", 3)
