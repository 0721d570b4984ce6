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


def test_several_faults_each_fire_where_they_are_aimed(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("TENPLEX_FAULT", "memory.write@3#4:error,memory.write@0#6:enospc")
    maybe_fail("memory.write", 3, 6)  # neither: rank 3's is iteration 4's, iteration 6's is rank 0's
    maybe_fail("memory.write", 0, 4)
    with pytest.raises(RuntimeError, match="on rank 3"):
        maybe_fail("memory.write", 3, 4)
    with pytest.raises(OSError, match="No space"):
        maybe_fail("memory.write", 0, 6)
    monkeypatch.setenv("TENPLEX_FAULT_ONCE", str(tmp_path / "once"))  # each of the two fires once, the other still
    with pytest.raises(RuntimeError):
        maybe_fail("memory.write", 3, 4)
    maybe_fail("memory.write", 3, 4)  # fired: inert
    with pytest.raises(OSError):
        maybe_fail("memory.write", 0, 6)
    maybe_fail("memory.write", 0, 6)
    monkeypatch.setenv("TENPLEX_FAULT", "memory.write@1:error,memory.bogus")
    with pytest.raises(ValueError, match="unknown fault point 'memory.bogus'"):  # every one checked, not only the first
        maybe_fail("memory.write", 1, 2)


def test_a_stop_fault_stops_the_process_until_continued() -> None:
    import signal
    import subprocess
    import sys
    import time

    code = ("from tenplex_megatron.storage.faults import maybe_fail; maybe_fail('memory.write', 1, 2); "
            "print('continued', flush=True)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "TENPLEX_FAULT": "memory.write@1#2:stop"})
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # wait for it to stop itself (state T in /proc)
            with open(f"/proc/{p.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "T":
                    break
            time.sleep(0.05)
        else:
            raise AssertionError("the process never stopped")
        assert p.poll() is None
        os.kill(p.pid, signal.SIGCONT)
        assert p.communicate(timeout=60)[0].strip() == "continued" and p.returncode == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
