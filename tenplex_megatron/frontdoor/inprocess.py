"""In-place restarts on NVIDIA Resiliency Extension's in-process restart (``--tenplex-inprocess``).

On a fault, NVRx's ``Wrapper`` has every healthy rank tear its process group down and call the wrapped training
function again in the same process, the dead or hung ranks excluded. What this module adds for a front door:

- the stores the job depends on served outside the ranks (:mod:`tenplex_megatron.frontdoor.launch` hosts them;
  every rank is a client), so that any rank, rank 0 included, may die;
- layout admission: of the ranks left, only as many are activated as the largest world size with a legal layout
  (:func:`admitted`); the rest wait as spares (NVRx's ``Tree`` rank assignment with a ``world_size_filter``);
- a survivor's pending gloo operations ended at the fault (:mod:`~tenplex_megatron.frontdoor.gloo_abort`), not
  at the gloo timeout;
- the timeouts, in one frozen :class:`InprocessSettings`;
- the refusals: NVRx missing (the ``[inprocess]`` extra named), or a launcher that kills every worker when one
  exits (plain torchrun: the command to use instead).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psutil

from tenplex_megatron import _optional, mcore_versions
from tenplex_megatron import log as tlog
from tenplex_megatron.flags import FlagError
from tenplex_megatron.frontdoor import gloo_abort

log = tlog.get("inprocess")

STORE_ENV = "TENPLEX_INPROCESS_STORE"  # host:port of the job's store, set by tenplex_megatron.frontdoor.launch
NVRX_STORE_OFFSET = 1  # NVRx's own store listens on the job store's port + 1 (both served by the launcher)
LAUNCH = "python -m tenplex_megatron.frontdoor.launch"


@dataclass(frozen=True)
class InprocessSettings:
    """The in-process restart's timeouts (seconds). ``timeout`` bounds a collective's wait on a peer (the gloo or
    NCCL timeout): a wait on a hung peer returns only then (one on a dead peer ends at the abort), so it is the
    slowest detection; NVRx's soft timeout (no progress) is set above it and its hard timeout (the rank is ended)
    above that."""

    timeout: float = 60.0
    interval: float = 0.25  # NVRx's monitoring and heartbeat intervals

    def __post_init__(self) -> None:
        if not self.timeout > 4 * self.interval:
            raise FlagError(f"--tenplex-inprocess-timeout must be > {4 * self.interval:g} seconds (four monitoring "
                            f"intervals), got {self.timeout:g}")

    @property
    def soft(self) -> float:
        return self.timeout * 1.5

    @property
    def hard(self) -> float:
        return self.timeout * 2.0

    @property
    def barrier(self) -> float:
        return self.timeout * 3.0


def nvrx() -> Any:
    """NVRx's ``inprocess`` package, or :class:`~tenplex_megatron._optional.MissingExtraError` naming the extra."""
    return _optional.require("nvidia_resiliency_ext.inprocess", "inprocess", "--tenplex-inprocess",
                             "NVIDIA Resiliency Extension's in-process restart (0.4.1 tested)")


def checked_settings(prog: str, timeout: float) -> InprocessSettings:
    """Both front doors' start-up checks after the launcher's: NVRx installed and the timeout usable, else
    ``SystemExit`` naming the extra or the flag (before any process group)."""
    try:
        mcore_versions.check_nvrx()
        nvrx()
    except (_optional.MissingExtraError, mcore_versions.NVRxMismatchError) as e:
        raise SystemExit(f"{prog}: error: {e}") from None
    return timeouts(prog, timeout)


def timeouts(prog: str, timeout: float) -> InprocessSettings:
    """The timeouts alone (a planned re-form needs no NVRx), else ``SystemExit`` naming the flag."""
    try:
        return InprocessSettings(timeout=timeout)
    except ValueError as e:
        raise SystemExit(f"{prog}: error: {e}") from None


def store_address() -> tuple[str, int] | None:
    """The job's store (host, port) that the in-process launcher serves, or None when not under it."""
    value = os.environ.get(STORE_ENV)
    if not value:
        return None
    host, _, port = value.rpartition(":")
    return host or "127.0.0.1", int(port)


def refusal(prog: str, argv: list[str], flag: str = "--tenplex-inprocess") -> str | None:
    """Why this process cannot run in place (None: it can): not started by the in-process launcher, which serves
    the stores and keeps the survivors running when a rank exits. Names ``flag`` and the command to use."""
    if store_address() is not None:
        return None
    nproc = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or "N"
    under = "torchrun, which ends every worker when one exits," if os.environ.get("TORCHELASTIC_RUN_ID") else \
        "a launcher that does not serve the job's stores outside the ranks"
    return (f"{prog}: error: {flag} needs the survivors of a fault to keep running and the stores to "
            f"outlive any rank; it was started under {under}. Start it with: {LAUNCH} --nproc-per-node {nproc} "
            f"{prog} {' '.join(argv)}")


def durable_only(save: str | None, save_interval: int | None) -> str:
    """The warning for ``--tenplex-inprocess`` without ``--tenplex-memory``: which iterations a fault loses."""
    if not save:
        return ("--tenplex-inprocess without --tenplex-memory and without --save: after a fault the survivors start "
                "again from the beginning (every iteration trained so far is lost)")
    every = f"every {save_interval} iterations" if save_interval else "only at the end"
    return (f"--tenplex-inprocess without --tenplex-memory: after a fault the survivors load the newest durable "
            f"checkpoint of {save} (saved {every}): the iterations trained since it are lost and trained again")


def admitted(ranks: int, legal: Callable[[int], bool]) -> int:
    """The largest world size <= ``ranks`` with a legal layout (0: none); the ranks above it wait as spares."""
    for n in range(ranks, 0, -1):
        if legal(n):
            return n
    return 0


def _client_store_class() -> type:
    """NVRx's store as a client of the launcher's server (no rank hosts it): a TCPStore with NVRx's mixin."""
    import torch.distributed as dist

    inprocess = nvrx()

    class ClientStore(dist.TCPStore, inprocess.store.StoreMixin):  # type: ignore[misc, name-defined]
        """NVRx's internal store, served by the launcher; ``port`` from NVRx's ``store_kwargs``."""

        def __init__(self, port: int, timeout: timedelta = timedelta(seconds=300)) -> None:
            host, _ = store_address() or ("127.0.0.1", port)
            super().__init__(host, port, None, False, timeout=timeout, wait_for_workers=False, use_libuv=True)

    return ClientStore


def job_store(timeout: float) -> Any:
    """A client of the job's store (the process groups of every restart are made on a prefix of it)."""
    import torch.distributed as dist

    host, port = store_address() or ("127.0.0.1", 0)
    return dist.TCPStore(host, port, None, False, timeout=timedelta(seconds=timeout), wait_for_workers=False,
                         use_libuv=True)


def end_aborted_call() -> None:
    """In a survivor after a fault, before the next call: end the memory-tier helper processes the aborted call
    started (children of this process running ``tenplex_megatron.memory.helper``). The aborted process group's
    subgroups went with it (NVRx's abort destroys the world)."""
    for child in psutil.Process().children():
        try:
            if "tenplex_megatron.memory.helper" in " ".join(child.cmdline()):
                child.kill()
                child.wait(timeout=10)
        except (psutil.NoSuchProcess, psutil.TimeoutExpired):
            pass


def wrapper(settings: InprocessSettings, legal: Callable[[int], bool], *,
            finalize: Callable[[], None] | None = None, logfile: str | None = None,
            why_not: Callable[[int], str] = lambda n: "", active: int | None = None,
            abort_outer: Sequence[Any] = (), abort_inner: Sequence[Any] = (), health_check: Any = None) -> Any:
    """NVRx's ``Wrapper`` for a job whose world may shrink to any size ``legal`` admits (:func:`admitted`); the
    stores are the launcher's; ``finalize`` runs in each survivor after a fault, before the next call. ``active``
    (default: every rank) is how many ranks train at most, the rest waiting as spares that replace lost ranks
    first. With no legal world left, every rank's wrapper ends (NVRx's ``RestartAbort``, see
    :func:`no_layout_left`), the error naming the ranks left and ``why_not`` their world size. A front door adds
    its framework's own protections: NVRx aborts run after the process groups are aborted (``abort_outer``) or
    before (``abort_inner``), and a ``health_check``."""
    inprocess = nvrx()
    ra = inprocess.rank_assignment
    _, port = store_address() or ("127.0.0.1", 0)
    world = int(os.environ["WORLD_SIZE"])
    active = world if active is None else min(active, world)

    def world_size_filter(n: int) -> int:
        m = admitted(n, legal)
        if m == 0:
            log.error("in place: %d rank(s) left and no legal layout at any world size up to it (world size %d: "
                      "%s): the job ends here so that a scheduler-level restart can take over", n, n, why_not(n))
            return 0  # NVRx's RetryController ends every rank's wrapper (RestartAbort)
        if m != n:
            log.warning("in place: %d rank(s) left; %d admitted (the largest world size with a legal layout), "
                        "%d waiting as spare(s)", n, m, n - m)
        return m

    class EndPendingGloo(inprocess.abort.Abort):  # type: ignore[misc, name-defined]
        def __call__(self, state: Any) -> Any:
            gloo_abort.end_pending_gloo((port, port + NVRX_STORE_OFFSET))  # NCCL's own abort ends its waits
            return state

    class Finalize(inprocess.finalize.Finalize):  # type: ignore[misc, name-defined]
        def __call__(self, state: Any) -> Any:
            if finalize is not None:
                finalize()
            return state

    iv = timedelta(seconds=settings.interval)
    return _without_device_checks(inprocess.Wrapper(
        store_factory=_client_store_class(),
        store_kwargs={"port": port + NVRX_STORE_OFFSET, "timeout": timedelta(seconds=settings.barrier)},
        initialize=inprocess.initialize.RetryController(min_world_size=1),
        finalize=Finalize(),
        # run right to left: the pending gloo operations ended first, then the process groups destroyed
        abort=inprocess.Compose(*abort_outer, inprocess.abort.AbortTorchDistributed(), *abort_inner, EndPendingGloo()),
        health_check=health_check,
        rank_assignment=ra.Tree([ra.Layer(min_ranks=1, max_ranks=active, flag=ra.LayerFlag.RESERVE)],
                                world_size_filter=world_size_filter),
        monitor_thread_interval=iv, monitor_process_interval=iv, progress_watchdog_interval=iv,
        heartbeat_interval=iv, last_call_wait=iv,
        heartbeat_timeout=timedelta(seconds=settings.timeout),
        soft_timeout=timedelta(seconds=settings.soft),
        hard_timeout=timedelta(seconds=settings.hard),
        barrier_timeout=timedelta(seconds=settings.barrier),
        completion_timeout=timedelta(seconds=settings.barrier),
        termination_grace_time=timedelta(seconds=1),
        monitor_process_logfile=logfile,
    ), health_check)


def _without_device_checks(wrapped: Any, health_check: Any) -> Any:
    """NVRx's ``wrapped`` with only the caller's restart health check on a machine without CUDA: from 0.6 NVRx chains
    its GPU, NVLink and NIC checks (NVML) onto it wherever ``LOCAL_RANK`` is set, and with no GPU they fail every
    restart (``HealthCheckError``); 0.4.1 has no such chain (no ``restart_health_check``). On a GPU they stay."""
    import torch

    if hasattr(wrapped, "restart_health_check") and not torch.cuda.is_available():
        wrapped.restart_health_check = health_check
    return wrapped


def monitor_logfile(prog: str, rank: int) -> str | None:
    """NVRx's monitor process log of ``rank`` under ``TENPLEX_INPROCESS_LOGDIR`` (made if missing), None unset. A
    directory that cannot be made is refused here: NVRx's monitor would fail to open its log and the ranks hang."""
    logdir = os.environ.get("TENPLEX_INPROCESS_LOGDIR")
    if not logdir:
        return None
    try:
        os.makedirs(logdir, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"{prog}: error: TENPLEX_INPROCESS_LOGDIR={logdir}: cannot make the directory for NVRx's "
                         f"monitor logs ({e.strerror})") from None
    return os.path.join(os.path.abspath(logdir), f"nvrx-monitor-{rank}.log")


def no_layout_left(error: BaseException) -> bool:
    """Whether NVRx's wrapper ended because no legal world was left (its ``RestartAbort``)."""
    return type(error).__name__ == "RestartAbort" or type(error.__cause__).__name__ == "RestartAbort"
