"""The printed report: fixed-width tables, RATIO lines, and the machine a run was measured on."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Column:
    """A table column: header, width, alignment (``<`` or ``>``) and the text before it."""

    header: str
    width: int
    align: str = ">"
    sep: str = " "


class Table:
    """Rows of pre-formatted cells in fixed-width columns, after an ``indent``."""

    def __init__(self, columns: list[Column], indent: str = "") -> None:
        self.columns = columns
        self.indent = indent

    def row(self, *cells: str) -> str:
        if len(cells) != len(self.columns):
            raise ValueError(f"{len(cells)} cells for {len(self.columns)} columns")
        body = "".join(f"{c.sep if i else ''}{cell:{c.align}{c.width}}" for i, (c, cell) in enumerate(zip(self.columns, cells)))
        return self.indent + body

    def header(self) -> str:
        return self.row(*(c.header for c in self.columns))


def num(value: float | None, spec: str, missing: str = "-") -> str:
    """``value`` formatted with ``spec``, or ``missing`` when there is none."""
    return missing if value is None else f"{value:{spec}}"


def ratio_key(metric: str, target: str, mine: str, peer: str) -> str:
    """``<metric> <target> <mine>/<peer>``: one ratio's name (below 1: ``mine`` is better)."""
    return f"{metric} {target} {mine}/{peer}"


def ratio_line(key: str, value: float) -> str:
    return f"RATIO {key} = {value:.2f}"


def machine() -> dict[str, Any]:
    """What a report records about the machine (torch's version and whether a GPU is visible)."""
    import torch

    return {"cpus": os.cpu_count(), "python": sys.version.split()[0], "torch": torch.__version__,
            "gpu": torch.cuda.is_available(), "load_average": os.getloadavg()}
