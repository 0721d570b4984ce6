"""The GPU check's table cells: figures, seconds and the why of a result as text (``-``: not measured)."""

from __future__ import annotations

from typing import Any


def gbps(value: Any) -> str:
    """A GB/s figure for the table (``-``: not measured)."""
    return f"{value:.2f}" if isinstance(value, int | float) else "-"


def sci(value: Any) -> str:
    """A relative difference for the table (``-``: not measured)."""
    return f"{value:.1e}" if isinstance(value, int | float) else "-"


def secs(d: dict[str, Any]) -> str:
    """A result's seconds for the table."""
    return f"{d['seconds']:.0f}" if isinstance(d.get("seconds"), int | float) else "-"


def why_text(d: dict[str, Any]) -> str:
    """A result's why, in parentheses after its figures (nothing when it has none)."""
    return f" ({d['why']})" if d.get("why") else ""
