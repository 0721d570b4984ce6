"""Every command of docs/recipes.md is one the code accepts: each is parsed by the parser of what it runs
(`tenplex-megatron`, the in-process launcher, torchrun), and the flags it gives a training script are that
script's (the reference trainer's parser; for Megatron-LM's, the hook's flags, the checkpoint settings table and
the flags the opt-in suite runs it with)."""

from __future__ import annotations

import os
import re
import shlex

import pytest

from tests.harness import ROOT

PAGE = os.path.join(ROOT, "docs", "recipes.md")


def commands(text: str) -> list[str]:
    """The command lines of a page's fenced blocks, continuation lines joined."""
    out = []
    for block in re.findall(r"^```\n(.*?)^```", text, re.S | re.M):
        out += [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    return out


def _options(parser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def _trainer_options() -> set[str]:
    from tenplex_megatron.training import pretrain

    return _options(pretrain.build_parser())


def _megatron_lm_options() -> set[str]:
    from tenplex_megatron import flags
    from tenplex_megatron.plan import megatron_ckpt_flags

    suite = "".join(open(os.path.join(ROOT, "tests", "megatron_lm", f), encoding="utf-8").read()
                    for f in ("test_megatron_lm.py", "run_megatron_lm.py"))
    return ({f.name for f in flags.flags_for(flags.HOOK)} | {s.flag for s in megatron_ckpt_flags.SETTINGS}
            | set(re.findall(r'"(--[a-z][a-z0-9-]*)"', suite)))


def check_script(script: str, args: list[str]) -> None:
    """The flags given to a training script are ones it takes (``...`` stands for the job's own flags)."""
    known = _trainer_options() if script == "scripts/pretrain_gpt.py" else \
        _megatron_lm_options() if script == "pretrain_gpt.py" else None
    assert known is not None, f"docs/recipes.md: unknown training script {script}"
    unknown = [a for a in args if a.startswith("--") and a.split("=")[0] not in known]
    assert not unknown, f"docs/recipes.md: {script} does not take {unknown}"


def check(line: str) -> str:
    """Parse one recipe command with the parser of what it runs; returns what it is, for the test's count."""
    words = shlex.split(line)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # environment assignments
        words = words[1:]
    head, args = words[0], words[1:]
    if head == "tenplex-megatron":
        from tenplex_megatron import cli

        cli.build_parser().parse_args(args)
        return head
    if head == "torchrun":
        from torch.distributed.run import get_args_parser

        at = next(i for i, a in enumerate(args) if a.endswith(".py"))
        parsed = get_args_parser().parse_args(args[:at + 1])
        check_script(parsed.training_script, args[at + 1:])
        return head
    if words[:3] == ["python", "-m", "tenplex_megatron.frontdoor.launch"]:
        from tenplex_megatron.frontdoor import launch

        parsed = launch.parse(words[3:])
        check_script(parsed.script, parsed.script_args)
        return "launch"
    if head == "pip":
        with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
            project = f.read()
        for extra in re.findall(r"tenplex-megatron\[(\w+)\]", line):
            assert re.search(rf"^{extra} = ", project, re.M), f"docs/recipes.md: no extra [{extra}]"
        for pin in re.findall(r"\b([a-z][a-z-]+)==", line):
            assert f'"{pin}"' in project, f"docs/recipes.md: {pin} is not a dependency the tests install"
        return head
    if head == "etcd":  # the server's flags: the ones the test's etcd is started with
        with open(os.path.join(ROOT, "benchmarks", "kit", "etcd.py"), encoding="utf-8") as f:
            started = f.read()
        for flag in (a for a in args if a.startswith("--")):
            assert f'"{flag}"' in started, f"docs/recipes.md: etcd {flag} is not how the tests start etcd"
        return head
    raise AssertionError(f"docs/recipes.md: a command no test parses: {line}")


def test_every_recipe_command_parses() -> None:
    with open(PAGE, encoding="utf-8") as f:
        lines = commands(f.read())
    kinds = [check(line) for line in lines]
    assert {"tenplex-megatron", "torchrun", "launch", "pip", "etcd"} <= set(kinds), kinds


def test_a_wrong_flag_in_a_recipe_is_named() -> None:
    with pytest.raises(AssertionError, match="--tenplex-bogus"):
        check("torchrun --nproc_per_node 2 pretrain_gpt.py ... --tenplex --tenplex-bogus")
    with pytest.raises(AssertionError, match="--tenplex-inprocess"):  # a flag of the reference trainer alone
        check("torchrun --nproc_per_node 2 pretrain_gpt.py ... --tenplex --tenplex-inprocess")
    with pytest.raises(SystemExit):
        check("tenplex-megatron plan ckpt --to-layout tp=2")
    with pytest.raises(AssertionError, match="a command no test parses"):
        check("srun python train.py")
    assert commands("```\na \\\n  b\n```\n") == ["a    b"]


def test_every_test_a_recipe_names_exists() -> None:
    # A recipe's "Tested by" names tests by function and by file: each must be defined where the suite has it.
    with open(PAGE, encoding="utf-8") as f:
        text = f.read()
    sources = {}
    for folder, _, files in os.walk(os.path.join(ROOT, "tests")):
        for name in files:
            if name.startswith("test_") and name.endswith(".py"):
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    sources[os.path.relpath(os.path.join(folder, name), ROOT)] = f.read()
    functions = set(re.findall(r"`(test_[a-z0-9_]+)`", text))
    files = set(re.findall(r"(tests/[a-z_/]+\.py)", text))
    assert functions and files
    for fn in functions:
        assert any(re.search(rf"^def {fn}\(", src, re.M) for src in sources.values()), f"docs/recipes.md: no {fn}"
    for path in files:
        assert os.path.isfile(os.path.join(ROOT, path)), f"docs/recipes.md: no {path}"
