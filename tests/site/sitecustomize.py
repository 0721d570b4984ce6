"""Test launches only (tests/harness.py puts this directory on the children's PYTHONPATH): megatron-core's
``jit_fuser`` (``torch.compile``) defers to the first call of each fused function.

megatron.core.jit sets ``jit_fuser = torch.compile`` and megatron-core decorates a dozen functions with it at
import time; each decoration imports torch._dynamo and torch._inductor (~3 s CPU per process, a third of
importing megatron.core), although on the CPU with fusions off (training/gpt.py) none of those functions is
called. Here the decoration is deferred: a decorated function is handed to ``torch.compile`` with the same
arguments on its first call, so what runs is what ``torch.compile`` would have run (it compiles on the first
call too). Nothing else changes; torch is not imported by this hook (a process that never imports
megatron.core, the CLI for one, is untouched).

Also: SIGUSR1 prints every thread's stack (faulthandler), which tests/harness.py asks of a launch past its timeout;
and ``TENPLEX_TEST_SECONDS_PER_ITERATION=S`` paces the reference trainer (``training/gpt.py``'s ``train_step`` takes
at least S seconds) in a Slurm job's first run (``SLURM_RESTART_COUNT`` 0 or unset), so that a tiny model still
trains when Slurm's own time-limit signal comes (tests/multiproc/test_slurm.py); the losses are unchanged.
"""

from __future__ import annotations

import faulthandler
import functools
import importlib.abc
import importlib.machinery
import os
import signal
import sys
import time
from typing import Any


def _deferred(compile_fn: Any) -> Any:
    def decorator(fn: Any = None, **kwargs: Any) -> Any:
        if fn is None:  # used as @jit_fuser(...) with arguments
            return lambda f: decorator(f, **kwargs)
        compiled = None

        @functools.wraps(fn)
        def call(*args: Any, **kw: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = compile_fn(fn, **kwargs)
            return compiled(*args, **kw)

        return call

    return decorator


class _DeferJitFuser(importlib.abc.MetaPathFinder):
    """After megatron.core.jit has run, wrap its ``jit_fuser`` if it is ``torch.compile``."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "megatron.core.jit":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module: Any) -> None:
            exec_module(module)
            import torch

            if module.jit_fuser is torch.compile:
                module.jit_fuser = _deferred(torch.compile)

        spec.loader.exec_module = exec_and_wrap  # type: ignore[method-assign]
        return spec


def _paced(fn: Any, seconds: float) -> Any:
    """``fn`` taking at least ``seconds`` per call (the rest slept)."""

    @functools.wraps(fn)
    def call(*args: Any, **kw: Any) -> Any:
        t0 = time.monotonic()
        out = fn(*args, **kw)
        time.sleep(max(0.0, seconds - (time.monotonic() - t0)))
        return out

    return call


class _PaceTraining(importlib.abc.MetaPathFinder):
    """After tenplex_megatron.training.gpt has run, pace its ``train_step`` (``TENPLEX_TEST_SECONDS_PER_ITERATION``)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "tenplex_megatron.training.gpt":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_pace(module: Any) -> None:
            exec_module(module)
            module.train_step = _paced(module.train_step, self.seconds)

        spec.loader.exec_module = exec_and_pace  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _DeferJitFuser())
if os.environ.get("TENPLEX_TEST_SECONDS_PER_ITERATION") and os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
    sys.meta_path.insert(0, _PaceTraining(float(os.environ["TENPLEX_TEST_SECONDS_PER_ITERATION"])))

# a hung test launch's stacks: tests/harness.py sends SIGUSR1 to every process of a launch past its timeout
faulthandler.register(signal.SIGUSR1, all_threads=True)
