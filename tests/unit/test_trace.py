"""Elastic-benchmark traces (plan/trace.py, configs/traces/): the shipped traces, and errors naming line and column."""

from __future__ import annotations

import glob
import json
import os
import re

import pytest

from tenplex_megatron.plan.trace import TraceError, load_trace, parse_trace

TRACES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs", "traces")


def _at(text: str, needle: str) -> str:
    """line:column of the first occurrence of ``needle``, computed here independently of the parser."""
    off = text.index(needle)
    return f"{text.count(chr(10), 0, off) + 1}:{off - text.rfind(chr(10), 0, off)}"


def test_every_shipped_trace_parses_and_fits_a_cpu_machine() -> None:
    paths = sorted(glob.glob(os.path.join(TRACES, "*.json")))
    assert {os.path.basename(p) for p in paths} >= {"shrink_grow.json", "tenplex_gpt3xl.json"}
    for p in paths:
        trace = load_trace(p)
        assert trace.name == os.path.splitext(os.path.basename(p))[0]
        assert trace.events[0].t == 0 and trace.max_gpus <= 4, p
    for p in sorted(glob.glob(os.path.join(TRACES, "sim", "*.json"))):  # for the simulator only: any size
        assert load_trace(p).events[0].t == 0, p


def test_shrink_grow_is_4_2_4() -> None:
    trace = load_trace(os.path.join(TRACES, "shrink_grow.json"))
    assert [e.gpus for e in trace.events] == [4, 2, 4]
    assert [trace.gpus_at(t) for t in (0, 59.9, 60, 119, 120, 10_000)] == [4, 4, 2, 2, 4, 4]


def test_tenplex_trace_has_the_papers_shape_scaled_down() -> None:
    """Tenplex's schedule: 16, 8, 4, 8 GPUs four times over, 35 minutes each, the last phase 13 minutes (538 in all)."""
    trace = load_trace(os.path.join(TRACES, "tenplex_gpt3xl.json"))
    assert [e.nodes for e in trace.events] == [16 // 4, 8 // 4, 4 // 4, 8 // 4] * 4
    assert [e.t for e in trace.events] == [35.0 * i for i in range(16)]
    assert trace.end == 15 * 35 + 13
    assert all(e.gpus == e.nodes * trace.gpus_per_node for e in trace.events)


def test_nodes_become_gpus() -> None:
    trace = parse_trace('{"version": 1, "gpus_per_node": 2, "events": [{"t": 0, "nodes": 2}, {"t": 5, "gpus": 2}]}', "x")
    assert [(e.gpus, e.nodes) for e in trace.events] == [(4, 2), (2, 1)]


def test_a_file_that_does_not_parse_names_line_and_column(tmp_path) -> None:
    path = tmp_path / "broken.json"
    text = '{"version": 1,\n "events": [\n  {"t": 0, "gpus": 4},\n  {"t": 10 "gpus": 2}\n ]\n}\n'
    path.write_text(text)
    with pytest.raises(TraceError) as e:
        load_trace(str(path))
    try:
        json.loads(text)
    except json.JSONDecodeError as j:
        assert (j.lineno, j.colno) == (4, 12)
    assert str(e.value).startswith(f"{path}:4:12: not valid JSON: Expecting ',' delimiter")


EVENTS = '{"version": 1, "gpus_per_node": 2,\n "events": [\n  {"t": 0, "gpus": 4},\n  EVENT\n ]\n}'


@pytest.mark.parametrize("event, needle, expected", [
    ('{"t": 10, "gpus": -2}', "-2", "event 1: gpus must be a positive integer, got -2"),
    ('{"t": 10, "gpus": 3}', "3}", "event 1: 3 GPUs is not a whole number of nodes of 2"),
    ('{"t": 10, "nodes": 1.5}', "1.5", "event 1: nodes must be a positive integer, got 1.5"),
    ('{"t": 10, "gpus": 2, "nodes": 1}', '{"t": 10', "event 1: give exactly one of gpus and nodes"),
    ('{"t": 10}', '{"t": 10', "event 1: give exactly one of gpus and nodes"),
    ('{"t": "soon", "gpus": 2}', '"soon"', "event 1: t must be a number of seconds >= 0, got 'soon'"),
    ('{"t": 0, "gpus": 2}', '0, "gpus": 2', "event 1: t=0 is not after the previous event's t=0.0"),
    ('{"t": 10, "gpu": 2}', "2}", "event 1: unknown field 'gpu'"),
    ('[10, 2]', "[10", "event 1: expected an object"),
])
def test_a_malformed_event_names_its_line_and_column(event: str, needle: str, expected: str) -> None:
    text = EVENTS.replace("EVENT", event)
    with pytest.raises(TraceError) as e:
        parse_trace(text, "t.json")
    line4 = text.index(event)
    at = _at(text[line4:], needle)
    assert at.startswith("1:")
    assert str(e.value).startswith(f"t.json:4:{int(at[2:]) + 2}: {expected}"), str(e.value)


@pytest.mark.parametrize("text, expected", [
    ('{"version": 2, "events": []}', "t.json:1:13: version 2 is not supported"),
    ('{"version": 1, "events": []}', "t.json:1:26: events must be a non-empty list"),
    ('{"version": 1, "events": [{"t": 5, "gpus": 1}]}', "t.json:1:33: event 0: the first event must be at t=0"),
    ('{"version": 1, "events": [{"t": 0, "gpus": 1}], "end": 0}', "t.json:1:56: end must be a number of seconds after"),
    ('{"version": 1, "events": [{"t": 0, "gpus": 1}], "gpus_per_node": 0}', "gpus_per_node must be a positive integer"),
    ('{"version": 1, "events": [{"t": 0, "gpus": 1}], "trace": 1}', "unknown field 'trace'"),
    ('"events"', "t.json:1:1: expected an object"),
])
def test_malformed_trace_fields(text: str, expected: str) -> None:
    with pytest.raises(TraceError, match=re.escape(expected)):
        parse_trace(text, "t.json")


def test_an_unreadable_trace_names_the_file(tmp_path) -> None:
    with pytest.raises(TraceError, match=re.escape(f"{tmp_path / 'none.json'}: cannot read")):
        load_trace(str(tmp_path / "none.json"))
