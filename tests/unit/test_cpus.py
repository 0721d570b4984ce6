"""The CPUs thread pools are sized from: the affinity, capped by a cgroup v2 or v1 CPU quota."""

from __future__ import annotations

import os

from tenplex_megatron.storage.cpus import usable_cpus

AFFINITY = len(os.sched_getaffinity(0))


def test_a_cgroup_v2_quota_caps_the_affinity_rounded_up(tmp_path) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert usable_cpus(str(tmp_path)) == min(AFFINITY, 2)
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # half a CPU: one thread
    assert usable_cpus(str(tmp_path)) == 1


def test_no_quota_or_none_readable_leaves_the_affinity(tmp_path) -> None:
    assert usable_cpus(str(tmp_path)) == AFFINITY
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cpus(str(tmp_path)) == AFFINITY


def test_a_cgroup_v1_quota_caps_the_affinity(tmp_path) -> None:
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cpus(str(tmp_path)) == 1
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")  # v1's "no limit"
    assert usable_cpus(str(tmp_path)) == AFFINITY
