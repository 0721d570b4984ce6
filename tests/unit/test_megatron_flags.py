"""Every flag of Megatron-LM's ``pretrain_gpt.py`` (the snapshot of core_v0.15-0.19's parsers,
``plan/megatron_flags_snapshot.json``) is classified by ``plan/megatron_flags.py``: neutral, honoured, refused or of
no effect; each refused flag is refused by the hook's start check, naming it; a flag of no effect given on the
command line is said so in one line at start. On an unclassified flag: add it to a group or a refusal of
``plan/megatron_flags.py`` / ``plan/megatron_flags_neutral.py``, with why."""

from __future__ import annotations

import argparse
import logging
import sys
from types import SimpleNamespace

import pytest

from tenplex_megatron.plan import megatron_ckpt_flags as ckpt
from tenplex_megatron.plan import megatron_flag_snapshot as snap
from tenplex_megatron.plan import megatron_flags as flags
from tenplex_megatron.plan.megatron_flags_neutral import NEUTRAL_GROUPS, RULES
from tenplex_megatron.plan.unsupported import UNSUPPORTED

SNAPSHOT = snap.read()
LINES = ("core_v0.15", "core_v0.16", "core_v0.17", "core_v0.18", "core_v0.19")


def test_the_snapshot_holds_every_supported_line_read_from_the_parser() -> None:
    assert tuple(x.name for x in SNAPSHOT.lines) == LINES
    for line in SNAPSHOT.lines:
        assert line.read_by == "import", f"{line.name}: read with ast, the dataclass-made flags are missing"
        assert line.tag and line.tag.startswith(line.name + "."), line.tag
        assert len(line.flags) > 500 and "tensor_model_parallel_size" in line.dests(), line.name
        assert {f.source for f in line.flags} == set(snap.SOURCES), line.name
    assert snap.from_json(__import__("json").loads(snap.to_json(SNAPSHOT))) == SNAPSHOT  # the file round-trips


@pytest.mark.parametrize("name", LINES)
def test_every_flag_of_the_line_is_classified(name: str) -> None:
    line = SNAPSHOT.line(name)
    missing = flags.unclassified(line.dests())
    assert missing == [], (f"{name} ({line.tag}): flags neither neutral, honoured, refused nor of no effect under "
                           f"--tenplex: {missing}; classify each in plan/megatron_flags.py or megatron_flags_neutral.py")
    counts = flags.counts(line)
    assert counts["unclassified"] == 0 and sum(counts.values()) == len(line.flags)
    assert all(counts[v] > 0 for v in flags.VERDICTS), counts


def test_a_new_flag_is_caught() -> None:
    assert flags.unclassified(["num_layers", "a_flag_of_core_v0_20"]) == ["a_flag_of_core_v0_20"]
    assert flags.classify("inference_new_knob").verdict == flags.NEUTRAL  # a rule's family
    assert flags.classify("log_a_new_metric") is None  # no rule for logging: each such flag is listed


def test_each_fact_has_one_place_and_every_row_is_a_flag_of_some_line() -> None:
    assert flags.duplicates() == []
    every = set(SNAPSHOT.options())
    for v in flags.EXPLICIT.values():
        assert v.verdict in flags.VERDICTS and v.why.strip(), v
        if v.table != "plan/megatron_ckpt_flags.py":  # its CheckpointConfig fields without a flag are checked there
            assert v.dest in every, f"{v.table} lists {v.dest}, a flag of no release line"
    for rule in RULES:  # each rule covers something, and no listed neutral flag duplicates a rule
        assert any(d.startswith(rule.prefix) and d not in flags.EXPLICIT for d in every), rule.prefix
    listed = {d for g in NEUTRAL_GROUPS for d in g.dests}
    assert not [d for d in listed if any(d.startswith(r.prefix) for r in RULES)]
    assert len(RULES) <= 10  # families sparingly


def _refused_value(dest: str) -> object:
    """A value of ``dest`` that --tenplex refuses: past plan/unsupported.py's number that means off, else True (no
    table accepts True: a switch turned on, or a value of the wrong type for the others)."""
    off = {attr: o for attr, o, _, _ in UNSUPPORTED}.get(dest)
    return off + 1 if type(off) is int else True


def test_every_refused_flag_is_refused_by_the_hooks_start_check() -> None:
    from tenplex_megatron.frontdoor import megatron_lm

    rows = flags.refused(SNAPSHOT)
    assert len(rows) >= 45
    for verdict, options, lines in rows:
        args = argparse.Namespace(tenplex=True, load=None, **{verdict.dest: _refused_value(verdict.dest)})
        problems, _ = megatron_lm.start_check(args, [])
        assert any(p.startswith(options) for p in problems), (verdict.dest, options, problems)
        assert lines, verdict.dest
        off = argparse.Namespace(tenplex=False, **{verdict.dest: _refused_value(verdict.dest)})
        assert megatron_lm.start_check(off, []) == ([], [])  # without --tenplex nothing is checked


def test_megatron_lms_defaults_are_refused_nothing() -> None:
    assert flags.refusals(argparse.Namespace()) == []
    assert flags.refusals(argparse.Namespace(**{r.dest: r.accepted[0] for r in flags.REFUSALS})) == []
    assert flags.refusals({r.dest: r.accepted[-1] for r in flags.REFUSALS}) == []


@pytest.mark.parametrize("given,line", [
    ({"decrease_batch_size_if_needed": True}, "--decrease-batch-size-if-needed: a global batch shrunk"),
    ({"optimizer": "sgd"}, "--optimizer sgd: tenplex describes and re-shards Adam's state"),
    ({"exp_avg_dtype": "bf16"}, "--exp-avg-dtype bf16: the precision-aware optimizer is Transformer Engine's "
                                "FusedAdam"),
    ({"optimizer_cpu_offload": True}, "--optimizer-cpu-offload: the optimizer's state offloaded"),
    ({"multi_latent_attention": True}, "--multi-latent-attention: multi-latent attention's"),
    ({"mtp_num_layers": 1}, "--mtp-num-layers 1: multi-token prediction layers"),
    ({"fp8_param_gather": True}, "--fp8-param-gather: parameters kept quantized"),
])
def test_a_refusal_names_the_flag_its_value_and_why(given: dict, line: str) -> None:
    got = flags.refusals(SimpleNamespace(**given))
    assert len(got) == 1 and got[0].startswith(line), got
    assert "it would take" in got[0] or "refuses" in got[0] or "replaces" in got[0] or "incomplete" in got[0]


def test_the_hook_stops_on_a_new_refusal_before_megatron_lm_checks_anything(caplog) -> None:
    from tenplex_megatron.frontdoor import megatron_lm

    args = argparse.Namespace(tenplex=True, load=None, decrease_batch_size_if_needed=True)
    with caplog.at_level("ERROR", logger="tenplex_megatron"), pytest.raises(SystemExit) as e:
        megatron_lm._validate_args(args)
    assert e.value.code == 2
    assert "pretrain_gpt.py: with --tenplex, --decrease-batch-size-if-needed: " in caplog.text


def test_a_flag_of_no_effect_given_is_named_once_with_why() -> None:
    argv = ["--save", "ckpt", "--ckpt-format", "torch_dist", "--dist-ckpt-strictness=log_all",
            "--disable-ckpt-fully-parallel-save", "--ckpt-fully-parallel-load", "--ckpt-formatx"]
    got = flags.no_effect_given(argv)
    assert sorted(g.split(" has no effect under --tenplex: ")[0] for g in got) == [
        "--ckpt-format", "--ckpt-fully-parallel-load", "--disable-ckpt-fully-parallel-save", "--dist-ckpt-strictness"]
    assert got[0] == f"--ckpt-format has no effect under --tenplex: {ckpt.BY_NAME['ckpt_format'].why}"
    assert flags.no_effect_given(["--save", "x", "--no-load-optim", "--tensor-model-parallel-size", "2"]) == []
    # without the snapshot's aliases: the table's own flag
    assert flags.no_effect_given(["--disable-ckpt-fully-parallel-save"], options={}) == []
    assert len(flags.no_effect_given(["--no-ckpt-fully-parallel-save"], options={})) == 1


class _Hook:
    in_place = None
    originals = {"validate_args": lambda args, *a, **kw: "validated"}


def test_the_hook_says_it_at_start_only_for_flags_given_and_only_with_tenplex(monkeypatch, caplog) -> None:
    from tenplex_megatron.frontdoor import megatron_lm

    monkeypatch.setattr(megatron_lm, "installed", lambda: _Hook())
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--tenplex", "--ckpt-format", "torch_dist"])
    args = argparse.Namespace(tenplex=True, load=None, ckpt_format="torch_dist", dist_ckpt_strictness="log_all")
    with caplog.at_level(logging.INFO, logger="tenplex_megatron"):
        assert megatron_lm._validate_args(args) == "validated"
    lines = [r.getMessage() for r in caplog.records if "has no effect" in r.getMessage()]
    assert lines == [f"pretrain_gpt.py: --ckpt-format has no effect under --tenplex: {ckpt.BY_NAME['ckpt_format'].why}"]
    assert all(r.levelno == logging.INFO for r in caplog.records if "has no effect" in r.getMessage())
    caplog.clear()
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--ckpt-format", "torch"])
    with caplog.at_level(logging.INFO, logger="tenplex_megatron"):
        assert megatron_lm._validate_args(argparse.Namespace(tenplex=False, ckpt_format="torch")) == "validated"
    assert "has no effect" not in caplog.text


def test_a_snapshot_of_another_kind_or_version_is_named() -> None:
    doc = __import__("json").loads(snap.to_json(SNAPSHOT))
    with pytest.raises(snap.FlagSnapshotError, match="version 2, this build reads 1"):
        snap.from_json(dict(doc, version=2), "x.json")
    with pytest.raises(snap.FlagSnapshotError, match="not a Megatron-LM flag snapshot"):
        snap.from_json({"format": "other"}, "x.json")
    with pytest.raises(snap.FlagSnapshotError, match="no release line core_v0.14"):
        SNAPSHOT.line("core_v0.14")
