"""A user's layout table and the measured-times file (plan/layout_files.py): reading, checking, errors naming the row."""

from __future__ import annotations

import json
import os
import re

import pytest

from tenplex_megatron.plan.autolayout import rank_layouts
from tenplex_megatron.plan.layout import LayoutError, ParallelLayout
from tenplex_megatron.plan.layout_files import (
    format_layout_times,
    load_layout_table,
    parse_layout_table,
    parse_layout_times,
    read_layout_times,
    with_measurement,
    write_layout_times,
)
from tenplex_megatron.plan.sim.gpt_catalogue import load_model

TINY = load_model("tiny")  # 2 layers, 4 heads


def _at(text: str, needle: str) -> str:
    """line:column of the first occurrence of ``needle`` (computed here, independently of the parser)."""
    off = text.index(needle)
    return f"{text.count(chr(10), 0, off) + 1}:{off - text.rfind(chr(10), 0, off)}"


def test_a_good_table_loads_and_gives_each_world_size_its_row(tmp_path) -> None:
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"version": 1, "layouts": {
        "4": {"tp": 2, "pp": 1, "dp": 2, "micro_batch_size": 2},
        "1": {"tp": 1, "pp": 1, "dp": 1, "micro_batch_size": 8},
        "2": {"tp": 1, "pp": 2, "dp": 1, "micro_batch_size": 4}}}))
    table = load_layout_table(str(path), TINY, gpus_per_node=4, global_batch_size=8)
    assert [r.world_size for r in table.rows] == [1, 2, 4]
    assert table.row(4).layout == ParallelLayout(2, 1, 2) and table.row(4).micro_batch_size == 2
    assert table.row(2).key == "tp=1,pp=2,dp=1,mbs=4"
    with pytest.raises(LayoutError, match=re.escape(f"{path}: no layout for world size 3 (the table has 1, 2, 4)")):
        table.row(3)


def test_an_impossible_row_is_refused_naming_the_row_line_and_why() -> None:
    text = """{"version": 1, "layouts": {
  "4": {"tp": 2, "pp": 1, "dp": 2, "micro_batch_size": 2},
  "5": {"tp": 5, "pp": 1, "dp": 1, "micro_batch_size": 1},
  "6": {"tp": 1, "pp": 3, "dp": 2, "micro_batch_size": 1},
  "8": {"tp": 2, "pp": 2, "dp": 1, "micro_batch_size": 1}
}}"""
    with pytest.raises(LayoutError) as e:
        parse_layout_table(text, "t.json", TINY, gpus_per_node=4, global_batch_size=8)
    msg = str(e.value)
    assert msg.startswith("t.json: impossible layout(s) in the table:")
    lines = msg.splitlines()[1:]
    assert len(lines) == 3  # every bad row, not only the first; row "4" is fine
    five, six, eight = lines
    at5, at6 = _at(text, '{"tp": 5'), _at(text, '{"tp": 1, "pp": 3')
    assert five.strip().startswith(f't.json:{at5}: row "5" (tp=5,pp=1,dp=1,mbs=1): ')
    assert "TP=5 does not divide the attention heads (4)" in five and "TP=5 spans more than the 4 GPUs" in five
    assert f't.json:{at6}: row "6"' in six and "PP=3 does not divide the 2 layers" in six
    assert 'row "8"' in eight and "TP x PP x DP = 2 x 2 x 1 = 4 is not the world size 8" in eight


def test_without_the_model_a_row_is_still_checked_against_its_world_size() -> None:
    text = '{"version": 1, "layouts": {"8": {"tp": 2, "pp": 2, "dp": 1, "micro_batch_size": 1}}}'
    with pytest.raises(LayoutError, match=re.escape('row "8" (tp=2,pp=2,dp=1,mbs=1): TP x PP x DP = 4 is not the world size 8')):
        parse_layout_table(text, "t.json")


@pytest.mark.parametrize("text, expected", [
    ('{"version": 1, "layouts": {"4": {"tp": 2, "pp": 1, "dp": 2}}}', 'row "4": expected {"tp": N, "pp": N, "dp": N, "micro_batch_size": N}'),
    ('{"version": 1, "layouts": {"4": {"tp": 2, "pp": 1, "dp": 2, "micro_batch_size": 0}}}', 'row "4": expected'),
    ('{"version": 1, "layouts": {"four": {"tp": 2, "pp": 1, "dp": 2, "micro_batch_size": 1}}}', "row 'four': the key must be a world size"),
    ('{"version": 2, "layouts": {}}', "t.json:1:13: version 2 is not supported"),
    ('{"version": 1, "layouts": {}, "extra": 1}', "t.json:1:40: unknown field(s) 'extra'"),
    ('{"version": 1, "layouts": {}}', "t.json:1:27: the table has no rows"),
    ('{"version": 1, "layouts": {\n  "4": {"tp": 2,, }\n}}', "t.json:2:17: not valid JSON"),
    ('[1, 2]', "t.json:1:1: expected an object"),
])
def test_malformed_tables_are_refused_naming_where(text: str, expected: str) -> None:
    with pytest.raises(LayoutError, match=re.escape(expected)):
        parse_layout_table(text, "t.json")


def test_an_unreadable_table_names_the_file(tmp_path) -> None:
    with pytest.raises(LayoutError, match=re.escape(f"{tmp_path / 'nope.json'}: cannot read")):
        load_layout_table(str(tmp_path / "nope.json"))


def test_measured_times_round_trip_and_feed_the_ranking(tmp_path) -> None:
    path = str(tmp_path / "tenplex_layout_times.json")
    assert read_layout_times(path) == {}  # no file yet: no measurements
    times = with_measurement({}, 4, "tp=1,pp=1,dp=4,mbs=2", 0.5)
    times = with_measurement(times, 4, "tp=2,pp=1,dp=2,mbs=1", 0.25)
    times = with_measurement(times, 2, "tp=1,pp=2,dp=1,mbs=1", 0.75)
    write_layout_times(path, times)
    assert read_layout_times(path) == times
    assert json.loads(open(path).read())["version"] == 1
    assert [f for f in os.listdir(tmp_path)] == ["tenplex_layout_times.json"]  # no temporary file left behind
    assert format_layout_times(read_layout_times(path)) == open(path).read()
    ranked = rank_layouts(TINY, 4, 4, 8, measured=read_layout_times(path)[4])
    assert [c.key for c in ranked[:2]] == ["tp=2,pp=1,dp=2,mbs=1", "tp=1,pp=1,dp=4,mbs=2"]


@pytest.mark.parametrize("entry, expected", [
    ('"tp=2,pp=1,dp=1,mbs=1": 0.5', "tp=2,pp=1,dp=1,mbs=1 has 2 ranks, not 4"),
    ('"tp=2,pp=1,dp=2,mbs=1": -1', "seconds must be a positive number, got -1"),
    ('"tp=2,pp=1,dp=2,mbs=1": "fast"', "seconds must be a positive number"),
    ('"tp=2,pp=1,dp=2": 0.5', "cannot parse 'tp=2,pp=1,dp=2'"),
])
def test_bad_measured_times_name_the_row_and_line(entry: str, expected: str) -> None:
    text = '{"version": 1, "times": {\n "4": {\n  "tp=1,pp=1,dp=4,mbs=1": 0.5,\n  ' + entry + "\n }\n}}"
    with pytest.raises(LayoutError) as e:
        parse_layout_times(text, "times.json")
    assert str(e.value).startswith(f"times.json:4:{len(entry) - len(entry.split(': ', 1)[1]) + 3}: row \"4\": ")
    assert expected in str(e.value)
