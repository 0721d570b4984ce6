"""Megatron-LM's uneven pipeline flags at start, before anything is built: the reference trainer and the Megatron-LM
hook refuse a split that does not fit PP in one line naming the flags and numbers, ``--tenplex-layout`` (auto or a
table) chooses only a PP x VPP the split fits, and the hook's classification lets them through."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tenplex_megatron.frontdoor.megatron_lm import choose_layout_for_args, start_check
from tenplex_megatron.plan import megatron_flags
from tenplex_megatron.plan.pipeline_split import SplitRule
from tenplex_megatron.storage.megatron_ptc import _refuse_uneven
from tenplex_megatron.storage.megatron_torch_dist import MegatronCheckpointError
from tenplex_megatron.training.pretrain import parse_args
from tests.harness import TINY_GPT
from tests.unit.test_layout_choice import _megatron_args

BASE = [*TINY_GPT, "--vocab-size", "96", "--train-iters", "2", "--num-layers", "4"]
FIRST = "--decoder-first-pipeline-num-layers"


@pytest.mark.parametrize("flags,needles", [
    (["--pipeline-model-parallel-size", "2", FIRST, "4"],
     [f"{FIRST} 4 at --num-layers 4, PP 2", "0 layers are left for the 1 pipeline ranks"]),
    (["--pipeline-model-parallel-size", "4", FIRST, "2"],
     [f"{FIRST} 2", "the 2 layers left do not split evenly over the 3 pipeline ranks"]),
    (["--pipeline-model-parallel-size", "2", "--account-for-embedding-in-pipeline-split"],
     ["PP 2 does not divide --num-layers 4", "5 counted"]),
    (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et|t|tL"],
     ["has 3 stages: --pipeline-model-parallel-size 2 must divide them"]),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1", FIRST, "2"],
     ["--num-virtual-stages-per-pipeline-rank"]),
])
def test_the_trainer_refuses_a_split_that_does_not_fit(flags: list[str], needles: list[str], capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args([*BASE, *flags])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    for needle in needles:
        assert needle in err, (needle, err)


def test_the_trainer_records_the_split() -> None:
    assert parse_args([*BASE, "--pipeline-model-parallel-size", "2", FIRST, "3"]).pipeline_split == (3, 1)
    assert parse_args([*BASE, "--pipeline-model-parallel-size", "2", FIRST, "2"]).pipeline_split == ()  # even
    args = parse_args([*BASE, "--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "E|tt|t|tL"])
    assert (args.virtual_pipeline_model_parallel_size, args.pipeline_split) == (2, (0, 2, 1, 1))


def test_the_hook_lets_the_flags_through_and_refuses_a_misfit_in_one_line() -> None:
    assert not megatron_flags.refusals({"decoder_first_pipeline_num_layers": 3,
                                        "pipeline_model_parallel_layout": "Et|tL"})
    ok = _megatron_args(tenplex=True, tenplex_layout=None, num_layers=4, pipeline_model_parallel_size=2,
                        decoder_first_pipeline_num_layers=3)
    assert not [p for p in start_check(ok, [])[0] if "pipeline" in p]
    bad = _megatron_args(tenplex=True, tenplex_layout=None, num_layers=4, pipeline_model_parallel_size=4,
                         decoder_first_pipeline_num_layers=2, decoder_last_pipeline_num_layers=1)
    problems = [p for p in start_check(bad, [])[0] if "pipeline" in p]
    assert problems == [f"{FIRST} 2 --decoder-last-pipeline-num-layers 1 at --num-layers 4, PP 4: the 1 layers left "
                        "do not split evenly over the 2 pipeline ranks between the first and last"]


def test_auto_and_a_table_keep_to_the_split(tmp_path, monkeypatch, capsys) -> None:
    """4 layers, the first rank 3 of them, on 2 ranks: PP1 (3 layers left over) and TP2 are refused, PP2 chosen."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    args = _megatron_args(num_layers=4, decoder_first_pipeline_num_layers=3)
    chosen = choose_layout_for_args(args, [])
    assert chosen.layout.pp == 2 and args.pipeline_model_parallel_size == 2
    SplitRule(first=3).counts(4, chosen.layout.pp, chosen.layout.vpp)  # fits
    trainer = parse_args([*BASE, FIRST, "3", "--tenplex-layout", "auto"])
    assert (trainer.pipeline_model_parallel_size, trainer.pipeline_split) == (2, (3, 1))
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"version": 1, "layouts": {"2": {"tp": 1, "pp": 1, "dp": 2, "micro_batch_size": 2}}}))
    with pytest.raises(SystemExit):
        parse_args([*BASE, FIRST, "3", "--tenplex-layout", str(table)])
    out = capsys.readouterr()
    assert f"the row for world size 2 (tp=1,pp=1,dp=2): {FIRST} 3 at --num-layers 4, PP 1" in out.out + out.err


def test_megatron_own_checkpoint_at_an_uneven_split_is_refused_naming_the_flags() -> None:
    """Adopting Megatron's own torch_dist checkpoint saved with uneven stages is refused (its optimizer buffers per
    stage have not been read at a split); at PP1 or an even split nothing is said."""
    ck = SimpleNamespace(path="ckpt/iter_0000003")
    with pytest.raises(MegatronCheckpointError, match="ckpt/iter_0000003: saved with uneven pipeline stages "
                                                      r"\(--decoder-first-pipeline-num-layers 3\)"):
        _refuse_uneven(ck, {"decoder_first_pipeline_num_layers": 3}, 2)
    _refuse_uneven(ck, {"decoder_first_pipeline_num_layers": 3}, 1)
    _refuse_uneven(ck, SimpleNamespace(decoder_first_pipeline_num_layers=None), 2)
