"""Real DeepSpeed engines (tiny GPT-2, gloo): ZeRO-1/2/3 re-sharded to another DP size by tenplex.

Oracle: DeepSpeed's own route (``ds_to_universal`` then a universal load) at
the new DP size. The fp32 master weights and Adam moments tenplex loads must
equal exactly both that route's and the state at save time (read with
DeepSpeed's own ``safe_get_full_*`` accessors); the losses after the restart
must continue those of an uninterrupted run with the same global batch.

Launches are shared (each torchrun start with DeepSpeed imported costs 7-10 s): one ``train`` launch per
source DP size trains every (stage, dtype) variant in sequence, one Python process runs every
``ds_to_universal`` conversion, and one ``resume`` launch per destination DP size runs every case that
resumes there, each on fresh engines, writing each case's results to its own JSON (5 launches and 1
conversion process instead of 19 and 8). The PipelineModule cases share 3 launches and 1 conversion
(instead of 6 and 1): the PP2 training serves two cases. A session-scoped cache runs each launch once, on
first need, inside the first test that needs it; every test still asserts its own case, and a test whose
launch (or a launch that one depends on) failed fails with that launch's log.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

from tests.harness import CHILD_PYTHONPATH, ROOT, Run, torchrun

pytestmark = pytest.mark.dist
RUNNER = os.path.join(ROOT, "tests", "multiproc", "ds_run.py")
PIPE_RUNNER = os.path.join(ROOT, "tests", "multiproc", "ds_pipe_run.py")
CONVERT = os.path.join(ROOT, "tests", "multiproc", "ds_convert.py")
PER_JOB_TIMEOUT = 240  # seconds; a combined launch gets this per job it runs


class Launches:
    """Runs each shared launch once per session, on first need; a failure is kept and re-reported with its log."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._failed: dict[str, str | None] = {}  # launch name -> None (succeeded) or what to report

    def need(self, name: str, launch: Callable[[], Run]) -> None:
        """Run ``launch`` unless already run; fail the calling test if it (or a launch it needs) failed."""
        if name not in self._failed:
            try:
                run = launch()
            except Exception as e:  # noqa: BLE001 - reported to every test that needs this launch
                run = Run(1, f"{type(e).__name__}: {e}")
            self._failed[name] = None if run.returncode == 0 else \
                f"shared launch '{name}' failed (exit {run.returncode}):\n{run.log[-4000:]}"
        if self._failed[name] is not None:
            pytest.fail(self._failed[name], pytrace=False)


@pytest.fixture(scope="session")
def launches(tmp_path_factory: pytest.TempPathFactory) -> Launches:
    return Launches(str(tmp_path_factory.mktemp("deepspeed")))


def _convert(step_dirs: list[str]) -> Run:
    """``ds_to_universal`` on each ``global_stepN`` directory, all in one Python process."""
    p = subprocess.run([sys.executable, CONVERT, *step_dirs], capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=CHILD_PYTHONPATH), timeout=300 * len(step_dirs))
    return Run(p.returncode, p.stdout + p.stderr)


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _assert_same_state(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    bad = [k for k in want if not torch.equal(torch.tensor(got[k]), torch.tensor(want[k]))]
    assert not bad, f"{what}: {len(bad)} tensors differ, e.g. {bad[:3]}"


CASES = [
    (1, 2, 1, False), (1, 1, 2, False), (1, 2, 4, False),
    (2, 2, 1, False), (2, 1, 2, False), (2, 2, 4, False),
    (3, 2, 1, False), (3, 1, 2, False), (3, 2, 4, False),
    (1, 2, 1, True), (3, 2, 4, True),
]
TRAINED = sorted({(s, a, h) for s, a, _, h in CASES})  # (stage, source DP, bf16): one training each
BAD_INPUT_SOURCE = (2, 2, False)  # the checkpoint the bad-input loads start from, tried in the DP-1 resume launch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _zdir(root: str, stage: int, dp: int, bf16: bool) -> str:
    return os.path.join(root, f"z{stage}_dp{dp}{'_bf16' if bf16 else ''}")


def _zjob(root: str, stage: int, dp: int, bf16: bool) -> str:
    return json.dumps({"stage": stage, "bf16": bf16, "dir": _zdir(root, stage, dp, bf16)})


def _zero_trained(lx: Launches, src: int) -> None:
    """One launch at ``src`` ranks trains every (stage, dtype) variant trained at that DP size."""
    variants = [(s, h) for s, a, h in TRAINED if a == src]

    def launch() -> Run:
        jobs = []
        for s, h in variants:
            os.makedirs(_zdir(lx.root, s, src, h))
            jobs += ["--job", _zjob(lx.root, s, src, h)]
        return torchrun(src, ["train", *jobs], script=RUNNER, timeout=PER_JOB_TIMEOUT * len(variants))

    lx.need(f"ZeRO train at DP {src}", launch)


def _zero_universal(lx: Launches) -> None:
    """DeepSpeed's offline conversion of every trained ZeRO checkpoint, in one process."""
    def launch() -> Run:
        for src in sorted({a for _, a, _ in TRAINED}):
            _zero_trained(lx, src)
        return _convert([os.path.join(_zdir(lx.root, s, a, h), "d", "global_step3") for s, a, h in TRAINED])

    lx.need("ds_to_universal of the ZeRO checkpoints", launch)


def _zero_resumed(lx: Launches, dst: int) -> None:
    """One launch at ``dst`` ranks resumes every case that resumes at that DP size (and, at DP 1, the bad inputs)."""
    cases = [c for c in CASES if c[2] == dst]

    def launch() -> Run:
        _zero_universal(lx)
        jobs = [a for s, src, _, h in cases for a in ("--job", _zjob(lx.root, s, src, h))]
        bad = ["--bad", _zjob(lx.root, *BAD_INPUT_SOURCE)] if dst == 1 else []
        # DP 1: a plain torchrun launch without --rdzv-id (run id none, static rendezvous on its own port), as the
        # lease cases of --bad need: the launch's identity is then the token in its agent's store
        rdzv = ["--master-port", str(_free_port())] if bad else ["--standalone"]
        return torchrun(dst, ["resume", "--universal", *jobs, *bad], script=RUNNER,
                        timeout=PER_JOB_TIMEOUT * (len(cases) + len(bad) // 2), rdzv=rdzv)

    lx.need(f"ZeRO resume at DP {dst}", launch)


# the resumes at DP 4 (their own 4-rank launch) run in make test-bench: make test keeps DP 2 -> 1 and 1 -> 2
@pytest.mark.parametrize("stage,src,dst,bf16", [pytest.param(*c, marks=pytest.mark.slow) if c[2] == 4 else c
                                                 for c in CASES],
                         ids=[f"zero{s}-dp{a}to{b}{'-bf16' if h else ''}" for s, a, b, h in CASES])
def test_zero_reshard_equals_deepspeed_universal_route(launches, stage, src, dst, bf16) -> None:
    _zero_resumed(launches, dst)
    d = _zdir(launches.root, stage, src, bf16)
    a, b = _load(f"{d}/a.json"), _load(f"{d}/b{dst}.json")
    assert b["tenplex_load"]["global_steps"] == 3
    assert b["tenplex_load"]["source"] == {"tp": 1, "pp": 1, "dp": src, "zero_stage": stage}
    assert b["tenplex_load"]["layout"] == f"dp={src},zero={stage}"  # LoadResult.layout: a DeepSpeedLayout
    assert b["tenplex_load"]["extra"] == {"note": "ds"}  # the client_state saved, as LoadResult.extra
    assert b["native_load"]["layout"] == f"dp={src},zero={stage}"
    _assert_same_state(b["state"]["tenplex"], a["state"], "tenplex load vs the state at save")
    _assert_same_state(b["state"]["tenplex"], b["state"]["universal"], "tenplex load vs ds_to_universal + load")
    assert b["native_load"]["native"] and b["native_load"]["global_steps"] == 3
    assert b["native_load"]["source"]["dp"] == src
    _assert_same_state(b["state"]["native"], b["state"]["universal"], "DeepSpeed files read directly vs universal")
    tol = 1e-3 if bf16 else 2e-6  # fp32: only the reduction order changes; bf16: bf16 gradients (seen: <2e-5)
    assert b["losses"]["4"] == pytest.approx(b["universal_next_loss"], rel=tol)
    assert b["native_next_loss"] == b["universal_next_loss"]  # same state, same DP size: bit-identical step
    for step in ("4", "5", "6"):
        assert b["losses"][step] == pytest.approx(a["losses"][step], rel=tol), (step, a["losses"], b["losses"])


def test_bad_deepspeed_checkpoints_fail_naming_the_file_or_parameter(launches) -> None:
    """A missing rank file, a pickle naming a foreign class, another model's checkpoint (DeepSpeed's own files
    and tenplex's): each fails with an error naming the file or parameter, and the engine is left untouched.
    Then the DeepSpeed front door's cluster safety, in a plain torchrun launch without --rdzv-id: another job's
    lease refuses a save, a new round of the same launch takes the next generation at once, a damaged newest
    checkpoint falls back."""
    _zero_resumed(launches, 1)
    r = _load(os.path.join(_zdir(launches.root, *BAD_INPUT_SOURCE), "bad1.json"))
    assert f"{r['step_file']}: missing (the checkpoint was written by 2 DP ranks)" in r["missing_rank_file"]
    assert r["hostile_file"] in r["foreign_pickle"] and "NotDeepSpeed" in r["foreign_pickle"]
    assert "trust_pickles=True" in r["foreign_pickle"]
    for key in ("other_model_native", "other_model_tenplex"):
        assert "parameter 'transformer.h.0.attn.c_attn.bias' has shape [96] in the checkpoint, [48] in the engine" \
            in r[key], r[key]
    assert r["untouched"] == "True"
    # one writer per directory: another live job's lease refuses the save, naming the directory and the holder
    leased = os.path.join(_zdir(launches.root, *BAD_INPUT_SOURCE), "bad1", "leased")
    assert "LeaseError" in r["other_job"] and f"{leased} is held by job 'another-job'" in r["other_job"], r["other_job"]
    assert "take_over=True" in r["other_job"], r["other_job"]  # the API's argument, not the trainers' flag
    assert json.loads(r["leased_entries"]) == ["tenplex-lease"]  # nothing written but the other job's lease
    # a new round of this same launch (its token in the agent's store) takes the next generation at once, while the
    # holder of the previous one still lives
    assert r["launch_job"].startswith("torchrun-"), r["launch_job"]
    assert json.loads(r["same_job"]) == {"before": [r["launch_job"], 1], "after": [r["launch_job"], 2]}, r["same_job"]
    # a damaged newest checkpoint: the previous complete one is loaded instead
    assert r["newest"].endswith("iter_0000004") and r["loaded"].endswith("iter_0000003"), r
    assert r["loaded_iteration"] == "3"
    # iteration 4 saved again from there, its metadata.json truncated: skipped with the warning (before: silently)
    assert r["metadata_newest"].endswith("iter_0000004") and r["metadata_loaded"].endswith("iter_0000003"), r
    skipped = json.loads(r["metadata_skipped"])  # the warnings of the launch's one rank
    assert len(skipped) == 1 and "iter_0000004: metadata.json: malformed JSON" in skipped[0], skipped


# PipelineModule: (PP, ranks) before and after. The PP2 training (with DeepSpeed's own checkpoint, converted
# for the first case's universal route) serves the first two cases; the 1-rank launch trains PP1 and resumes
# the first case; the 2-rank launch resumes the other two.
PIPE_CASES = {"pp2-to-pp1": ((2, 2), (1, 1)), "pp2-to-pp1xdp2": ((2, 2), (1, 2)), "pp1-to-pp2": ((1, 1), (2, 2))}


def _pjob(**job: object) -> list[str]:
    return ["--job", json.dumps(job)]


def _pipe_dir(lx: Launches, name: str) -> str:
    return os.path.join(lx.root, "pipe", name)


def _pipe_launches(lx: Launches, ranks: int) -> None:
    """The pipeline launches the results at ``ranks`` ranks need, each run once."""
    train = {pp: _pipe_dir(lx, f"train_pp{pp}") for pp in (1, 2)}

    def train_pp2() -> Run:
        return torchrun(2, _pjob(mode="train", pp=2, dir=train[2], ds=True), script=PIPE_RUNNER,
                        timeout=PER_JOB_TIMEOUT)

    def convert() -> Run:
        lx.need("pipeline train at PP2 (2 ranks)", train_pp2)
        return _convert([os.path.join(train[2], "ds", "global_step3")])

    def one_rank() -> Run:
        lx.need("ds_to_universal of the pipeline checkpoint", convert)
        jobs = [*_pjob(mode="train", pp=1, dir=train[1]),
                *_pjob(mode="resume", pp=1, dir=_pipe_dir(lx, "pp2-to-pp1"), src=train[2], universal=True)]
        return torchrun(1, jobs, script=PIPE_RUNNER, timeout=2 * PER_JOB_TIMEOUT)

    def two_ranks() -> Run:
        lx.need("pipeline launch at 1 rank", one_rank)
        jobs = [*_pjob(mode="resume", pp=1, dir=_pipe_dir(lx, "pp2-to-pp1xdp2"), src=train[2]),
                *_pjob(mode="resume", pp=2, dir=_pipe_dir(lx, "pp1-to-pp2"), src=train[1])]
        return torchrun(2, jobs, script=PIPE_RUNNER, timeout=2 * PER_JOB_TIMEOUT)

    if ranks == 1:
        lx.need("pipeline launch at 1 rank", one_rank)
    else:
        lx.need("pipeline launch at 2 ranks", two_ranks)


def _stage_dumps(out: str, nproc: int) -> list[dict]:
    return [_load(f"{out}.rank{r}.json") for r in range(nproc)]


@pytest.mark.parametrize("case", list(PIPE_CASES))
def test_pipeline_module_reshard_to_another_pp_size(launches, case) -> None:
    """PipelineModule with a tied embedding (ZeRO-1): every stage's fp32 master and Adam moments after the load
    equal those at save time (a tied module's copy is taken from its lowest stage), and losses continue.
    At PP2->PP1 DeepSpeed's own route is run too: it agrees everywhere except on the tied module's untied
    parameter (the position embedding), which it takes from the last stage's drifted, unused copy."""
    (spp, sn), (dpp, dn) = PIPE_CASES[case]
    _pipe_launches(launches, dn)
    a_out = os.path.join(_pipe_dir(launches, f"train_pp{spp}"), "a.json")
    b_out = os.path.join(_pipe_dir(launches, case), "b.json")
    universal = spp == 2 and dn == 1
    want: dict = {}
    for d in sorted(_stage_dumps(a_out, sn), key=lambda d: d["stage"]):
        for k, v in d.items():
            want.setdefault(k, v)
    for d in _stage_dumps(b_out, dn):
        got = {k: v for k, v in d.items() if k != "stage" and not k.startswith("lp.")}
        assert got, "a stage with no parameters"
        bad = [k for k in got if got[k] != want[k]]
        assert not bad, f"stage {d['stage']}: {len(bad)} tensors differ from the state at save, e.g. {bad[:3]}"
    a, b = _load(a_out), _load(b_out)
    assert b["load"] == {"global_steps": 3, "source": {"tp": 1, "pp": spp, "dp": sn // spp, "zero_stage": 1}}
    for step in ("4", "5", "6"):
        assert b["losses"][step] == pytest.approx(a["losses"][step], rel=2e-6), (step, a["losses"], b["losses"])
    if universal:
        ours, theirs = _load(f"{b_out}.rank0.json"), _load(f"{b_out}.univ.rank0.json")
        differ = sorted(k for k in ours if k != "stage" and ours[k] != theirs[k])
        assert all(".wpe." in k for k in differ), differ  # everything else: bit for bit DeepSpeed's route
        assert "fp32.tied_modules.embed.wte.weight" not in differ
