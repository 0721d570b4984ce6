"""Opt-in: every checkpoint setting of the Megatron-LM checkout at ``MEGATRON_LM_PATH`` is classified by
``plan/megatron_ckpt_flags.py`` (honoured, refused at start or of no effect under --tenplex), so a new release line
cannot slip a setting past the hook.

The settings are read from the checkout's source with ``ast`` (nothing imported): ``CheckpointConfig``'s fields
(``megatron/training/training_config.py`` from core_v0.16, ``megatron/training/config/training_config.py`` from
core_v0.19; a field's ``argparse_meta`` ``dest`` where it renames it) and the destinations of every
``add_argument`` in ``_add_checkpointing_args`` (``megatron/training/arguments.py``: the whole group up to
core_v0.15, the flags added beside the dataclass after), and ``--dataloader-type``'s choices.
"""

from __future__ import annotations

import ast
import os

import pytest

from tenplex_megatron.plan import megatron_ckpt_flags as table

pytestmark = [pytest.mark.megatron_lm,
              pytest.mark.skipif(not os.environ.get("MEGATRON_LM_PATH"),
                                 reason="set MEGATRON_LM_PATH to a Megatron-LM core_v0.15.x-0.19.x checkout")]
MLM = os.environ.get("MEGATRON_LM_PATH", "")
CONFIGS = ("megatron/training/training_config.py", "megatron/training/config/training_config.py")


def _tree(rel: str) -> ast.Module | None:
    path = os.path.join(MLM, rel)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return ast.parse(f.read(), path)


def config_fields() -> set[str]:
    """CheckpointConfig's fields as args attributes (a field whose argparse metadata names a ``dest`` is that)."""
    out: set[str] = set()
    for rel in CONFIGS:
        tree = _tree(rel)
        for node in ast.walk(tree) if tree is not None else ():
            if not (isinstance(node, ast.ClassDef) and node.name == "CheckpointConfig"):
                continue
            for st in node.body:
                if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                    dest = st.target.id
                    for sub in ast.walk(st):
                        if isinstance(sub, ast.Dict):
                            for k, v in zip(sub.keys, sub.values):
                                if isinstance(k, ast.Constant) and k.value == "dest" and isinstance(v, ast.Constant):
                                    dest = v.value
                    out.add(dest)
    return out


def _calls(fn_name: str) -> list[ast.Call]:
    tree = _tree("megatron/training/arguments.py")
    assert tree is not None, f"{MLM}: no megatron/training/arguments.py (not a Megatron-LM checkout?)"
    fns = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == fn_name]
    return [c for fn in fns for c in ast.walk(fn) if isinstance(c, ast.Call)
            and getattr(c.func, "attr", "") == "add_argument"]


def _dest(call: ast.Call) -> str:
    dest = next((k.value.value for k in call.keywords if k.arg == "dest" and isinstance(k.value, ast.Constant)), None)
    long = next(a.value for a in call.args if isinstance(a, ast.Constant) and str(a.value).startswith("--"))
    return dest or long[2:].replace("-", "_")


def group_dests() -> set[str]:
    """The destinations of the checkpointing argument group's own ``add_argument`` calls."""
    return {_dest(c) for c in _calls("_add_checkpointing_args")}


def test_every_checkpoint_setting_of_the_checkout_is_classified() -> None:
    found = config_fields() | group_dests()
    assert len(found) > 30, f"{MLM}: only {sorted(found)} read: the reader no longer matches the source"
    assert table.unclassified(found) == [], (
        "Megatron-LM checkpoint settings neither honoured, refused nor of no effect under --tenplex: add a row to "
        "tenplex_megatron/plan/megatron_ckpt_flags.py")


def test_every_dataloader_type_is_honoured_or_refused() -> None:
    calls = [c for fn in ("_add_training_args", "_add_data_args")
             for c in _calls(fn) if _dest(c) == "dataloader_type"]
    assert calls, f"{MLM}: --dataloader-type not found"
    choices = next(k.value for k in calls[0].keywords if k.arg == "choices")
    kinds = [e.value for e in choices.elts]
    row = table.BY_NAME["dataloader_type"]
    for kind in kinds:
        refused = table.refusals(type("Args", (), {"dataloader_type": kind})())
        assert kind in row.accepted or (refused and refused[0].startswith(f"--dataloader-type {kind}")), kind
        assert kind in row.why, f"--dataloader-type {kind}: the table does not say what it does"


def copied_by_checkout() -> dict[str, bool]:
    """What the checkout's ``load_args_from_checkpoint`` copies: each ``_set_arg`` call's arg and its ``force``,
    the model-parallel ones (``--use-mp-args-from-checkpoint-args``, refused under --tenplex) left out."""
    tree = _tree("megatron/training/checkpointing.py")
    assert tree is not None, f"{MLM}: no megatron/training/checkpointing.py"
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "load_args_from_checkpoint")
    mp = [n for n in ast.walk(fn) if isinstance(n, ast.If) and "use_mp_args_from_checkpoint_args" in ast.unparse(n.test)]
    skip = {id(c) for n in mp for c in ast.walk(n)}
    out = {}
    for c in ast.walk(fn):
        if isinstance(c, ast.Call) and getattr(c.func, "id", "") == "_set_arg" and id(c) not in skip:
            force = next((k.value.value for k in c.keywords if k.arg == "force"), False)
            out[c.args[0].value] = bool(force)
    return out


def test_use_checkpoint_args_copies_what_the_checkouts_reader_copies() -> None:
    """plan/checkpoint_args.py's list is the union of the lines': every arg this checkout copies is there, with the
    same force (a new line's new arg fails here until the list has it)."""
    from tenplex_megatron.plan import checkpoint_args

    got = copied_by_checkout()
    assert len(got) > 30, f"{MLM}: only {sorted(got)} read: the reader no longer matches the source"
    ours = {r.dest: r.force for r in checkpoint_args.COPIED}
    assert {k: v for k, v in got.items() if ours.get(k) != v} == {}, "add them to plan/checkpoint_args.py COPIED"
