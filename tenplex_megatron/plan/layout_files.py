"""A user's layout table and the measured iteration times: versioned JSON files, read and checked. Pure Python.

Layout table (``--tenplex-layout FILE.json``): the layout to use at each world size::

    {"version": 1, "layouts": {"4": {"tp": 2, "pp": 1, "dp": 2, "micro_batch_size": 2}, ...}}

Measured times (what ``--tenplex-layout measure`` keeps in the checkpoint
directory): seconds per iteration by world size and candidate key::

    {"version": 1, "times": {"4": {"tp=2,pp=1,dp=2,mbs=2": 0.53, ...}, ...}}

Every error names the file, the row (world size) and the line and column.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass

from tenplex_megatron.plan.autolayout import candidate_key, illegal_reasons, parse_candidate_key
from tenplex_megatron.plan.json_pos import JSONFileError, Path, loads_located, where
from tenplex_megatron.plan.layout import LayoutError, ParallelLayout
from tenplex_megatron.plan.sim.gpt_catalogue import GPTDims
from tenplex_megatron.plan.versioned import VersionedFormat

TABLE_VERSION = 1
TIMES_VERSION = 1
LAYOUT_TIMES_FILE = "tenplex_layout_times.json"
_ROW_FIELDS = ("tp", "pp", "dp", "micro_batch_size")


@dataclass(frozen=True)
class TableRow:
    """The layout and micro-batch size a user's table gives for one world size."""

    world_size: int
    layout: ParallelLayout
    micro_batch_size: int

    @property
    def key(self) -> str:
        return candidate_key(self.layout, self.micro_batch_size)


@dataclass(frozen=True)
class LayoutTable:
    """A user's layout table, every row checked."""

    path: str
    rows: tuple[TableRow, ...]

    def row(self, world_size: int) -> TableRow:
        """The row for ``world_size``; :class:`LayoutError` naming the file and the sizes it has otherwise."""
        for r in self.rows:
            if r.world_size == world_size:
                return r
        sizes = ", ".join(str(r.world_size) for r in self.rows)
        raise LayoutError(f"{self.path}: no layout for world size {world_size} (the table has {sizes})")


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        raise LayoutError(f"{path}: cannot read: {e.strerror}") from None


def _located(text: str, name: str) -> tuple[object, dict[Path, tuple[int, int]]]:
    try:
        return loads_located(text, name)
    except JSONFileError as e:
        raise LayoutError(str(e)) from None


def _versioned(doc: object, name: str, pos: dict[Path, tuple[int, int]], body: str, version: int) -> dict:
    shape = f'{{"version": {version}, "{body}": {{...}}}}'
    VersionedFormat(shape, "version", (version,), LayoutError).check(doc, where(name, pos, ()),
                                                                     where(name, pos, ("version",)))
    assert isinstance(doc, dict)
    if not isinstance(doc.get(body), dict):
        raise LayoutError(f"{where(name, pos, (body,))}: expected an object {shape}")
    extra = sorted(set(doc) - {"version", body, "_comment"})
    if extra:
        raise LayoutError(f"{where(name, pos, (extra[0],))}: unknown field(s) {', '.join(map(repr, extra))}")
    return doc[body]


def _world(key: str, where_: str) -> int:
    if not key.isdigit() or int(key) < 1:
        raise LayoutError(f"{where_}: row {key!r}: the key must be a world size (a positive integer)")
    return int(key)


def parse_layout_table(text: str, name: str, dims: GPTDims | None = None, *, gpus_per_node: int | None = None,
                       global_batch_size: int | None = None) -> LayoutTable:
    """Parse and check a layout table; with ``dims`` every row must be a legal layout for the model.

    Every bad row is reported (one :class:`LayoutError`), each naming its world
    size, line and column and every rule it breaks.
    """
    doc, pos = _located(text, name)
    layouts = _versioned(doc, name, pos, "layouts", TABLE_VERSION)
    rows, problems = [], []
    for key, spec in layouts.items():
        at = where(name, pos, ("layouts", key))
        world = _world(key, at)
        if not isinstance(spec, dict) or set(spec) != set(_ROW_FIELDS) or not all(
                isinstance(spec[f], int) and not isinstance(spec[f], bool) and spec[f] >= 1 for f in _ROW_FIELDS):
            problems.append(f"{at}: row \"{key}\": expected {{\"tp\": N, \"pp\": N, \"dp\": N, \"micro_batch_size\": N}} "
                            f"with positive integers, got {json.dumps(spec)}")
            continue
        row = TableRow(world, ParallelLayout(spec["tp"], spec["pp"], spec["dp"]), spec["micro_batch_size"])
        if dims is not None:
            why = illegal_reasons(dims, row.layout, row.micro_batch_size, global_batch_size, world_size=world,
                                  gpus_per_node=gpus_per_node)
        elif row.layout.world_size != world:
            why = [f"TP x PP x DP = {row.layout.world_size} is not the world size {world}"]
        else:
            why = []
        if why:
            problems.append(f"{at}: row \"{key}\" ({row.key}): " + "; ".join(why))
        rows.append(row)
    if problems:
        raise LayoutError(f"{name}: impossible layout(s) in the table:\n  " + "\n  ".join(problems))
    if not rows:
        raise LayoutError(f"{where(name, pos, ('layouts',))}: the table has no rows")
    return LayoutTable(name, tuple(sorted(rows, key=lambda r: r.world_size)))


def load_layout_table(path: str, dims: GPTDims | None = None, *, gpus_per_node: int | None = None,
                      global_batch_size: int | None = None) -> LayoutTable:
    """Read and check the layout table at ``path`` (see :func:`parse_layout_table`)."""
    return parse_layout_table(_read(path), path, dims, gpus_per_node=gpus_per_node, global_batch_size=global_batch_size)


def parse_layout_times(text: str, name: str) -> dict[int, dict[str, float]]:
    """Measured seconds per iteration by world size and candidate key; errors name the entry's line and column."""
    doc, pos = _located(text, name)
    times = _versioned(doc, name, pos, "times", TIMES_VERSION)
    out: dict[int, dict[str, float]] = {}
    for key, entries in times.items():
        world = _world(key, where(name, pos, ("times", key)))
        if not isinstance(entries, dict):
            raise LayoutError(f"{where(name, pos, ('times', key))}: row \"{key}\": expected {{\"tp=..,mbs=..\": seconds}}")
        row = out.setdefault(world, {})
        for cand, seconds in entries.items():
            at = where(name, pos, ("times", key, cand))
            try:
                layout, _ = parse_candidate_key(cand)
            except LayoutError as e:
                raise LayoutError(f"{at}: row \"{key}\": {e}") from None
            if layout.world_size != world:
                raise LayoutError(f"{at}: row \"{key}\": {cand} has {layout.world_size} ranks, not {world}")
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (
                    math.isfinite(seconds) and seconds > 0):
                raise LayoutError(f"{at}: row \"{key}\": {cand}: seconds must be a positive number, got {seconds!r}")
            row[cand] = float(seconds)
    return out


def format_layout_times(times: Mapping[int, Mapping[str, float]]) -> str:
    """The versioned JSON text of measured times (keys sorted, so equal content gives equal text)."""
    body = {str(w): {k: float(s) for k, s in sorted(times[w].items())} for w in sorted(times)}
    return json.dumps({"version": TIMES_VERSION, "times": body}, indent=1) + "\n"


def read_layout_times(path: str) -> dict[int, dict[str, float]]:
    """The measured times at ``path``; a missing file is no measurements yet."""
    if not os.path.exists(path):
        return {}
    return parse_layout_times(_read(path), path)


def write_layout_times(path: str, times: Mapping[int, Mapping[str, float]]) -> None:
    """Write measured times atomically (a temporary file in the same directory, then a rename)."""
    text = format_layout_times(times)
    parse_layout_times(text, path)  # never write what could not be read back
    fd, tmp = tempfile.mkstemp(prefix=".tmp_layout_times_", dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def with_measurement(times: Mapping[int, Mapping[str, float]], world_size: int, key: str,
                     seconds: float) -> dict[int, dict[str, float]]:
    """A copy of ``times`` with one more (or a replaced) measurement."""
    out = {w: dict(row) for w, row in times.items()}
    out.setdefault(world_size, {})[key] = seconds
    return out
