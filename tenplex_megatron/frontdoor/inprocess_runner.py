"""The one in-place runner of fault-driven restarts (NVRx's in-process restart: the reference trainer's
``--tenplex-inprocess``, Megatron-LM's ``--inprocess-restart --tenplex``), shared by every front door as
:mod:`~tenplex_megatron.frontdoor.reform_runner` is for planned re-forms.

Each call of NVRx's wrapper is one world: the call said (with this process's initial rank and pid), the job's
leases checked (another job took a directory over: exit 3), the front door's call made with a store on the prefix
``tenplex-inprocess/<call>`` (it makes its process group there, builds its job, restores from host memory and
trains), then the process group destroyed (:func:`~tenplex_megatron.frontdoor.reform_runner.session`). With no
legal world left the wrapper's end is turned into exit 2; at the job's clean end the leases are given back.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from tenplex_megatron.frontdoor import inprocess, inprocess_lease, reform_runner
from tenplex_megatron.storage.lease import LeaseSet

#: a front door's part of one call: given the call's number and the store its process group is made on, and the
#: arguments the wrapped function was called with
OneCall = Callable[..., Any]


def wrapped(prog: str, wrapper: Any, leases: LeaseSet, store: Any, one: OneCall,
            say: Callable[[int, str], None], no_layout: Callable[[], None]) -> Callable[..., Any]:
    """``one`` inside NVRx's ``wrapper`` (:func:`~tenplex_megatron.frontdoor.inprocess.wrapper`), once per call;
    ``say(call, line)`` tells each call, ``no_layout`` says that no legal world was left (then exit 2)."""
    initial, pid = int(os.environ["RANK"]), os.getpid()

    def call(*a: Any, call_wrapper: Any = None, **kw: Any) -> Any:
        it = call_wrapper.iteration
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        say(it, f"in place: call {it}: rank {rank} of {world} (initial rank {initial}, pid {pid})")
        inprocess_lease.check_kept(leases, prog)  # another job took a directory over: this rank stops (exit 3)
        return reform_runner.session(store, f"tenplex-inprocess/{it}", lambda s: one(it, s, *a, **kw))

    # NVRx passes its CallWrapper to the parameter annotated with that class, and checks every parameter's
    # annotation as a class: only that one, a real class (not this module's postponed string annotations)
    call.__annotations__ = {"call_wrapper": inprocess.nvrx().CallWrapper}
    inner = wrapper(call)

    def run(*a: Any, **kw: Any) -> Any:
        try:
            out = inner(*a, **kw)
        except BaseException as e:  # the wrapper's own end: no legal world left (logged with every reason)
            if not inprocess.no_layout_left(e):
                raise
            no_layout()
            raise SystemExit(2) from None
        inprocess_lease.release(leases)
        return out

    return run
