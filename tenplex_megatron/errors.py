"""The root of the package's errors: every error tenplex-megatron raises is a :class:`TenplexError`.

A caller catches the plugin's errors as one (``except TenplexError``); each class keeps its
other bases (``ValueError``, ``RuntimeError``, ``ImportError``) so narrower ``except`` clauses still work.
Pure Python, imports nothing, so every layer (``plan/`` included) can use it.
"""

from __future__ import annotations


class TenplexError(Exception):
    """An error raised by tenplex-megatron; the message names the file, tensor or flag at fault."""
