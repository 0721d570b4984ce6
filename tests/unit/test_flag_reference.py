"""The flag and environment reference (docs/reference.md) is generated, complete and current.

Every ``--tenplex*`` flag of the reference trainer's parser and of the Megatron-LM hook's is a row of
``tenplex_megatron/flags.py``'s table, with the table's help text and settings; every ``TENPLEX_*`` name the
package, its scripts, examples and tests read is in its registry; and ``docs/reference.md`` is what
``python -m tenplex_megatron.docs_reference`` writes today. On a failure: add the row to
``tenplex_megatron/flags.py`` and run ``python -m tenplex_megatron.docs_reference``.
"""

from __future__ import annotations

import argparse
import os
import re

import pytest

from tenplex_megatron import docs_reference, flags
from tests.harness import ROOT


def _tenplex_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {opt: a for a in parser._actions for opt in a.option_strings if opt.startswith("--tenplex")}


def _parsers() -> dict[str, argparse.ArgumentParser]:
    from tenplex_megatron.frontdoor import megatron_lm
    from tenplex_megatron.training.pretrain import build_parser

    return {flags.TRAINER: build_parser(), flags.HOOK: megatron_lm.add_tenplex_args(argparse.ArgumentParser())}


@pytest.mark.parametrize("door", flags.BOTH)
def test_every_parser_flag_is_in_the_table_with_its_help(door: str) -> None:
    actions = _tenplex_actions(_parsers()[door])
    table = {f.name: f for f in flags.flags_for(door)}
    assert set(actions) - set(table) == set(), f"{door}: flags missing from tenplex_megatron/flags.py"
    assert set(table) - set(actions) == set(), f"{door}: the table lists flags the parser does not take"
    for name, action in actions.items():
        row = table[name]
        assert action.help == row.help, f"{door} {name}: help differs from the table's"
        expected = row.kwargs()
        for key in ("default", "type", "metavar", "nargs", "const"):
            if key in expected:
                assert getattr(action, key) == expected[key], (door, name, key)
        assert (list(action.choices) if action.choices else None) == expected.get("choices"), (door, name)


def test_flags_are_unique_and_well_formed() -> None:
    names = [f.name for f in flags.FLAGS]
    assert len(names) == len(set(names))
    groups = {g[0] for g in flags.GROUPS}
    for f in flags.FLAGS:
        assert f.name.startswith("--tenplex") and f.group in groups and set(f.doors) <= set(flags.BOTH), f
        assert f.help and "%" not in f.help, f  # argparse formats help with %


def _env_names_read_in_the_code() -> set[str]:
    names: set[str] = set()
    for top in ("tenplex_megatron", "scripts", "tests", "examples"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith(".py") and name != "flags.py":
                    with open(os.path.join(dirpath, name), encoding="utf-8") as fh:
                        names |= set(re.findall(r"\bTENPLEX_[A-Z0-9_]+\b", fh.read()))
    return names


def test_every_environment_variable_is_registered() -> None:
    registered = {v.name for v in flags.ENV_VARS}
    assert len(registered) == len(flags.ENV_VARS)
    read = _env_names_read_in_the_code()
    assert read - registered == set(), "TENPLEX_* names read in the code but missing from flags.ENV_VARS"
    assert registered - read == set(), "flags.ENV_VARS lists names nothing reads any more"
    assert {v.audience for v in flags.ENV_VARS} <= {"user", "tests", "internal"}


def test_the_reference_page_is_current() -> None:
    with open(docs_reference.DEFAULT_OUT, encoding="utf-8") as f:
        assert f.read() == docs_reference.render(), \
            "docs/reference.md is stale: run python -m tenplex_megatron.docs_reference"
    assert docs_reference.main(["--check"]) == 0


def test_the_cli_reference_is_every_commands_help_at_any_terminal_width(monkeypatch) -> None:
    from tenplex_megatron import cli

    with open(docs_reference.CLI_OUT, encoding="utf-8") as f:
        page = f.read()
    assert page == docs_reference.render_cli(), "docs/cli-reference.md is stale: python -m tenplex_megatron.docs_reference"
    commands = docs_reference.subcommands(cli.build_parser())
    assert {"inspect", "verify", "plan", "layouts", "export-hf", "export-megatron", "clean-memory",
            "simulate"} <= set(commands)
    for name, sub in commands.items():
        assert f"## {name}\n" in page and f"usage: python -m tenplex_megatron {name} " in page, name
        for action in (a for a in sub._actions if a.help != argparse.SUPPRESS):
            assert all(o in page for o in action.option_strings), (name, action.option_strings)
    monkeypatch.setenv("COLUMNS", "40")  # a narrow terminal rewraps --help, never the page
    assert docs_reference.render_cli() == page


def test_every_flag_and_variable_is_on_the_page() -> None:
    page = docs_reference.render()
    for f in flags.FLAGS:
        assert docs_reference._code(f.usage()) in page, f.name
    for v in flags.ENV_VARS:
        assert f"`{v.name}`" in page, v.name


def test_the_support_page_and_the_reference_show_megatron_lms_flags_per_line() -> None:
    from tenplex_megatron import megatron_flags_reference as ref
    from tenplex_megatron.plan import megatron_flag_snapshot as snap
    from tenplex_megatron.plan import megatron_flags

    snapshot = snap.read()
    with open(docs_reference.SUPPORT_OUT, encoding="utf-8") as f:
        support = f.read()
    assert ref.with_support_block(support) == support, "docs/support.md's block is stale: python -m " \
                                                       "tenplex_megatron.docs_reference"
    page = docs_reference.render()
    for line in snapshot.lines:
        c = megatron_flags.counts(line)
        row = f"| {line.name} | {line.tag} | {len(line.flags)} | {c['neutral']} | {c['honoured']} | {c['refused']} |"
        assert row in support and row in page, row
    for verdict, options, _ in megatron_flags.refused(snapshot):
        assert f"`{ref._long(options)}`" in support and verdict.why in page, verdict.dest
    with pytest.raises(ref.GeneratedBlockError, match="no generated block"):
        ref.with_support_block("# What is supported\n")
