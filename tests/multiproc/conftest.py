"""The multi-process suite loads with small staging slots, unless told otherwise.

The launches inherit a 0.25 MB staging budget (the parallel reader's reads cut
into many runs, slots reused, pieces split across them), so every matrix oracle
(bit-exact re-save, loss continuation) checks the reader's indexing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

BUDGET_MB = "0.25"


@pytest.fixture(autouse=True, scope="module")
def small_staging_budget() -> Iterator[None]:
    """Each multi-process module's launches inherit the small staging budget (unless the environment sets one).

    Module-scoped so that it is set before the modules' own module-scoped fixtures launch (pytest builds autouse
    fixtures first within a scope, wider scopes first; a function-scoped one came too late for those launches);
    undone after the module, not set at import, so unit tests sharing a pytest process keep the default budget."""
    with pytest.MonkeyPatch.context() as mp:
        if "TENPLEX_STAGING_MB" not in os.environ:
            mp.setenv("TENPLEX_STAGING_MB", BUDGET_MB)
        yield
