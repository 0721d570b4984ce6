"""Optional dependencies: import one, or fail with the ``pip install tenplex-megatron[EXTRA]`` that provides it."""

from __future__ import annotations

import importlib
from types import ModuleType

from tenplex_megatron.errors import TenplexError

DIST = "tenplex-megatron"


class MissingExtraError(TenplexError, ImportError):
    """An optional dependency (or one of its own imports) is not installed; the message names the extra."""


def install_hint(extra: str) -> str:
    """The command that installs an extra, quoted for the shell."""
    return f"pip install '{DIST}[{extra}]'"


def require(module: str, extra: str, needed_by: str = "", note: str = "") -> ModuleType:
    """``import module``, or raise :class:`MissingExtraError` naming ``extra`` (and ``needed_by``, ``note``)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        missing = e.name or module
        what = f"{needed_by} needs {module}" if needed_by else f"{module} is needed here"
        own = missing == module or module.startswith(missing + ".")
        cause = "" if own else f" (importing it failed: no module named {missing!r})"
        extra_note = f"; {note}" if note else ""
        raise MissingExtraError(f"{what}, which is not installed{cause}: {install_hint(extra)}{extra_note}",
                                name=missing) from e
