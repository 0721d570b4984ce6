"""``--tenplex-inprocess``'s refusals and rules, before any process group: plain torchrun refused with the command to
use, NVRx missing named as the extra, a timeout too short named, the largest legal world admitted, the launcher's
exit status."""

from __future__ import annotations

import sys

import pytest

from tenplex_megatron.frontdoor import inprocess, launch
from tenplex_megatron.training import pretrain
from tenplex_megatron.training.inprocess import why_not
from tests.harness import TINY_GPT

ARGV = [*TINY_GPT, "--vocab-size", "96", "--train-iters", "4", "--tensor-model-parallel-size", "2",
        "--tenplex-inprocess"]


@pytest.fixture
def four_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 of 4 as a launcher sets it (the orphan guard off: this process's parent is no agent)."""
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4",
                 "TENPLEX_ORPHAN_EXIT": "0"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv(inprocess.STORE_ENV, raising=False)


def test_plain_torchrun_is_refused_with_the_command_to_use(four_ranks: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job1")
    with pytest.raises(SystemExit) as e:
        pretrain.main(ARGV)
    msg = str(e.value)
    assert "--tenplex-inprocess" in msg and "torchrun, which ends every worker when one exits" in msg
    assert f"python -m tenplex_megatron.frontdoor.launch --nproc-per-node 4 pretrain_gpt.py {' '.join(ARGV)}" in msg


def test_a_launcher_without_the_stores_is_refused(four_ranks: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with pytest.raises(SystemExit, match="does not serve the job's stores outside the ranks"):
        pretrain.main(ARGV)


def test_missing_nvrx_names_the_extra(four_ranks: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(inprocess.STORE_ENV, "127.0.0.1:1")
    monkeypatch.setitem(sys.modules, "nvidia_resiliency_ext", None)  # as if not installed: importing it fails
    monkeypatch.setitem(sys.modules, "nvidia_resiliency_ext.inprocess", None)
    with pytest.raises(SystemExit) as e:
        pretrain.main(ARGV)
    assert "--tenplex-inprocess needs nvidia_resiliency_ext.inprocess" in str(e.value)
    assert "pip install 'tenplex-megatron[inprocess]'" in str(e.value)


def test_a_timeout_too_short_to_detect_anything_is_refused(four_ranks: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(inprocess.STORE_ENV, "127.0.0.1:1")
    with pytest.raises(SystemExit, match=r"--tenplex-inprocess-timeout must be > 1 seconds .*got 0.5"):
        pretrain.main([*ARGV, "--tenplex-inprocess-timeout", "0.5"])
    s = inprocess.InprocessSettings(timeout=10)
    assert s.timeout < s.soft < s.hard < s.barrier  # NVRx's own order, checked by its Wrapper too


def test_the_largest_legal_world_is_admitted() -> None:
    legal = why_not(pretrain.build_parser(), ARGV)  # TP2, global batch 8, micro-batch 2
    assert [n for n in range(1, 9) if not legal(n)] == [2, 4, 8]
    assert "2 x 1 does not divide it" in legal(3)
    assert "--global-batch-size 8 is not a multiple of --micro-batch-size x DP = 2 x 6" in legal(12)
    admit = [inprocess.admitted(n, lambda k: not legal(k)) for n in range(1, 9)]
    assert admit == [0, 2, 2, 4, 4, 4, 4, 8]  # 1 rank: none (the job ends); 3: 2 and a spare
    auto = why_not(pretrain.build_parser(), [*TINY_GPT, "--vocab-size", "96", "--train-iters", "4",
                                               "--tenplex-layout", "auto"])
    assert not auto(1) and not auto(2) and not auto(4)
    assert "--tenplex-layout auto: no usable layout for world size 3" in auto(3)  # every candidate, with why


def test_warning_without_host_memory_says_what_is_lost() -> None:
    assert "saved every 5 iterations" in inprocess.durable_only("/ckpt", 5)
    assert "trained again" in inprocess.durable_only("/ckpt", None) and "only at the end" in \
        inprocess.durable_only("/ckpt", None)
    assert "from the beginning" in inprocess.durable_only(None, None)


def test_the_launchers_exit_status() -> None:
    assert launch.exit_status([0, 0, -9, 0]) == 0  # a fault the job survived
    assert launch.exit_status([-9, -9]) == 1  # nobody finished
    assert launch.exit_status([0, 2, 0]) == 2  # a rank failed: its status
    env = launch.rank_env(launch.parse(["--nproc-per-node", "3", "--master-port", "29900", "x.py", "--a"]), 2)
    assert (env["RANK"], env["WORLD_SIZE"], env[inprocess.STORE_ENV]) == ("2", "3", "127.0.0.1:29900")


def test_the_launchers_second_node_numbers_its_ranks_after_the_first_and_uses_its_stores() -> None:
    a = launch.parse(["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--nproc-per-node", "2",
                      "x.py"])
    env = launch.rank_env(a, 1)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"]) == \
        ("3", "1", "4", "2", "1")
    assert env[inprocess.STORE_ENV] == "10.0.0.1:29500"
    for bad in (["--nnodes", "2", "--node-rank", "2"], ["--nnodes", "0"]):
        with pytest.raises(SystemExit):
            launch.parse([*bad, "--nproc-per-node", "1", "x.py"])


def test_the_monitor_log_directory_is_made_or_refused_naming_the_variable(tmp_path, monkeypatch) -> None:
    """NVRx's monitor process cannot open a log in a missing directory and the ranks then hang: made at start, and
    one that cannot be made (under a file) refused naming TENPLEX_INPROCESS_LOGDIR."""
    monkeypatch.delenv("TENPLEX_INPROCESS_LOGDIR", raising=False)
    assert inprocess.monitor_logfile("pretrain_gpt.py", 3) is None
    monkeypatch.setenv("TENPLEX_INPROCESS_LOGDIR", str(tmp_path / "logs" / "nvrx"))
    assert inprocess.monitor_logfile("pretrain_gpt.py", 3) == str(tmp_path / "logs" / "nvrx" / "nvrx-monitor-3.log")
    assert (tmp_path / "logs" / "nvrx").is_dir()
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TENPLEX_INPROCESS_LOGDIR", str(tmp_path / "file" / "nvrx"))
    with pytest.raises(SystemExit, match=r"pretrain_gpt.py: error: TENPLEX_INPROCESS_LOGDIR=.*file/nvrx: cannot make"):
        inprocess.monitor_logfile("pretrain_gpt.py", 3)
