"""Opt-in: Megatron-LM's in-process restart with ``--tenplex`` uses the user's hot spares first.

4 ranks under the in-process launcher, ``--inprocess-active-world-size 2``: ranks 0 and 1 train at TP2 (the
layout table's only entry), 2 and 3 wait as spares. Active rank 1 is SIGKILLed during its snapshot of iteration 3
(``TENPLEX_FAULT``, once). NVRx moves a spare into its place: the world stays 2, the layout TP2, and ``pretrain``,
called again in the same processes, restores the newest complete snapshot from host memory at the same layout.
Oracle: every logged iteration's loss equals an uninterrupted torchrun run at TP2 (fp32, 1e-5), the data position
exact, the processes the launcher's, the spare's pid among them, nothing read from durable storage.
"""

from __future__ import annotations

import os
import re
import subprocess
from datetime import datetime

import pytest

from tests.megatron_lm.test_megatron_lm import MLM, _env, _log_lines, _losses, _reference, patched_script
from tests.megatron_lm.test_megatron_lm_inprocess import (
    CALL,
    STAMP,
    STARTED,
    STATUSES,
    _pairs,
    _port_pair,
    launcher_cmd,
    unavailable,
)

pytestmark = [pytest.mark.megatron_lm,
              pytest.mark.skipif(not MLM, reason="set MEGATRON_LM_PATH to a Megatron-LM core_v0.15.x-0.19.x checkout"),
              pytest.mark.skipif(bool(MLM and unavailable()), reason=unavailable() if MLM else "")]


def test_megatron_lm_inprocess_restart_uses_a_hot_spare_first(tmp_path) -> None:
    script = patched_script(tmp_path)
    ref = _reference(script, 95)  # uninterrupted, torchrun, TP2
    env, cpu = _env()
    env.update(PYTHONUNBUFFERED="1", TENPLEX_FAULT="memory.write@1#3", TENPLEX_FAULT_ONCE=str(tmp_path / "once"))
    cmd = launcher_cmd(script, tmp_path / "layouts.json", {"2": {"tp": 2, "pp": 1, "dp": 1, "micro_batch_size": 2}},
                       tmp_path / "ckpt", tmp_path / "mem", _port_pair(), cpu, ["--nproc-per-node", "4"],
                       ["--inprocess-active-world-size", "2"])
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=660)
    log = p.stdout
    assert p.returncode == 0, log[-6000:]

    started, statuses = _pairs(STARTED.search(log).group(1)), _pairs(STATUSES.search(log).group(1))
    assert statuses[1] == -9 and all(statuses[r] == 0 for r in (0, 2, 3)), statuses
    calls = [tuple(map(int, m.groups())) for m in CALL.finditer(log)]
    # the first call at world size 2 (rank 0 says it; the others' first call logs at info level only)
    assert [(rank, world, initial) for it, rank, world, initial, _ in calls if it == 0] == [(0, 2, 0)], calls
    after = sorted((rank, world, initial, pid) for it, rank, world, initial, pid in calls if it == 1)
    assert [(rank, world) for rank, world, _, _ in after] == [(0, 2), (1, 2)], calls  # the world kept at 2
    assert after[0][2] == 0 and after[1][2] in (2, 3), calls  # a spare took the lost rank's place
    for _, _, initial, pid in after:  # in the processes the launcher started
        assert pid == started[initial], (initial, pid, started)

    cut = log.index("in place: call 1:")
    first, second = log[:cut], log[cut:]
    loaded = re.search(r"> tenplex: loaded iteration (\d+) from host memory \(\S+\): layout tp=2,pp=1,dp=1 -> "
                       r"tp=2,pp=1,dp=1, .*0 bytes read from durable storage", second)
    assert loaded, second[-4000:]
    resumed_from = int(loaded.group(1))
    assert resumed_from == 2  # rank 1 died in its snapshot of iteration 3
    assert [it for it, _, _ in _log_lines(first)] == [1, 2, 3]
    lines = _log_lines(second)
    assert [(it, consumed) for it, consumed, _ in lines] == [(it, 8 * it) for it in range(resumed_from + 1, 9)], lines
    for part, losses in (("before", _losses(first)), ("after", _losses(second))):
        for it, loss in sorted(losses.items()):
            assert loss == pytest.approx(ref[it], rel=1e-5, abs=5e-6), (part, it, loss, ref[it])
    # kill -> first iteration after it (a figure, printed, not asserted): from the last iteration before the kill
    stamps = [datetime.fromisoformat(ts) for ts, _ in STAMP.findall(log)]
    n = len(_log_lines(first))
    print(f"last iteration before the kill -> first with the spare: {(stamps[n] - stamps[n - 1]).total_seconds():.2f} s "
          f"(gloo timeout 10 s; 1-minute load {os.getloadavg()[0]:.2f})")
