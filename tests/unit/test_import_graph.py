"""The package's import graph, read from the source with ``ast`` (nothing imported): no cycle between modules, and no
function-level import of the package's own modules except where the allow-list below says why. The same for the
checkout's ``scripts/`` and ``benchmarks/``: no cycle, and imports between the two in one direction only."""

from __future__ import annotations

import ast
import functools
import os
from collections.abc import Iterator

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
PKG = "tenplex_megatron"

#: (importing module, imported module): why the import waits for a call. An optional dependency (DeepSpeed,
#: Megatron-LM, transformers) is imported inside functions freely; the package's own modules only here.
FUNCTION_LEVEL_ALLOWED = {
    ("tenplex_megatron", "tenplex_megatron.frontdoor.api"):
        "PEP 562 lazy public API: `import tenplex_megatron` (and its pure plan/) must not import torch or megatron-core",
    ("tenplex_megatron.cli_reform", "tenplex_megatron.frontdoor.membership"):
        "`tenplex-megatron leave` alone needs torch (the job's store): the CLI's other commands must not import it",
}


def _modules(roots: tuple[str, ...] = (PKG,)) -> dict[str, str]:
    """Every module under the checkout's top-level directories ``roots`` (default the package): dotted name -> file."""
    out = {}
    for root in roots:
        for dirpath, _, files in os.walk(os.path.join(ROOT, root)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].replace(os.sep, ".")
                    out[rel.removesuffix(".__init__")] = os.path.join(dirpath, f)
    return out


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str],
             roots: tuple[str, ...] = (PKG,)) -> list[str]:
    """The modules under ``roots`` an import statement loads (``from a import b`` loads ``a.b`` when that is a
    module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] in roots]
    base = node.module or ""
    if node.level:
        parts = module.split(".") if is_package else module.split(".")[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    if base.split(".")[0] not in roots:
        return []
    subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
    return subs if len(subs) == len(node.names) else [base, *subs]


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _import_nodes(node: ast.AST, in_function: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement under ``node``, with whether it runs inside a function (``if TYPE_CHECKING:`` skipped)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child):
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, in_function
        yield from _import_nodes(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                         ast.Lambda)))


@functools.cache  # read once for the module's tests (nothing mutates it)
def _imports() -> tuple[dict[str, set[str]], list[tuple[str, str, int]]]:
    """Module-level edges (``if TYPE_CHECKING:`` blocks left out) and function-level imports (module, target, line)."""
    mods = _modules()
    known = set(mods)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    inner: list[tuple[str, str, int]] = []
    for module, path in mods.items():
        is_package = path.endswith("__init__.py")
        for node, in_function in _import_nodes(ast.parse(open(path).read(), path), False):
            for target in _targets(node, module, is_package, known):
                if in_function:
                    inner.append((module, target, node.lineno))
                elif target != module:
                    edges[module].add(target)
    return edges, inner


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_between_the_packages_modules() -> None:
    edges, _ = _imports()
    assert sum(len(t) for t in edges.values()) > 200  # the graph was really read, submodules resolved:
    assert {"tenplex_megatron.training.gpt", "tenplex_megatron.frontdoor.checkpointer"} <= edges["tenplex_megatron.training.pretrain"]
    assert _cycles(edges) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_function_level_import_of_the_packages_own_modules_beyond_the_allow_list() -> None:
    _, inner = _imports()
    found = {(m, t) for m, t, _ in inner}
    unexplained = sorted(f"{m}:{line} imports {t}" for m, t, line in inner if (m, t) not in FUNCTION_LEVEL_ALLOWED)
    assert not unexplained, "import at module level, or add to FUNCTION_LEVEL_ALLOWED with why:\n" + "\n".join(
        unexplained)
    assert set(FUNCTION_LEVEL_ALLOWED) <= found, f"stale allow-list entries: {set(FUNCTION_LEVEL_ALLOWED) - found}"


#: the checkout's code outside the package, read the same way: the GPU check and other scripts, and the benchmarks
OUTSIDE = ("scripts", "benchmarks")
#: the one direction allowed between them: a script may run a benchmark's code (the GPU check's bench and identity
#: steps), while the benchmarks, with their shared kit, are the lower side and import no script
DOWN = ("scripts", "benchmarks")


@functools.cache  # read once for the module's tests (nothing mutates it)
def _outside_edges() -> dict[str, set[str]]:
    """Imports among the modules of scripts/ and benchmarks/, at module level or inside a function alike (both run;
    ``if TYPE_CHECKING:`` blocks left out)."""
    mods = _modules(OUTSIDE)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        is_package = path.endswith("__init__.py")
        for node, _ in _import_nodes(ast.parse(open(path).read(), path), False):
            edges[module].update(t for t in _targets(node, module, is_package, set(mods), OUTSIDE) if t != module)
    return edges


def _against(edges: dict[str, set[str]]) -> list[str]:
    """Every import from the lower of :data:`DOWN` into the higher one, described."""
    high, low = DOWN
    return sorted(f"{m} imports {t}" for m, ts in edges.items() for t in ts
                  if m.split(".")[0] == low and t.split(".")[0] == high)


def test_no_import_cycle_in_scripts_and_benchmarks() -> None:
    edges = _outside_edges()
    assert "benchmarks.kit.launch" in edges["benchmarks.reshard"]  # the graph was really read, submodules resolved
    assert "scripts.gpu_steps.launch" in edges["scripts.gpu_check"]
    assert _cycles(edges) == []


def test_scripts_and_benchmarks_import_each_other_one_way_only() -> None:
    edges = _outside_edges()
    assert "benchmarks.gpu_reshard" in edges["scripts.gpu_check_steps"]  # the allowed direction is really used
    against = _against(edges)
    assert not against, "move what both need into benchmarks/kit/:\n" + "\n".join(against)


def test_the_direction_check_finds_an_import_back_up() -> None:
    assert _against({"scripts.a": {"benchmarks.kit.b"}, "benchmarks.kit.b": {"benchmarks.c"}}) == []
    assert _against({"benchmarks.kit.b": {"scripts.a"}}) == ["benchmarks.kit.b imports scripts.a"]


#: the layers, lowest first (ARCHITECTURE's "training -> frontdoor -> integrations -> memory, engine -> execute ->
#: storage -> plan"; docs/design.md, "Layout of the code"): a module imports only from its own layer or below, so no
#: arrow runs back up. The Megatron-LM hook and the DeepSpeed calls are front doors and sit in frontdoor/ (the DeepSpeed
#: calls' public import path, ``tenplex_megatron.deepspeed``, is a top-level module, outside the layers); the restart
#: order there takes the engine as an adapter, so frontdoor/ reaches the integrations only where a front door drives
#: one, and no adapter imports a front door.
LAYERS = (
    ("plan",),
    ("storage",),
    ("execute",),
    ("engine",),
    ("memory",),
    ("integrations",),
    ("frontdoor",),
    ("training",),
)


def _layer(module: str) -> int | None:
    """The layer of a module (the longest matching prefix); None for the package's top-level modules."""
    rel = module.removeprefix(f"{PKG}.")
    best = None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (rel == p or rel.startswith(p + ".")) and (best is None or len(p) > len(best[1])):
                best = (i, p)
    return None if best is None else best[0]


def _upward(edges: dict[str, set[str]]) -> list[str]:
    """Every import from a lower layer into a higher one, described."""
    return sorted(f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})" for m, ts in edges.items() for t in ts
                  if _layer(m) is not None and _layer(t) is not None and _layer(t) > _layer(m))


def test_dependencies_point_one_way_between_the_layers() -> None:
    edges, _ = _imports()
    upward = _upward(edges)
    assert not upward, "\n".join(upward)
    assert _layer(f"{PKG}.memory.fallback") == 4 and _layer(f"{PKG}.frontdoor.megatron_lm") == 6
    assert _layer(f"{PKG}.integrations.deepspeed.zero") == 5 and _layer(f"{PKG}.integrations.deepspeed.adapter") == 5
    assert _layer(f"{PKG}.frontdoor.deepspeed") == 6 and _layer(f"{PKG}.deepspeed") is None  # the public import path
    # the DeepSpeed front door drives its adapter from above; the adapter imports no front door
    assert f"{PKG}.integrations.deepspeed.adapter" in edges[f"{PKG}.frontdoor.deepspeed"]
    assert {f"{PKG}.frontdoor.deepspeed", f"{PKG}.frontdoor.deepspeed_memory"} <= edges[f"{PKG}.deepspeed"]


def test_the_layer_check_finds_an_arrow_back_up() -> None:
    """The check itself: a front door importing an adapter, or storage the planner, is fine; the arrows back up
    (an adapter importing a front door, the restart order importing the trainer) are found."""
    down = {f"{PKG}.frontdoor.restart_sources": {f"{PKG}.integrations.megatron_core.adapter"},
            f"{PKG}.storage.directory": {f"{PKG}.plan.ptc"}}
    up = {f"{PKG}.integrations.megatron_core.adapter": {f"{PKG}.frontdoor.lease_flags"},
          f"{PKG}.frontdoor.restart_sources": {f"{PKG}.training.pretrain"}}
    assert _upward(down) == []
    assert [line.split(" ")[0] for line in _upward(up)] == sorted(up)
