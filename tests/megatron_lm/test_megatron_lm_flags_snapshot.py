"""Opt-in: the flags of the Megatron-LM checkout at ``MEGATRON_LM_PATH``, read from its own parser by
``scripts/megatron_flags.py`` (in a fresh interpreter, the checkout first on its path), are the committed snapshot's
for that release line, and every one is classified by ``plan/megatron_flags.py``; so a checkout whose flags differ
(a patch release that adds one, a new line) is caught and the snapshot regenerated. Runs no job."""

from __future__ import annotations

import os

import pytest

from scripts import megatron_flags as script
from tenplex_megatron.plan import megatron_flag_snapshot as snap
from tenplex_megatron.plan import megatron_flags as flags

pytestmark = [pytest.mark.megatron_lm,
              pytest.mark.skipif(not os.environ.get("MEGATRON_LM_PATH"),
                                 reason="set MEGATRON_LM_PATH to a Megatron-LM core_v0.15.x-0.19.x checkout")]
MLM = os.environ.get("MEGATRON_LM_PATH", "")


def test_the_checkouts_flags_are_the_snapshots_for_its_line_and_all_classified() -> None:
    line = script.read_checkout(os.path.abspath(MLM))
    assert line.read_by == "import", f"{MLM}: its parser did not import; the ast reading misses dataclass-made flags"
    committed = snap.read().line(line.name)
    assert flags.unclassified(line.dests()) == [], f"{MLM} ({line.package_version}): classify these in " \
                                                   "plan/megatron_flags.py or megatron_flags_neutral.py"
    mine, theirs = {f.dest: f for f in line.flags}, {f.dest: f for f in committed.flags}
    diff = {"only in the checkout": sorted(set(mine) - set(theirs)),
            "only in the snapshot": sorted(set(theirs) - set(mine)),
            "other options": sorted(d for d in set(mine) & set(theirs) if mine[d] != theirs[d])}
    assert line.flags == committed.flags, (
        f"{MLM} (package version {line.package_version}) and the snapshot's {committed.name} "
        f"({committed.tag}, {committed.package_version}) differ: {diff}; regenerate with "
        f"python -m scripts.megatron_flags --checkout {MLM} (or --git-dir)")
