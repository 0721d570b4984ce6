"""Megatron-LM's in-process restart with ``--tenplex``: the survivors of a fault continue at a smaller layout.

Megatron-LM's ``--inprocess-restart`` (``megatron/training/inprocess_restart.py``) wraps ``pretrain`` in NVIDIA
Resiliency Extension's ``Wrapper`` at a fixed active world (``Layer(min_ranks=max_ranks=active)`` and
``RetryController(min_world_size=active)``) fed by hot spares, with its stores hosted by rank 0: with no spare left
the job ends. With ``--tenplex`` the hook replaces the function ``pretrain_gpt.py`` calls to build that wrapper
(``maybe_wrap_for_inprocess_restart``) by :func:`wrap`: spares (``--inprocess-active-world-size`` below the world)
are used first, then the world shrinks to the largest size with a legal layout; the stores are the in-process
launcher's (``frontdoor/launch.py``), so any rank may die; the checkpoint leases are claimed once and kept. Each call
of ``pretrain`` parses and validates its flags again for the world NVRx admitted (core_v0.18+: the patch's flag
reading, handed over as a ``PerCall``; the hook's ``validate_args`` chooses the layout), builds the micro-batch calculator for the new data-parallel size, and the hook's
``load_checkpoint`` restores the newest host-memory snapshot at the new layout.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tenplex_megatron import log as tlog
from tenplex_megatron.frontdoor import batch_flags, inprocess, inprocess_lease, inprocess_runner
from tenplex_megatron.frontdoor.job_config import JobConfig
from tenplex_megatron.frontdoor.megatron_lm_reform import PerCall
from tenplex_megatron.storage.lease import LeaseSet

_log = tlog.get("megatron_lm")
PROG = "pretrain_gpt.py"
FLAG = "--inprocess-restart"
@dataclass(frozen=True)
class InPlace:
    """A job running in place: its timeouts and the checkpoint directories whose leases it holds across calls."""

    settings: inprocess.InprocessSettings
    leases: LeaseSet  # held across calls: each call's Checkpointer fences its writers with them


def wanted(argv: list[str]) -> bool:
    """Whether Megatron-LM's in-process restart is asked for together with ``--tenplex``."""
    return FLAG in argv and "--tenplex" in argv


def fixed_layout_reason(args: Any, n: int) -> str:
    """Why Megatron-LM's layout flags as given cannot run at world size ``n`` ("" when they can): TP x PP (x CP)
    divides it, expert TP x EP x PP divides it, the global batch (and each batch of a ramp still to come) splits into
    micro-batches over DP."""
    tp, pp = int(args.tensor_model_parallel_size), int(args.pipeline_model_parallel_size)
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    ep = int(getattr(args, "expert_model_parallel_size", 1) or 1)
    etp = int(getattr(args, "expert_tensor_parallel_size", None) or tp)
    if n % (tp * pp * cp):
        return (f"--tensor-model-parallel-size x --pipeline-model-parallel-size x --context-parallel-size = "
                f"{tp} x {pp} x {cp} does not divide it")
    if n % (etp * ep * pp):
        return (f"--expert-tensor-parallel-size x --expert-model-parallel-size x --pipeline-model-parallel-size = "
                f"{etp} x {ep} x {pp} does not divide it")
    dp, mbs, gbs = n // (tp * pp * cp), int(args.micro_batch_size), args.global_batch_size
    if gbs and int(gbs) % (mbs * dp):
        return f"--global-batch-size {gbs} is not a multiple of --micro-batch-size x DP = {mbs} x {dp}"
    # a batch ramp: every batch size still to come from the live position
    return next(iter(batch_flags.problems_at(args, dp, int(getattr(args, "consumed_train_samples", 0) or 0))), "")


def start(args: Any, argv: list[str]) -> tuple[InPlace, Any]:
    """Before NVRx's wrapper, every rank: refused (naming the flag, the extra or the command to use) where the job
    cannot run in place; else the job's leases claimed and a client of the launcher's store (the process groups of
    every call are made on a prefix of it)."""
    problem = inprocess.refusal(PROG, argv, FLAG + " with --tenplex")
    if problem:
        raise SystemExit(problem)
    if not getattr(args, "load", None):  # Megatron-LM calls load_checkpoint only with --load
        raise SystemExit(f"{PROG}: error: {FLAG} with --tenplex needs --load (empty on the first start): without it "
                         "Megatron-LM never calls load_checkpoint and the survivors of a fault would start again from "
                         "iteration 0")
    settings = inprocess.checked_settings(PROG, args.tenplex_inprocess_timeout)
    if not getattr(args, "tenplex_memory", None) and int(os.environ.get("RANK", "0")) == 0:
        _log.warning("%s", inprocess.durable_only(args.save or args.load, args.save_interval).replace(
            "--tenplex-inprocess", f"{FLAG} with --tenplex"))
    store = inprocess.job_store(settings.barrier)
    leases = inprocess_lease.claim(JobConfig.from_args(args, PROG), store, settings.barrier)
    return InPlace(settings, leases), store


def megatron_protections(args: Any) -> tuple[tuple[Any, ...], tuple[Any, ...], Any]:
    """What Megatron-LM's own in-process wrapper (``megatron/training/inprocess_restart.py``) installs to keep a GPU
    job sound after a fault, for :func:`~tenplex_megatron.frontdoor.inprocess.wrapper`: Transformer Engine's
    userbuffers aborted after the process groups, the persistent async checkpoint worker reset before them, and the
    CUDA context's health checked (each a no-op where there is no Transformer Engine, async worker or GPU)."""
    import inspect
    from datetime import timedelta

    from megatron.training.async_utils import reset_persistent_async_worker

    nvrx = inprocess.nvrx()
    takes = len(inspect.signature(reset_persistent_async_worker).parameters)  # core_v0.17+: the async strategy

    class AbortCheckpoint(nvrx.abort.Abort):  # type: ignore[misc, name-defined]
        def __call__(self, state: Any) -> Any:
            reset_persistent_async_worker(*([getattr(args, "async_strategy", None)] if takes else []))
            return state

    return ((nvrx.abort.AbortTransformerEngine(),), (AbortCheckpoint(),),
            nvrx.health_check.CudaHealthCheck(timeout=timedelta(seconds=10)))


def wrap(pretrain: Callable[..., Any], args: Any, argv: list[str], reason: Callable[[int], str],
         finalize: Callable[[], None]) -> tuple[Callable[..., Any], Any, InPlace]:
    """``pretrain`` inside NVRx's ``Wrapper`` with the world allowed to shrink to any size ``reason`` admits (its
    ``""``), and the store ``pretrain_gpt.py`` passes on to ``pretrain``. ``finalize`` runs in each survivor after
    a fault (Megatron-LM's global state and the hook's Checkpointer torn down). No legal world left: exit 2."""
    state, store = start(args, argv)
    logfile = inprocess.monitor_logfile(PROG, int(os.environ["RANK"]))
    active = getattr(args, "inprocess_active_world_size", None)
    outer, inner, health = megatron_protections(args)

    def after_fault() -> None:  # the helpers killed first: closing one waits for its background persist
        import torch

        inprocess.end_aborted_call()
        finalize()
        if getattr(args, "inprocess_empty_cuda_cache", False) and torch.cuda.is_available():
            torch.cuda.empty_cache()  # as Megatron-LM's own wrapper with --inprocess-empty-cuda-cache

    wrapper = inprocess.wrapper(state.settings, lambda n: not reason(n), finalize=after_fault, logfile=logfile,
                                why_not=reason, active=int(active) if active else None, abort_outer=outer,
                                abort_inner=inner, health_check=health)

    def call(it: int, call_store: Any, *a: Any, **kw: Any) -> Any:  # Megatron-LM makes its process group there
        call_args = (a[0].make(), *a[1:]) if a and isinstance(a[0], PerCall) else a  # core_v0.18+: this world's flags
        return pretrain(*call_args, **{**kw, "store": call_store})

    def say(it: int, line: str) -> None:  # a call after a fault is a warning, so that every survivor says it
        (_log.warning if it else _log.info)("%s", line)

    def no_layout() -> None:
        _log.error("%s: %s with --tenplex: no legal layout for the ranks left; exiting", PROG, FLAG)

    run = inprocess_runner.wrapped(PROG, wrapper, state.leases, store, call, say, no_layout)
    return run, store, state
