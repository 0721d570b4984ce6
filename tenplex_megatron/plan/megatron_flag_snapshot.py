"""The flags of Megatron-LM's ``pretrain_gpt.py`` per release line, as ``scripts/megatron_flags.py`` read them from
Megatron-LM's own argument parser: the snapshot ``megatron_flags_snapshot.json`` beside this module.

Each flag is one argparse destination (``dest``, the args attribute) with its option strings and where it comes
from: ``megatron`` (``add_megatron_arguments``) or ``modelopt`` (``add_modelopt_args``, which ``pretrain_gpt.py``
adds where nvidia-modelopt imports). ``plan/megatron_flags.py`` classifies every destination of every line. Pure.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from tenplex_megatron.errors import TenplexError
from tenplex_megatron.plan.versioned import VersionedFormat

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_flags_snapshot.json")
SOURCES = ("megatron", "modelopt")


class FlagSnapshotError(TenplexError, ValueError):
    """The flag snapshot is not one this build reads, or a line it was asked for is not in it."""


FORMAT = VersionedFormat("Megatron-LM flag snapshot", "version", (1,), FlagSnapshotError,
                         name="tenplex-megatron-lm-flags")


@dataclass(frozen=True)
class Flag:
    """One destination of Megatron-LM's parser: its option strings and the function that adds it."""

    dest: str
    options: tuple[str, ...]
    source: str = "megatron"

    def to_json(self) -> dict[str, Any]:
        return {"dest": self.dest, "options": list(self.options), "source": self.source}


@dataclass(frozen=True)
class Line:
    """One release line (``core_v0.16``): the tag read, the version its package_info.py declares, how the flags were
    read (``import``: the parser built; ``ast``: its ``add_argument`` calls parsed) and the flags."""

    name: str
    tag: str | None
    package_version: str
    read_by: str
    flags: tuple[Flag, ...]

    def dests(self) -> tuple[str, ...]:
        """Every destination of the line, sorted."""
        return tuple(f.dest for f in self.flags)


@dataclass(frozen=True)
class Snapshot:
    """Every release line read, oldest first."""

    lines: tuple[Line, ...]

    def line(self, name: str) -> Line:
        """The line called ``name`` (``core_v0.16``); FlagSnapshotError naming the lines there otherwise."""
        for line in self.lines:
            if line.name == name:
                return line
        raise FlagSnapshotError(f"no release line {name} in the flag snapshot (it has "
                                f"{', '.join(x.name for x in self.lines)}): run python -m scripts.megatron_flags")

    def options(self) -> dict[str, tuple[str, ...]]:
        """Every option string of each destination, over all lines (a flag renamed in one line keeps both)."""
        out: dict[str, set[str]] = {}
        for line in self.lines:
            for f in line.flags:
                out.setdefault(f.dest, set()).update(f.options)
        return {dest: tuple(sorted(opts)) for dest, opts in out.items()}


def line_name(version: tuple[int, ...]) -> str:
    """The release line of a megatron-core version: (0, 16, 1) -> ``core_v0.16``."""
    return f"core_v{version[0]}.{version[1]}"


def to_json(snapshot: Snapshot) -> str:
    """The snapshot's file: each flag once, on a line of its own, with the release lines it is in (the same options
    and source); stable order, so a regenerated file differs only where Megatron-LM's flags do."""
    grouped: dict[tuple[str, tuple[str, ...], str], list[str]] = {}
    for line in snapshot.lines:
        for f in line.flags:
            grouped.setdefault((f.dest, f.options, f.source), []).append(line.name)
    head = {"format": FORMAT.name, "version": 1, "generator": "python -m scripts.megatron_flags",
            "lines": [{"name": x.name, "tag": x.tag, "package_version": x.package_version, "read_by": x.read_by,
                       "count": len(x.flags)} for x in snapshot.lines]}
    rows = [json.dumps({"dest": d, "options": list(o), "source": s, "lines": names})
            for (d, o, s), names in sorted(grouped.items())]
    text = json.dumps(head, indent=1)
    return text[:-2] + ',\n "flags": [\n  ' + ",\n  ".join(rows) + "\n ]\n}\n"


def from_json(doc: Any, where: str = PATH) -> Snapshot:
    """The snapshot a parsed file holds (FlagSnapshotError naming ``where`` when it is not one this build reads)."""
    FORMAT.check(doc, where)
    by_line: dict[str, dict[str, Flag]] = {}
    for row in doc["flags"]:
        flag = Flag(row["dest"], tuple(row["options"]), row["source"])
        for name in row["lines"]:
            by_line.setdefault(name, {})[flag.dest] = flag
    lines = []
    for head in doc["lines"]:
        flags = by_line.get(head["name"], {})
        if len(flags) != head["count"]:
            raise FlagSnapshotError(f"{where}: line {head['name']}: {len(flags)} flags, its count says {head['count']}")
        lines.append(Line(head["name"], head["tag"], head["package_version"], head["read_by"],
                          tuple(flags[d] for d in sorted(flags))))
    return Snapshot(tuple(lines))


def read(path: str = PATH) -> Snapshot:
    """The snapshot at ``path`` (default: the packaged one)."""
    with open(path, encoding="utf-8") as f:
        return from_json(json.load(f), path)
