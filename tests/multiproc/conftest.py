"""The multi-process suite loads through the staged path in copy mode, with small buffers, unless told otherwise.

Copy mode is what a GPU runs (``execute/staged.py``); on the CPU ``auto`` would
pick per-piece copies, so the launches inherit ``TENPLEX_STAGING=copy`` and a
0.25 MB staging budget (pieces split, buffers reused), and every matrix oracle
(bit-exact re-save, loss continuation) checks the GPU algorithm's indexing.
"""

from __future__ import annotations

import os

import pytest

STAGING = {"TENPLEX_STAGING": "copy", "TENPLEX_STAGING_MB": "0.25"}


@pytest.fixture(autouse=True)
def staged_copy_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each multi-process test's launches inherit the staged copy mode (unless the environment sets it); set per
    test, not at import, so the unit tests sharing a pytest process with these keep the default path."""
    for name, value in STAGING.items():
        if name not in os.environ:
            monkeypatch.setenv(name, value)
