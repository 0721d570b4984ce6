"""Run megatron-core on a CPU-only machine (tests, CI, the demo). Never used on a GPU.

megatron-core hard-codes CUDA in a handful of places (device arguments, the
CUDA RNG tracker, ``torch.cuda.synchronize``, ``Tensor.type()`` checks in the
distributed optimizer). :func:`install` redirects each of them to the CPU so
that the real GPTModel, DDP, DistributedOptimizer and pipeline schedules run
over gloo. It refuses to run when a GPU is present: on a GPU nothing is
redirected.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_INSTALLED = False


def _is_cuda(dev: Any) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return False


class _CpuDeviceMode(TorchFunctionMode):
    """Rewrites every CUDA device argument to the CPU and makes ``.cuda()`` a no-op."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if "device" in kwargs and (_is_cuda(kwargs["device"]) or isinstance(kwargs["device"], int)):
            kwargs["device"] = "cpu"
        if func in (torch.Tensor.to,) and args and len(args) > 1 and (
            _is_cuda(args[1]) or (isinstance(args[1], int) and not isinstance(args[1], bool))
        ):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _NullStream:
    def wait_stream(self, *_a: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None


def install() -> None:
    """Redirect megatron-core's CUDA calls to the CPU for this process (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    if torch.cuda.is_available():
        raise RuntimeError("tenplex_megatron.training.cpu_shim must not be used on a GPU machine")
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.empty_cache = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # type: ignore[assignment]
    torch.cuda.set_rng_state = lambda s, *a, **k: torch.set_rng_state(s)  # type: ignore[assignment]
    torch.cuda.manual_seed = lambda s: torch.default_generator.manual_seed(int(s))  # type: ignore[assignment]
    torch.cuda.manual_seed_all = lambda s: None  # type: ignore[assignment]
    torch.cuda.Stream = lambda *a, **k: _NullStream()  # type: ignore[assignment,misc]
    torch.cuda.default_stream = lambda *a, **k: _NullStream()  # type: ignore[assignment]
    torch.cuda.current_stream = lambda *a, **k: _NullStream()  # type: ignore[assignment]
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]

    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda s, *a, **k: torch.set_rng_state(s)
    _CpuDeviceMode().__enter__()
    _INSTALLED = True
