"""The one in-place runner of planned re-forms (frontdoor/reform_runner.py) and Megatron-LM's side of it
(frontdoor/megatron_lm_reform.py), on real torch stores: a newcomer whose model or batch flags differ from the
running job's is refused before it registers (one line naming each difference; the job sees no change), one whose
flags match registers; Megatron-LM's re-form is refused where it cannot restore (no --tenplex-memory, no --load) or
where NVRx's in-process restart is asked for too; core_v0.18+'s per-call config is made at once unless re-forming."""

from __future__ import annotations

from argparse import Namespace

import pytest
import torch.distributed as dist

from tenplex_megatron.frontdoor import megatron_lm_reform, reform_runner
from tenplex_megatron.frontdoor.inprocess import STORE_ENV
from tenplex_megatron.frontdoor.membership import REFORM_ENV, Membership

JOB = Namespace(hidden_size=64, num_layers=2, global_batch_size=8, lr=1e-3)
NAMES = ("hidden_size", "num_layers", "global_batch_size", "lr")


def started(monkeypatch: pytest.MonkeyPatch) -> tuple[Membership, object]:
    """A job of one initial rank that published its flags (generation 0)."""
    m = Membership(dist.HashStore(), timeout=5)
    monkeypatch.setenv(REFORM_ENV, "run")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    gen = reform_runner.first_generation(m, "h:0", reform_runner.job_flags(JOB, NAMES))
    assert gen is not None and gen.members == ("h:0",)
    monkeypatch.setenv(REFORM_ENV, "join")
    return m, gen


def test_a_newcomer_with_other_model_or_batch_flags_is_refused_before_it_registers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    m, gen = started(monkeypatch)
    mine = reform_runner.job_flags(Namespace(**{**vars(JOB), "hidden_size": 128, "global_batch_size": 16}), NAMES)
    with pytest.raises(SystemExit) as e:
        reform_runner.first_generation(m, "h:9", mine, "pretrain_gpt.py")
    msg = str(e.value.code)
    assert "\n" not in msg and msg.startswith("pretrain_gpt.py: error: --join:")
    assert "--global-batch-size 16 (the job's: 8); --hidden-size 128 (the job's: 64)" in msg, msg
    assert "--num-layers" not in msg and "--lr" not in msg
    assert not m.pending(gen)  # the running job sees no registration


def test_a_newcomer_with_the_jobs_flags_registers(monkeypatch: pytest.MonkeyPatch) -> None:
    m, gen = started(monkeypatch)
    m.end()  # the job is over before admitting it: the newcomer's wait returns
    assert reform_runner.first_generation(m, "h:9", reform_runner.job_flags(JOB, NAMES)) is None
    assert m.pending(gen)  # registered


def test_job_flags_are_named_as_flags_and_compare_as_stored() -> None:
    flags = reform_runner.job_flags(Namespace(a_b=(1, 2), c=None), ("a_b", "c"))
    assert flags == {"--a-b": [1, 2], "--c": None}
    assert reform_runner.differences(flags, reform_runner.job_flags(Namespace(a_b=[1, 2], c=None), ("a_b", "c"))) == []


def test_megatron_lm_re_form_refusals_name_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    ok = Namespace(tenplex=True, tenplex_memory="/m", load="/c", inprocess_restart=False)
    monkeypatch.delenv(STORE_ENV, raising=False)
    assert "--reform" in (megatron_lm_reform.refusal(ok, []) or "")
    monkeypatch.setenv(STORE_ENV, "127.0.0.1:1")
    assert megatron_lm_reform.refusal(ok, []) is None
    assert "--tenplex-memory" in (megatron_lm_reform.refusal(Namespace(**{**vars(ok), "tenplex_memory": None}), [])
                                  or "")
    assert "--load" in (megatron_lm_reform.refusal(Namespace(**{**vars(ok), "load": None}), []) or "")
    assert "give one" in (megatron_lm_reform.refusal(ok, ["--inprocess-restart"]) or "")


def test_the_per_call_config_is_made_at_once_unless_re_forming(monkeypatch: pytest.MonkeyPatch) -> None:
    made = []

    def make() -> int:
        made.append(1)
        return len(made)

    monkeypatch.delenv(REFORM_ENV, raising=False)
    assert megatron_lm_reform.per_call(make) == 1
    monkeypatch.setenv(REFORM_ENV, "run")
    lazy = megatron_lm_reform.per_call(make)
    assert isinstance(lazy, megatron_lm_reform.PerCall) and len(made) == 1
    assert lazy.make() == 2
