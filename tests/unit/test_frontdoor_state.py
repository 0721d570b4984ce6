"""The front doors keep no module-level mutable state: a job's state lives in its Checkpointer (and the Megatron-LM
hook's in the object :func:`install` leaves on the module it patches), so an in-process restart can close it and
build it again. Every module of ``frontdoor/`` (the DeepSpeed front door's only where DeepSpeed is installed) and the
DeepSpeed calls' public module are imported and their globals looked at."""

from __future__ import annotations
import __future__

import importlib
import importlib.util
import inspect
import logging
import pkgutil
import re
import types
import typing
from typing import Any

import tenplex_megatron.frontdoor as frontdoor

#: the DeepSpeed front door's modules in frontdoor/, which import DeepSpeed (``_optional.require``): looked at where
#: it is installed, with the public module users import them through
DEEPSPEED_FRONT_DOOR = ("tenplex_megatron.frontdoor.deepspeed", "tenplex_megatron.frontdoor.deepspeed_memory")
DEEPSPEED_PUBLIC = "tenplex_megatron.deepspeed"
#: values that cannot change, or are not state: constants, read-only views, compiled patterns, code, types, the
#: one logger
IMMUTABLE = (str, bytes, int, float, complex, bool, type(None), tuple, frozenset, range, types.MappingProxyType,
             re.Pattern, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, type, logging.Logger,
             typing.TypeVar, __future__._Feature)


def _front_door_modules() -> list[str]:
    names = [frontdoor.__name__]
    names += [m.name for m in pkgutil.iter_modules(frontdoor.__path__, frontdoor.__name__ + ".")]
    if importlib.util.find_spec("deepspeed") is None:
        return [n for n in names if n not in DEEPSPEED_FRONT_DOOR]
    return [*names, DEEPSPEED_PUBLIC]


def _mutable_globals(module: types.ModuleType) -> list[str]:
    """The module's globals that hold mutable objects (``__dunder__`` names left out), each with its type."""
    out = []
    for name, value in vars(module).items():
        if name.startswith("__") and name.endswith("__"):
            continue
        if isinstance(value, IMMUTABLE) or inspect.isroutine(value) or typing.get_origin(value) is not None:
            continue
        if isinstance(value, tuple | frozenset):
            continue
        if getattr(type(value), "__module__", "") == "typing":  # Any, Callable... (special forms)
            continue
        if _frozen_dataclass(value):
            continue
        out.append(f"{module.__name__}.{name}: {type(value).__name__}")
    return out


def _frozen_dataclass(value: Any) -> bool:
    params = getattr(type(value), "__dataclass_params__", None)
    return bool(params is not None and params.frozen)


def test_the_front_doors_hold_no_module_level_mutable_state() -> None:
    modules = _front_door_modules()
    assert "tenplex_megatron.frontdoor.megatron_lm" in modules and "tenplex_megatron.frontdoor.checkpointer" in modules
    if importlib.util.find_spec("deepspeed") is not None:  # the walk of frontdoor/ found the DeepSpeed front door
        assert set(DEEPSPEED_FRONT_DOOR) <= set(modules)
    found = [g for name in modules for g in _mutable_globals(importlib.import_module(name))]
    assert found == [], "module-level mutable state in a front door (keep it in the job's Checkpointer):\n" + \
        "\n".join(found)


def test_the_check_finds_mutable_state(tmp_path, monkeypatch) -> None:
    """The check itself, on a module written here: a dict, a list, a set and an object are found; constants,
    read-only views and frozen records are not."""
    src = tmp_path / "door_probe.py"
    src.write_text(
        "import dataclasses, types\n"
        "A = {}\nB = []\nC = set()\nD = object()\n"
        "E = (1, 2)\nF = frozenset()\nG = types.MappingProxyType({})\nH = 'x'\n"
        "@dataclasses.dataclass(frozen=True)\nclass R:\n    x: int = 0\nI = R()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    probe = importlib.import_module("door_probe")
    assert sorted(g.split(": ")[0].split(".")[-1] for g in _mutable_globals(probe)) == ["A", "B", "C", "D"]

