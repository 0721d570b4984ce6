"""A member lost while a re-forming job (the launcher's ``--reform``) trained or re-formed: the survivors end the
generation's process group and agree on the next world in the job's store
(:mod:`tenplex_megatron.frontdoor.membership_recovery`), then train on at it from host memory.

Without NVRx: a lost member is seen as its peers' failed collective (a gloo connection closed by the dead process,
the others' waits ended by each survivor shutting its own gloo connections down, :mod:`~tenplex_megatron.frontdoor.
gloo_abort`). A hung member is not detected before the collective timeout (``--tenplex-inprocess-timeout``).
"""

from __future__ import annotations

import contextlib
import os

import torch

from tenplex_megatron.frontdoor import gloo_abort, inprocess, membership_recovery
from tenplex_megatron.frontdoor.membership import Generation, Membership
from tenplex_megatron.frontdoor.reform_runner import say


def end_generation() -> None:
    """This survivor's side of a failed generation: pending gloo waits ended, the process group destroyed, the
    memory tier's helper processes of the failed call ended."""
    _, port = inprocess.store_address() or ("127.0.0.1", 0)
    if torch.distributed.is_initialized():
        with contextlib.suppress(Exception):  # a broken group: whatever is left of it goes
            gloo_abort.end_pending_gloo((port, port + inprocess.NVRX_STORE_OFFSET))
        with contextlib.suppress(Exception):
            torch.distributed.destroy_process_group()
    inprocess.end_aborted_call()


def settle_seconds(timeout: float) -> float:
    """How long the first survivor waits for the others to report (a quarter of the collective timeout, at most
    5 s: a survivor's failed collective ends within a second of the fault's once its peers shut theirs down)."""
    return min(5.0, timeout / 4)


def after_fault(members: Membership, gen: Generation, me: str, legal: object, timeout: float,
                error: BaseException) -> Generation | None:
    """Generation ``gen`` failed in this process with ``error``: the generation to train at next (one that leaves
    ``me`` out: ``me`` leaves on its notice), a later one that admits ``me`` (a spare, registered again), or None
    (the job ended before it did). ``error`` is raised again when the survivors abort (no member was lost, or no
    legal world is left)."""
    say(f"re-form: generation {gen.number} failed on {me} ({type(error).__name__}: "
         f"{str(error).splitlines()[0] if str(error) else ''}); agreeing on the members left")
    end_generation()
    d = membership_recovery.recover(members, gen, me, legal, settle_seconds(timeout))  # type: ignore[arg-type]
    if d.gen is None:
        members.end()
        say(f"re-form: no recovery after generation {gen.number}: {d.why}")
        raise error
    gone, _ = membership_recovery.leaving(members, gen)
    if me in d.gen.members or me in gone:
        return d.gen
    members.register(me)  # a spare (no legal layout with it) or reported too late: a newcomer again
    say(f"re-form: {me} waits as a spare from generation {d.gen.number} on (pid {os.getpid()})")
    return members.admitted(me, first=d.gen.number + 1)
