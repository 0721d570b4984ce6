"""Read the flags of Megatron-LM's ``pretrain_gpt.py`` from Megatron-LM's own argument parser, per release line, into
``tenplex_megatron/plan/megatron_flags_snapshot.json`` (which ``plan/megatron_flags.py`` classifies).

    python -m scripts.megatron_flags --git-dir /path/to/Megatron-LM.git     # the newest tag of each supported line
    python -m scripts.megatron_flags --checkout DIR [--checkout DIR ...]   # checkouts on disk (one per line)
    PYTHONPATH=DIR:. python -m scripts.megatron_flags --read DIR           # one checkout's line, as JSON, to stdout
    ... --check                                                            # exit 1 if the snapshot differs

Run from the repository's root with it on ``PYTHONPATH``. Each checkout is read in a fresh interpreter (two
Megatron-LMs cannot share one): the checkout first on ``PYTHONPATH``, ``megatron.training.arguments`` imported and ``add_megatron_arguments(ArgumentParser())`` called
(from core_v0.16 many flags are made from dataclasses there, so only the real parser lists them all); a third-party
module Megatron-LM imports beside its parser and this environment lacks (``six``, ``triton``) is stood in for by an
empty one, and nvidia-resiliency-ext is hidden (core_v0.19 asserts a newer one than Python 3.11 has). Where the
import still fails, the ``add_argument('--...')`` calls of ``arguments.py`` are read with ``ast`` instead
(``read_by: ast``: the dataclass-made flags are then missing). ``add_modelopt_args``
(``megatron/post_training/arguments.py``, which imports nothing) adds the flags ``pretrain_gpt.py`` takes where
nvidia-modelopt imports. Nothing of Megatron-LM is copied: only the flag names and destinations.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import types
from typing import Any

from tenplex_megatron import mcore_versions
from tenplex_megatron.plan import megatron_flag_snapshot as snap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ARGUMENTS = os.path.join("megatron", "training", "arguments.py")
MODELOPT = os.path.join("megatron", "post_training", "arguments.py")
TAG = re.compile(r"^core_v(\d+)\.(\d+)\.(\d+)$")  # a release tag (no rc)


def _stand_in(name: str) -> types.ModuleType:
    """An empty module for a missing third-party import (its attributes are mocks; ``__version__`` reads 0.0.0,
    which megatron-core's triton checks take as too old to use)."""
    from unittest.mock import MagicMock

    class StandIn(types.ModuleType):
        __version__ = "0.0.0"

        def __getattr__(self, attr: str) -> Any:
            if attr.startswith("__"):
                raise AttributeError(attr)
            return MagicMock(name=f"{self.__name__}.{attr}")

    module = StandIn(name)
    module.__path__ = []  # type: ignore[attr-defined]
    return module


def _import_arguments(checkout: str) -> Any:
    """``megatron.training.arguments`` of ``checkout`` (first on ``PYTHONPATH``: :func:`read_checkout` puts it
    there), missing third-party imports stood in for (at most 20)."""
    import typing

    spec = importlib.util.find_spec("megatron")
    where = os.path.realpath(os.path.join(checkout, "megatron"))
    if spec is None or not any(os.path.realpath(p) == where for p in spec.submodule_search_locations or ()):
        raise ImportError(f"the megatron package imported is not {checkout}'s: put the checkout first on PYTHONPATH")
    if not hasattr(typing, "override"):  # Python 3.12's marker, which core_v0.18+ import
        import typing_extensions

        typing.override = typing_extensions.override  # type: ignore[attr-defined]
    sys.modules["nvidia_resiliency_ext"] = None  # type: ignore[assignment]
    for _ in range(20):
        try:
            return importlib.import_module("megatron.training.arguments")
        except ModuleNotFoundError as e:
            if not e.name or e.name.split(".")[0] in ("megatron", "tenplex_megatron"):
                raise
            sys.modules[e.name] = _stand_in(e.name)
            for name in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
                del sys.modules[name]
    raise ImportError(f"{checkout}: megatron.training.arguments still misses modules after 20 stand-ins")


def _actions(parser: argparse.ArgumentParser, source: str) -> dict[str, snap.Flag]:
    """The destinations of a parser's optional arguments (several actions of one destination merged)."""
    out: dict[str, set[str]] = {}
    for action in parser._actions:
        if action.option_strings:
            out.setdefault(action.dest, set()).update(action.option_strings)
    return {d: snap.Flag(d, tuple(sorted(o)), source) for d, o in out.items()}


def _modelopt_flags(checkout: str) -> dict[str, snap.Flag]:
    """What ``add_modelopt_args`` adds (none where the checkout has no such file)."""
    path = os.path.join(checkout, MODELOPT)
    if not os.path.isfile(path):
        return {}
    spec = importlib.util.spec_from_file_location("_megatron_modelopt_arguments", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return _actions(module.add_modelopt_args(argparse.ArgumentParser(allow_abbrev=False)), "modelopt")


def _dest(call: ast.Call) -> tuple[str, tuple[str, ...]] | None:
    """(destination, option strings) of one ``add_argument`` call with a ``--`` option; None for another call."""
    options = tuple(a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                    and a.value.startswith("-"))
    longs = [o for o in options if o.startswith("--")]
    if not longs:
        return None
    dest = next((k.value.value for k in call.keywords if k.arg == "dest" and isinstance(k.value, ast.Constant)), None)
    return dest or longs[0][2:].replace("-", "_"), options


def ast_flags(checkout: str) -> dict[str, snap.Flag]:
    """Every ``add_argument('--...')`` of the checkout's ``arguments.py``, read without importing it, and argparse's
    own ``--help``."""
    with open(os.path.join(checkout, ARGUMENTS), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    out: dict[str, set[str]] = {"help": {"-h", "--help"}}  # what argparse adds itself
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            found = _dest(node)
            if found is not None:
                out.setdefault(found[0], set()).update(found[1])
    return {d: snap.Flag(d, tuple(sorted(o)), "megatron") for d, o in out.items()}


def read_here(checkout: str) -> dict[str, Any]:
    """One checkout's line as JSON (run in a fresh interpreter: :func:`read_checkout` does)."""
    text = mcore_versions._from_package_info(os.path.join(checkout, "megatron", "core", "package_info.py"))
    if text is None:
        raise SystemExit(f"{checkout}: no megatron/core/package_info.py (not a Megatron-LM checkout?)")
    try:
        arguments = _import_arguments(checkout)
        flags, read_by = _actions(arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)),
                                  "megatron"), "import"
    except Exception as e:  # noqa: BLE001  # any failure of Megatron-LM's import: the ast reading instead
        print(f"{checkout}: importing its arguments failed ({type(e).__name__}: {e}); reading them with ast",
              file=sys.stderr)
        flags, read_by = ast_flags(checkout), "ast"
    flags.update({d: f for d, f in _modelopt_flags(checkout).items() if d not in flags})
    return {"name": snap.line_name(mcore_versions.parse(text)), "package_version": text, "read_by": read_by,
            "flags": [f.to_json() for f in sorted(flags.values(), key=lambda f: f.dest)]}


def read_checkout(checkout: str, tag: str | None = None) -> snap.Line:
    """One checkout's release line, read in a fresh interpreter (``--read``)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join((checkout, ROOT)))
    p = subprocess.run([sys.executable, "-m", "scripts.megatron_flags", "--read", checkout], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise SystemExit(f"{checkout}: reading its flags failed:\n{p.stderr[-3000:]}")
    doc = json.loads(p.stdout)
    flags = tuple(snap.Flag(f["dest"], tuple(f["options"]), f["source"]) for f in doc["flags"])
    return snap.Line(doc["name"], tag, doc["package_version"], doc["read_by"], flags)


def newest_tags(git_dir: str) -> dict[str, str]:
    """The newest release tag (no rc) of each supported line in a Megatron-LM git directory."""
    names = subprocess.run(["git", "--git-dir", git_dir, "tag", "-l", "core_v*"], capture_output=True, text=True,
                           check=True).stdout.split()
    best: dict[str, tuple[tuple[int, int, int], str]] = {}
    for name in names:
        m = TAG.match(name)
        version = (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None
        if version is None or not mcore_versions.supported(version):
            continue
        line = snap.line_name(version)
        if line not in best or version > best[line][0]:
            best[line] = (version, name)
    return {line: tag for line, (_, tag) in sorted(best.items())}


def read_tags(git_dir: str) -> list[snap.Line]:
    """The newest tag of each supported line, each extracted with ``git archive`` into a temporary directory."""
    lines = []
    for line, tag in newest_tags(git_dir).items():
        with tempfile.TemporaryDirectory(prefix=f"mlm-{tag}-") as tmp:
            archive = subprocess.run(["git", "--git-dir", git_dir, "archive", tag, "megatron"], capture_output=True,
                                     check=True).stdout
            subprocess.run(["tar", "x", "-C", tmp], input=archive, check=True)
            got = read_checkout(tmp, tag)
        if got.name != line:
            raise SystemExit(f"{tag}: its package_info.py says {got.package_version}, not release line {line}")
        print(f"{tag}: {len(got.flags)} flags ({got.read_by})", file=sys.stderr)
        lines.append(got)
    return lines


def _merge(lines: list[snap.Line], path: str) -> snap.Snapshot:
    """The snapshot at ``path`` with ``lines`` put in (a line read again replaces the old one)."""
    old = snap.read(path).lines if os.path.isfile(path) else ()
    by_name = {x.name: x for x in old} | {x.name: x for x in lines}
    return snap.Snapshot(tuple(by_name[n] for n in sorted(by_name, key=lambda n: mcore_versions.parse(n[6:]))))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.megatron_flags", description=__doc__.split("\n")[0])
    p.add_argument("--git-dir", help="a Megatron-LM git directory: its newest tag of each supported line is read")
    p.add_argument("--checkout", action="append", default=[], help="a Megatron-LM checkout (repeat for several)")
    p.add_argument("--read", metavar="DIR", help="print one checkout's line as JSON (what the others run)")
    p.add_argument("--out", default=snap.PATH, help="the snapshot to write (default: the packaged one)")
    p.add_argument("--check", action="store_true", help="do not write; exit 1 if the snapshot would change")
    args = p.parse_args(argv)
    if args.read:
        print(json.dumps(read_here(os.path.abspath(args.read))))
        return 0
    lines = read_tags(args.git_dir) if args.git_dir else []
    lines += [read_checkout(os.path.abspath(c)) for c in args.checkout]
    if not lines:
        p.error("give --git-dir or --checkout")
    text = snap.to_json(_merge(lines, args.out))
    current = open(args.out, encoding="utf-8").read() if os.path.isfile(args.out) else None
    if args.check:
        if current != text:
            print(f"{args.out} is stale: run python -m scripts.megatron_flags", file=sys.stderr)
        return 0 if current == text else 1
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
