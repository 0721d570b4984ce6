"""Slurm without a cluster: the start-up checks of ``frontdoor/slurm.py`` over environment mappings (the trainer's
refusal through its own ``parse_args``, the launcher's through ``main`` with ``exec`` caught), and the job's
identity under Slurm (``storage/job_identity.py``) with the directory's lease it decides (``storage/lease.py``):
a requeued job takes its directory back at once, another job is refused naming the directory and the holder's id,
a lost allocation's lease is taken over once it lapses. The same against a real Slurm: tests/multiproc/test_slurm.py.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import time
import uuid
from argparse import Namespace

import pytest

from tenplex_megatron.engine import orphan
from tenplex_megatron.frontdoor import lease_flags, slurm
from tenplex_megatron.frontdoor.job_config import JobConfig, LeaseConfig
from tenplex_megatron.frontdoor.membership import LEAVES_ENV
from tenplex_megatron.storage import job_identity, lease
from tenplex_megatron.training import layout_choice, pretrain
from tests.harness import TINY_GPT

#: a task of a 2-node srun step (one torchrun per node) of Slurm job 41 on cluster "tenplex", node 1
STEP = {"SLURM_JOB_ID": "41", "SLURM_CLUSTER_NAME": "tenplex", "SLURM_NNODES": "2", "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NODEID": "1", "SLURM_PROCID": "1", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NUM_NODES": "2", "SLURM_JOB_NODELIST": "n[1-2]"}
LAUNCH = ["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "1", "--master-addr", "n1", "--master-port",
          "20041", "scripts/pretrain_gpt.py", "--global-batch-size", "8"]


def _resolves(host: str) -> None:
    if host not in ("n1", "n2"):
        raise socket.gaierror(-2, "Name or service not known")


def test_the_allocation_is_read_from_slurms_variables_and_a_bad_one_is_named() -> None:
    a = slurm.allocation(STEP)
    assert (a.job_id, a.nodes, a.node_id, a.task, a.launchers, a.restart_count) == ("41", 2, 1, 1, 2, 0)
    assert slurm.allocation({"SLURM_JOB_ID": "41", "SLURM_JOB_NUM_NODES": "3"}).launchers == 3  # the batch shell
    assert slurm.allocation({}) is None and slurm.launch_problems({}, ["--nnodes", "9"]) == []
    with pytest.raises(slurm.SlurmLaunchError, match=r"SLURM_NNODES='two' is not a number"):
        slurm.allocation({**STEP, "SLURM_NNODES": "two"})


def test_torchruns_options_are_read_up_to_the_training_script() -> None:
    got = slurm.torchrun_options(["--standalone", "--nnodes=1:2", "--max_restarts", "3", "--rdzv-endpoint", "h:29",
                                  "train.py", "--master-addr", "not-torchruns"])
    assert got == {"standalone": "1", "nnodes": "1:2", "max_restarts": "3", "rdzv_endpoint": "h:29"}
    assert slurm.torchrun_options(["--node_rank", "0", "-m", "pkg.train", "--nnodes", "7"]) == {"node_rank": "0"}
    assert slurm.endpoint_host("n1:29400") == "n1" and slurm.endpoint_host("[::1]:29400") == "::1"
    assert slurm.torchrun_words(["torchrun", "--nnodes", "2"]) == ["--nnodes", "2"]
    assert slurm.torchrun_words(["/usr/bin/python3", "-m", "torch.distributed.run", "x.py"]) == ["x.py"]
    assert slurm.torchrun_words(["mpirun", "x"]) is None


def test_a_launch_that_disagrees_with_the_allocation_is_one_line_naming_the_flag_and_the_variable() -> None:
    assert slurm.launch_problems(STEP, LAUNCH, _resolves) == []
    (nnodes,) = slurm.launch_problems({**STEP, "SLURM_NNODES": "1", "SLURM_STEP_NUM_TASKS": "1", "SLURM_NODEID": "0",
                                       "SLURM_PROCID": "0"}, ["--nnodes", "2", "--node-rank", "0"], _resolves)
    assert nnodes.startswith("torchrun --nnodes 2 disagrees with Slurm job 41 (SLURM_NNODES=1, "
                             "SLURM_JOB_NODELIST=n[1-2]): SLURM_NNODES=1 node(s), one torchrun each; pass "
                             '--nnodes "$SLURM_NNODES"'), nnodes
    assert slurm.launch_problems(STEP, ["--nnodes", "1:4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "n1:29"],
                                 _resolves) == []  # an elastic range that holds the step's 2 torchruns
    (rank,) = slurm.launch_problems(STEP, [*LAUNCH[:2], "--node-rank", "0", *LAUNCH[4:]], _resolves)
    assert rank.startswith("torchrun --node-rank 0 on the node of SLURM_NODEID=1") and \
        '--node-rank "$SLURM_NODEID" expanded on each node' in rank, rank
    (head,) = slurm.launch_problems(STEP, [*LAUNCH[:6], "--master-addr", "n[1-2]", *LAUNCH[8:]], _resolves)
    assert head.startswith("torchrun --master-addr 'n[1-2]': the head node does not resolve") and \
        'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -1' in head, head
    (endpoint,) = slurm.launch_problems(STEP, ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                                               "nohost:29400", "x.py"], _resolves)
    assert endpoint.startswith("torchrun --rdzv-endpoint 'nohost': the head node does not resolve"), endpoint


def test_the_inplace_launcher_in_an_srun_step_refuses_in_one_line_what_the_allocation_cannot_run(monkeypatch,
                                                                                              capsys) -> None:
    """``python -m tenplex_megatron.frontdoor.launch`` srun-ed one per node: ``--nnodes`` and ``--node-rank`` against
    the step (a joining step adds nodes: not checked), the head node resolvable; in the batch shell or without
    Slurm nothing is checked. Through the launcher's parser: exit 2 naming the flag and the variable."""
    from tenplex_megatron.frontdoor import launch

    one = {**STEP, "SLURM_NNODES": "1", "SLURM_STEP_NUM_TASKS": "1", "SLURM_NODEID": "0", "SLURM_PROCID": "0"}
    assert slurm.inplace_problems(STEP, 2, 1, "n1", False, _resolves) == []
    (nnodes,) = slurm.inplace_problems(one, 2, 0, "n1", False, _resolves)
    assert nnodes.startswith("launcher --nnodes 2 disagrees with Slurm job 41 (SLURM_NNODES=1, SLURM_JOB_NODELIST="
                             "n[1-2]): SLURM_NNODES=1 node(s), one launcher each; pass --nnodes \"$SLURM_NNODES\""), nnodes
    (rank,) = slurm.inplace_problems(STEP, 2, 0, "n1", False, _resolves)
    assert rank.startswith("launcher --node-rank 0 on the node of SLURM_NODEID=1"), rank
    (head,) = slurm.inplace_problems(STEP, 2, 1, "n[1-2]", False, _resolves)
    assert head.startswith("launcher --master-addr 'n[1-2]': the head node does not resolve"), head
    assert slurm.inplace_problems(one, 1, 1, "n1", True, _resolves) == []  # a joining step: --join's own ranks
    assert slurm.inplace_problems({**STEP, "SLURM_STEP_ID": "batch"}, 1, 0, "n1", False, _resolves) == []
    assert slurm.inplace_problems({}, 9, 0, "n1", False, _resolves) == []
    for k in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(k)
    for k, v in one.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as e:
        launch.parse(["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "localhost", "x.py"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1].startswith("python -m tenplex_megatron.frontdoor.launch: error: launcher "
                                                    "--nnodes 2 disagrees with Slurm job 41"), err
    a = launch.parse(["--join", "--node-rank", "1", "--nproc-per-node", "1", "--master-addr", "localhost", "x.py"])
    assert launch.leaves_on_sigterm(a) and launch.rank_env(a, 0)[LEAVES_ENV] == "1"  # Slurm's SIGTERM: a leave
    a = launch.parse(["--reform", "--nproc-per-node", "1", "--master-addr", "localhost", "x.py"])
    assert not launch.leaves_on_sigterm(a) and LEAVES_ENV not in launch.rank_env(a, 0)  # node 0: the job stops


def test_the_launcher_refuses_in_one_line_or_runs_torchrun_with_sigterm_left_to_the_workers(monkeypatch,
                                                                                            capsys) -> None:
    """``python -m tenplex_megatron.frontdoor.slurm torchrun ...``: a problem is one line and exit 2, nothing run;
    otherwise torchrun is exec'ed as given, its agent ignoring SIGTERM (unless restarts or signals are asked for)."""
    ran: list[tuple[str, list[str], dict[str, str]]] = []
    monkeypatch.setattr(os, "execvpe", lambda prog, argv, env: ran.append((prog, argv, env)))
    env = {**STEP, "SLURM_NNODES": "1", "SLURM_STEP_NUM_TASKS": "1"}
    assert slurm.main(["torchrun", "--nnodes", "2", "x.py"], env) == 2 and not ran
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{slurm.PROG}: error: torchrun --nnodes 2 disagrees with Slurm job"), err
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert slurm.main(["torchrun", "--nnodes", "1", "x.py", "--lr", "1"], env) == 0
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # kept across exec by the agent
    finally:
        signal.signal(signal.SIGTERM, before)
    prog, argv, got = ran[0]
    assert (prog, argv) == ("torchrun", ["torchrun", "--nnodes", "1", "x.py", "--lr", "1"])
    assert got["PET_SIGNALS_TO_HANDLE"] == "SIGINT,SIGHUP,SIGQUIT" and got[slurm.SIGTERM_ENV] == "1"
    assert slurm.leave_sigterm_to_workers(["--max-restarts", "3", "x.py"], {}) == {}  # its stop is a SIGTERM
    assert slurm.leave_sigterm_to_workers(["--signals-to-handle", "SIGTERM", "x.py"], {}) == {}
    assert slurm.main(["srun", "x"], env) == 2 and "usage:" in capsys.readouterr().err


def test_a_worker_takes_sigterms_default_back_from_an_agent_that_ignores_it(monkeypatch) -> None:
    before = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        monkeypatch.setenv(orphan.AGENT_IGNORES_SIGTERM, "1")
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
        orphan.die_with_agent()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL and orphan.AGENT_IGNORES_SIGTERM not in os.environ
    finally:
        signal.signal(signal.SIGTERM, before)
    assert orphan.AGENT_IGNORES_SIGTERM == slurm.SIGTERM_ENV


def _trainer_env(monkeypatch, **env: str) -> None:
    for k in [k for k in os.environ if k.startswith(("SLURM_", "TORCHELASTIC_", "GROUP_"))]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)


def test_the_trainer_refuses_at_start_in_one_line_what_the_allocation_cannot_run(monkeypatch) -> None:
    """pretrain_gpt.py's parse_args (before any process group): torchrun formed 1 node of a 2-node step; a requeue
    on 3 nodes that no layout of the global batch 8 fits, with the node counts that do; an explicit TP the world
    size does not divide; outside Slurm, the trainer's own refusal as before."""
    flags = [*TINY_GPT, "--vocab-size", "96", "--train-iters", "10", "--tenplex-layout", "auto"]
    _trainer_env(monkeypatch, **STEP, GROUP_WORLD_SIZE="1", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                 TORCHELASTIC_RUN_ID="none", TORCHELASTIC_RESTART_COUNT="0")
    with pytest.raises(SystemExit) as e:
        pretrain.parse_args(flags)
    assert str(e.value) == ("pretrain_gpt.py: error: torchrun formed 1 node(s) (--nnodes) but Slurm job 41 "
                            "(SLURM_NNODES=2, SLURM_JOB_NODELIST=n[1-2]) runs SLURM_NNODES=2 node(s), one torchrun "
                            'each: pass --nnodes "$SLURM_NNODES"')
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a later round of an elastic launch: not checked
    assert slurm.worker_problem(os.environ) is None
    three = {**STEP, "SLURM_NNODES": "3", "SLURM_STEP_NUM_TASKS": "3", "SLURM_RESTART_COUNT": "1",
             "GROUP_WORLD_SIZE": "3", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "1", "TORCHELASTIC_RESTART_COUNT": "0"}
    _trainer_env(monkeypatch, **three)
    with pytest.raises(SystemExit) as e:
        at = flags.index("--micro-batch-size")
        pretrain.parse_args(flags[:at] + flags[at + 2:])  # the layout choice's micro-batch sizes
    line = str(e.value)
    assert "\n" not in line and line.startswith("pretrain_gpt.py: error: --global-batch-size 8: no layout of Slurm "
                                                "job 41 (SLURM_NNODES=3, SLURM_JOB_NODELIST=n[1-2]) holds it at 1 "
                                                "process(es) per node (world size 3): "), line
    assert "DP=3 does not divide the global batch size 8" in line and line.endswith("node counts that hold it: "
                                                                                    "1, 2, 4, 8"), line
    args = Namespace(tenplex_layout=None, tensor_model_parallel_size=2, pipeline_model_parallel_size=None,
                     micro_batch_size=2, global_batch_size=8)
    assert "world size 3 is not divisible by --tensor-model-parallel-size x --pipeline-model-parallel-size = 2 x 1" \
        in slurm.batch_problem(three, args, layout_choice.choose_for)
    args.tensor_model_parallel_size = 1
    assert "DP=3 x --micro-batch-size 2 does not divide it" in slurm.batch_problem(three, args, None)
    assert slurm.batch_problem({**three, "WORLD_SIZE": "2", "SLURM_NNODES": "2"}, args, None) is None
    _trainer_env(monkeypatch, WORLD_SIZE="3", LOCAL_WORLD_SIZE="1")  # no Slurm: the layout choice refuses as before
    with pytest.raises(SystemExit) as e:
        pretrain.parse_args(flags)
    assert e.value.code == 2


def _env(job: str, restart: int = 0, **more: str) -> dict[str, str]:
    """A Slurm job's task as torchrun's worker sees it (a --standalone launch: a new run id every launch)."""
    return {"SLURM_JOB_ID": job, "SLURM_CLUSTER_NAME": "tenplex", "SLURM_RESTART_COUNT": str(restart),
            "TORCHELASTIC_RUN_ID": uuid.uuid4().hex, **more}


def test_a_slurm_jobs_identity_survives_its_requeues_and_no_two_jobs_share_one() -> None:
    """The same job after a requeue (same SLURM_JOB_ID, new SLURM_RESTART_COUNT), whatever torchrun's run id; every
    other job another: another id, an array's other task, another cluster's job of the same id. Outside Slurm,
    torchrun's run id as before."""
    first = job_identity.job_id(env=_env("41"))
    assert first == "slurm-41@tenplex" == job_identity.job_id(env=_env("41", restart=1))
    assert job_identity.job_id(env=_env("41", TORCHELASTIC_RUN_ID="copied-rdzv-id")) == first
    others = {job_identity.job_id(env=_env("42", TORCHELASTIC_RUN_ID="copied-rdzv-id")),
              job_identity.job_id(env=_env("43", SLURM_ARRAY_JOB_ID="41", SLURM_ARRAY_TASK_ID="2")),
              job_identity.job_id(env=_env("41", SLURM_CLUSTER_NAME="other"))}
    assert len(others) == 3 and first not in others
    het = [job_identity.job_id(env=_env(j, SLURM_HET_JOB_ID="50")) for j in ("50", "51")]
    assert het == ["slurm-50@tenplex"] * 2  # one heterogeneous job's components
    assert job_identity.job_id(env={"SLURM_JOB_ID": "7"}) == "slurm-7"
    assert job_identity.job_id(env={"TORCHELASTIC_RUN_ID": "rdzv"}) == "rdzv"


def _lease_of(directory: str, job: str, holder: str, age: float, ttl: float = 15.0) -> lease.Lease:
    """Generation 1 of ``directory``'s lease as a holder on another node wrote it ``age`` seconds ago."""
    held = lease.Lease(os.path.abspath(directory), job, 1, holder, "token", time.time() - age, ttl)
    os.makedirs(lease.lease_dir(directory), exist_ok=True)
    with open(held.path, "w") as f:
        json.dump(held.to_json(), f)
    return held


def _claim(save: str, monkeypatch, env: dict[str, str], leases: lease.LeaseSet) -> list[str]:
    """The trainer's start-up claim of ``--save`` in a task whose environment is ``env``."""
    _trainer_env(monkeypatch, **env)
    args = Namespace(tenplex=True, save=save, tenplex_memory=None, tenplex_job_id=None, tenplex_take_over=False,
                     tenplex_lease_ttl=15.0)
    return lease_flags.claim(JobConfig("pretrain_gpt.py", leases=LeaseConfig.from_args(args)), leases)


def test_a_requeued_job_takes_its_directory_back_at_once_and_another_job_is_refused(tmp_path, monkeypatch,
                                                                                   caplog) -> None:
    """A run of job 41 killed on node n2 a second ago left a live-looking lease: its requeue (SLURM_RESTART_COUNT 1)
    takes the next generation at once; job 42 is refused before any process group, naming the directory and job
    41; once the lease lapses (no heartbeat for the ttl: the allocation was lost), job 42 takes it over."""
    save = str(tmp_path / "ckpt")
    _lease_of(save, "slurm-41@tenplex", "n2:4242", age=1.0)
    with lease.LeaseSet() as leases, caplog.at_level(logging.WARNING, logger="tenplex_megatron"):
        assert _claim(save, monkeypatch, _env("41", restart=1), leases) == [save]
        assert lease.current(save).generation == 2 and lease.current(save).job == "slurm-41@tenplex"
        assert "took the lease over" not in caplog.text  # the same job
    other = str(tmp_path / "other")
    _lease_of(other, "slurm-41@tenplex", "n2:4242", age=1.0)
    with lease.LeaseSet() as leases, pytest.raises(SystemExit) as e:
        _claim(other, monkeypatch, _env("42"), leases)
    assert f"pretrain_gpt.py: error: {other} is held by job 'slurm-41@tenplex' (generation 1, holder n2:4242)" \
        in str(e.value) and "--tenplex-take-over" in str(e.value), e.value
    assert lease.current(other).generation == 1
    lost = str(tmp_path / "lost")
    _lease_of(lost, "slurm-41@tenplex", "n2:4242", age=16.0)  # no heartbeat for longer than its 15-s ttl
    with lease.LeaseSet() as leases, caplog.at_level(logging.WARNING, logger="tenplex_megatron"):
        assert _claim(lost, monkeypatch, _env("42"), leases) == [lost]
        assert lease.current(lost).job == "slurm-42@tenplex" and lease.current(lost).generation == 2
    assert f"{lost}: took the lease over from job 'slurm-41@tenplex'" in caplog.text
