"""The multi-process suite loads through the parallel reader with small slots, unless told otherwise.

The launches inherit ``TENPLEX_STAGING=parallel`` (opt-in for loads, named so that
an outer setting cannot change it unseen) and a 0.25 MB staging budget (reads
cut into many runs, slots reused, pieces split across them), so every matrix
oracle (bit-exact re-save, loss continuation) checks the reader's indexing.
"""

from __future__ import annotations

import os

import pytest

STAGING = {"TENPLEX_STAGING": "parallel", "TENPLEX_STAGING_MB": "0.25"}


@pytest.fixture(autouse=True)
def staged_copy_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each multi-process test's launches inherit the parallel reader's mode (unless the environment sets it); set per
    test, not at import, so the unit tests sharing a pytest process with these keep the default path."""
    for name, value in STAGING.items():
        if name not in os.environ:
            monkeypatch.setenv(name, value)
