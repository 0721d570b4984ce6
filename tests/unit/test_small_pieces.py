"""Small pieces: no function of ``tenplex_megatron/`` over :data:`MAX_FUNCTION_LINES` lines and no module over
:data:`MAX_MODULE_LINES`, read with ``ast`` (nothing imported), so that each part can be read and reviewed whole.
:data:`NOT_YET` names the files another change is splitting; an exemption no longer needed fails too."""

from __future__ import annotations

import ast
import os

from tests.harness import ROOT

PKG = "tenplex_megatron"
MAX_FUNCTION_LINES = 80  # a def's lines, decorators left out: end_lineno - lineno + 1
MAX_MODULE_LINES = 600
#: files over a limit that another change is splitting (path from the checkout's root: why they wait)
NOT_YET: dict[str, str] = {}


def oversized(source: str, path: str) -> list[str]:
    """What in one module's ``source`` exceeds a limit, described: the module over :data:`MAX_MODULE_LINES` lines,
    each function (methods and nested functions included) over :data:`MAX_FUNCTION_LINES`."""
    out = []
    lines = len(source.splitlines())
    if lines > MAX_MODULE_LINES:
        out.append(f"{path}: module is {lines} lines (limit {MAX_MODULE_LINES})")
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            if n > MAX_FUNCTION_LINES:
                out.append(f"{path}:{node.lineno}: function {node.name} is {n} lines (limit {MAX_FUNCTION_LINES})")
    return out


def _package_files() -> list[str]:
    """Every module of the package, by its path from the checkout's root (``/``-separated)."""
    found = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, PKG)):
        found += [os.path.relpath(os.path.join(dirpath, f), ROOT).replace(os.sep, "/") for f in files
                  if f.endswith(".py")]
    return sorted(found)


def _oversized_file(rel: str) -> list[str]:
    """:func:`oversized` of one file of the checkout."""
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return oversized(f.read(), rel)


def test_no_function_or_module_of_the_package_is_too_long() -> None:
    files = _package_files()
    assert len(files) > 100 and f"{PKG}/cli.py" in files  # the package was really walked
    found = [line for rel in files if rel not in NOT_YET for line in _oversized_file(rel)]
    assert not found, "split these into smaller, well-named pieces:\n" + "\n".join(found)


def test_every_exemption_is_still_needed() -> None:
    files = set(_package_files())
    for rel, why in NOT_YET.items():
        assert rel in files, f"NOT_YET names {rel}, which is not a module of the package ({why})"
        assert _oversized_file(rel), f"{rel} is within the limits now: remove it from NOT_YET ({why})"


def _method_of(lines: int) -> str:
    """A module whose method ``long`` (line 6) is ``lines`` lines long, after a short function."""
    body = "".join(f"        x{i} = {i}\n" for i in range(lines - 2))
    return f"def short():\n    return 1\n\n\nclass C:\n    def long(self):\n{body}        return 0\n"


def test_the_checker_finds_a_long_function_and_a_long_module() -> None:
    assert oversized(_method_of(MAX_FUNCTION_LINES + 1), "m.py") == [
        f"m.py:6: function long is {MAX_FUNCTION_LINES + 1} lines (limit {MAX_FUNCTION_LINES})"]
    assert oversized(_method_of(MAX_FUNCTION_LINES), "m.py") == []
    assert oversized("x = 1\n" * (MAX_MODULE_LINES + 1), "n.py") == [
        f"n.py: module is {MAX_MODULE_LINES + 1} lines (limit {MAX_MODULE_LINES})"]
    assert oversized("x = 1\n" * MAX_MODULE_LINES, "n.py") == []
