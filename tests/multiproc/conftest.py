"""The multi-process suite loads through the parallel reader with small slots, unless told otherwise.

The launches inherit ``TENPLEX_STAGING=parallel`` (opt-in for loads, named so that
an outer setting cannot change it unseen) and a 0.25 MB staging budget (reads
cut into many runs, slots reused, pieces split across them), so every matrix
oracle (bit-exact re-save, loss continuation) checks the reader's indexing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

STAGING = {"TENPLEX_STAGING": "parallel", "TENPLEX_STAGING_MB": "0.25"}


@pytest.fixture(autouse=True, scope="module")
def staged_copy_mode() -> Iterator[None]:
    """Each multi-process module's launches inherit the parallel reader's mode (unless the environment sets it).

    Module-scoped so that it is set before the modules' own module-scoped fixtures launch (pytest builds autouse
    fixtures first within a scope, wider scopes first; a function-scoped one came too late for those launches);
    undone after the module, not set at import, so unit tests sharing a pytest process keep the default path."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in STAGING.items():
            if name not in os.environ:
                mp.setenv(name, value)
        yield
