"""Run megatron-core on a CPU-only machine (tests, CI, the demo). Never used on a GPU.

megatron-core hard-codes CUDA in a handful of places (device arguments, the
CUDA RNG tracker, ``torch.cuda.synchronize``, ``Tensor.type()`` checks in the
distributed optimizer). :func:`install` redirects each of them to the CPU so
that the real GPTModel, DDP, DistributedOptimizer and pipeline schedules run
over gloo. It also gives megatron-core's torch norm what apex's and Transformer
Engine's norms give it on a GPU: sequence parallelism (the norm's parameters
marked ``sequence_parallel`` so ``finalize_model_grads`` all-reduces their
grads over TP); it keeps pipeline outputs alive until gloo has sent them
(see :func:`_keep_pipeline_outputs`); and it provides what the ``grouped_gemm`` package
provides on a GPU for megatron-core's grouped-GEMM experts (``GroupedMLP``,
``--moe-grouped-gemm``): ``grouped_gemm.ops.gmm``, a pure-torch grouped matmul with the
package's forward and backward (``cpu_grouped_gemm.py``), registered as the module
``grouped_gemm`` before megatron-core imports ``grouped_gemm_util`` (see
:func:`_grouped_gemm`). It refuses to run when a GPU is present: on a GPU nothing is
redirected.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from tenplex_megatron.training import cpu_grouped_gemm

#: marks the stand-in :func:`install` leaves as ``torch.cuda.current_device``, once everything is redirected
INSTALLED_MARK = "__tenplex_cpu_shim__"


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


class _NullEvent:
    """A recorded CUDA event on the CPU: everything already happened."""

    def synchronize(self) -> None:
        return None

    def wait(self, *_a: Any) -> None:
        return None

    def query(self) -> bool:
        return True


class _NullStream:
    def wait_stream(self, *_a: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def record_event(self, *_a: Any) -> _NullEvent:  # megatron-core's alltoall MoE dispatcher records and syncs one
        return _NullEvent()


def _sequence_parallel_norm() -> None:
    """Let megatron-core's ``WrappedTorchNorm`` (the norm without apex or TE) run with sequence parallelism.

    It asserts SP is off; apex's ``FusedLayerNorm`` instead marks its weight and bias ``sequence_parallel`` (the
    grads of replicated parameters that saw only this rank's part of the sequence are then summed over TP). The
    torch norm computes the same per token, so it is built as usual and marked the same way."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original = WrappedTorchNorm.__new__

    def new(cls: type, config: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(config, "sequence_parallel", False):
            return original(cls, config, *args, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = original(cls, plain, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    WrappedTorchNorm.__new__ = new  # type: ignore[method-assign]


def _keep_pipeline_outputs() -> None:
    """Keep the storage of every pipeline output the schedules free until the next schedule call.

    With ``deallocate_pipeline_outputs`` (Megatron-LM sets it) a stage frees the storage of the activation it has
    just sent (``out.data = torch.empty(1)``). NCCL's send is ordered on the CUDA stream, so that is safe on a GPU;
    gloo's asynchronous send (the interleaved schedule overlaps its p2p transfers) still reads the old storage from
    its own thread, and the next stage received freed memory: wrong activations, losses off or NaN. The tensor is
    still pseudo-freed (the schedule's backward checks it); only its old storage lives on for one step."""
    from megatron.core.pipeline_parallel import schedules

    kept: list[torch.Tensor] = []
    deallocate = schedules.deallocate_output_tensor

    def keep(out: Any) -> None:  # a tensor; 0.19 also passes lists and dicts of them (multi-module pipelines)
        if isinstance(out, dict):
            for value in out.values():
                keep(value)
        elif isinstance(out, list | tuple):
            for value in out:
                keep(value)
        elif isinstance(out, torch.Tensor):
            kept.append(out.data)

    def keep_then_deallocate(out: Any, deallocate_pipeline_outputs: bool = False) -> None:
        if out is not None and deallocate_pipeline_outputs:
            keep(out)
        deallocate(out, deallocate_pipeline_outputs)

    def releasing(schedule: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            kept.clear()  # every send of the previous step was received: its buffers are free to go
            return schedule(*args, **kwargs)

        return run

    schedules.deallocate_output_tensor = keep_then_deallocate
    for name in ("forward_backward_no_pipelining", "forward_backward_pipelining_without_interleaving",
                 "forward_backward_pipelining_with_interleaving"):
        setattr(schedules, name, releasing(getattr(schedules, name)))


def _moe_without_te() -> None:
    """megatron-core 0.16.1's ``moe_utils`` imports ``te_general_gemm`` inside a try that fails without Transformer
    Engine, then tests it against None: define it as None (the router's plain matmul is then used). And the alltoall
    dispatcher's split sizes: on a GPU ``maybe_move_tensor_to_cpu(..., as_numpy=True)`` turns them into NumPy arrays
    (what ``all_to_all_single`` takes); a tensor already on the CPU was returned as is, so it is converted here."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    original = moe_utils.maybe_move_tensor_to_cpu

    def to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = to_cpu


def _grouped_gemm() -> None:
    """Register the CPU ``grouped_gemm`` stand-in (``cpu_grouped_gemm.gmm``) before megatron-core's
    ``grouped_gemm_util`` imports the package; if that module was imported already, point it at the stand-in too."""
    package = cpu_grouped_gemm.module()
    sys.modules["grouped_gemm"] = package
    sys.modules["grouped_gemm.ops"] = package.ops
    util = sys.modules.get("megatron.core.transformer.moe.grouped_gemm_util")
    if util is not None:
        util.grouped_gemm = package
        util.ops = package.ops


def installed() -> bool:
    """Whether :func:`install` ran in this process: the mark on the stand-in it leaves in torch (the patched
    module keeps that it is patched)."""
    return bool(getattr(torch.cuda.current_device, INSTALLED_MARK, False))


def install() -> None:
    """Redirect megatron-core's CUDA calls to the CPU for this process (idempotent)."""
    if installed():
        return
    if torch.cuda.is_available():
        raise RuntimeError("tenplex_megatron.training.cpu_shim must not be used on a GPU machine")
    _grouped_gemm()  # first: before anything below imports megatron-core's modules

    def current_device() -> str:
        return "cpu"

    torch.cuda.current_device = current_device  # type: ignore[assignment]
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
    _sequence_parallel_norm()
    _keep_pipeline_outputs()
    _moe_without_te()
    _CpuDeviceMode().__enter__()
    setattr(current_device, INSTALLED_MARK, True)  # last: an install that failed part-way runs again
