"""Megatron-LM's ``pretrain_gpt.py`` with ``--tenplex`` re-formed in place on plan (the launcher's ``--reform``, its
newcomers' ``--join``): the job grows when a launcher joins and shrinks when one is told to leave (SIGTERM), in the
same processes, without NVRx.

The hook replaces the function ``pretrain_gpt.py`` calls to wrap ``pretrain`` (``maybe_wrap_for_inprocess_restart``)
by :func:`wrap`: ``pretrain`` is called once per generation of the job's membership by the runner every front door
shares (:mod:`~tenplex_megatron.frontdoor.reform_runner`), with ``RANK``/``WORLD_SIZE`` set for that world and a
store on a new prefix; Megatron-LM parses its flags again in each call (up to core_v0.17 in ``pretrain``; from
core_v0.18 ``pretrain_gpt.py``'s flag reading, which the patch hands over as :class:`PerCall`), the hook's
``validate_args`` chooses the layout for the world, its ``load_checkpoint`` restores the newest snapshot from the
ranks' host memory (a newcomer's part from its peers'). At every iteration boundary :func:`boundary_exit` (around
Megatron-LM's ``checkpoint_and_decide_exit``) asks the membership whether the world changes; when it does, the
iteration is snapshotted (unless it just was) and Megatron-LM's loop exits as on ``--exit-interval``; its
``sys.exit(0)`` ends the call, Megatron-LM's global state and the hook's Checkpointer are torn down and the next
generation starts. A newcomer registers and waits for its first world before ``pretrain_gpt.py`` reads its flags.
A member lost meanwhile ends the call with its peers' failed collective: the survivors tear the call down and agree
on the next world (:mod:`~tenplex_megatron.frontdoor.reform_fault`), as the reference trainer's do.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tenplex_megatron import log as tlog
from tenplex_megatron.frontdoor import inprocess, reform_fault, reform_runner
from tenplex_megatron.frontdoor.membership import REFORM_ENV, Generation, Membership, MembershipError, member_id
from tenplex_megatron.storage import faults

_log = tlog.get("megatron_lm")
PROG = "pretrain_gpt.py"


@dataclass(frozen=True)
class PerCall:
    """core_v0.18+: ``pretrain``'s first argument made anew for each call (``make``: ``pretrain_gpt.py``'s flag
    reading and config building, the patch's), so that a call at another world size parses its own flags."""

    make: Callable[[], Any]


def per_call(make: Callable[[], Any]) -> Any:
    """What ``pretrain_gpt.py`` (core_v0.18+, patched) hands ``pretrain`` as its config: made now, as the stock
    script does, unless the job re-forms in place (then :class:`PerCall`, made at each generation by :func:`wrap`)."""
    return PerCall(make) if os.environ.get(REFORM_ENV) else make()


def started(boundary: reform_runner.Boundary | None) -> None:
    """A re-formed generation's load (its process group made, the model built): where the tests lose a member
    (``TENPLEX_FAULT``'s ``reform.start``, as the reference trainer's); nothing when not re-forming."""
    if boundary is not None:
        import torch

        faults.maybe_fail("reform.start", torch.distributed.get_rank(), boundary.gen.number)


def wanted() -> bool:
    """Whether this process was started by the launcher's ``--reform``/``--join``."""
    return bool(os.environ.get(REFORM_ENV))


def refusal(args: Any, argv: list[str]) -> str | None:
    """Why this Megatron-LM job cannot re-form in place (None: it can), naming the flag."""
    if inprocess.store_address() is None:
        return f"{PROG}: error: {REFORM_ENV} is set only by {inprocess.LAUNCH} --reform (or --join), which serves " \
               "the job's store"
    if getattr(args, "inprocess_restart", False) or "--inprocess-restart" in argv:
        return f"{PROG}: error: --inprocess-restart (NVRx) and the launcher's --reform are two ways of re-forming " \
               "in place: give one"
    if not getattr(args, "tenplex", False) or not getattr(args, "tenplex_memory", None):
        return f"{PROG}: error: the launcher's --reform needs --tenplex and --tenplex-memory (the next world " \
               "restores from the ranks' host memory)"
    if not getattr(args, "load", None):
        return f"{PROG}: error: the launcher's --reform needs --load (empty on the first start): without it " \
               "Megatron-LM never calls load_checkpoint and the next world would start again from iteration 0"
    return None


def boundary_exit(original: Callable[..., bool], boundary: Callable[[], reform_runner.Boundary | None]) \
        -> Callable[..., bool]:
    """Megatron-LM's ``checkpoint_and_decide_exit`` and then, re-forming, the membership's boundary (collective):
    True (Megatron-LM's loop exits) when the world changes after this iteration, which is snapshotted first unless
    ``--save-interval`` just did."""

    def checkpoint_and_decide_exit(model: Any, optimizer: Any, opt_param_scheduler: Any, iteration: int,
                                   flops: float, checkpointing_context: Any, train_data_iterator: Any,
                                   *a: Any, **kw: Any) -> bool:
        out = original(model, optimizer, opt_param_scheduler, iteration, flops, checkpointing_context,
                       train_data_iterator, *a, **kw)
        b = boundary()
        if out or b is None or not b():
            return out
        import megatron.training.training as train_mod
        from megatron.training import get_args

        args = get_args()
        if args.save and not (args.save_interval and iteration % args.save_interval == 0):
            train_mod.save_checkpoint_and_time(iteration, model, optimizer, opt_param_scheduler, flops,
                                               checkpointing_context, train_data_iterator=train_data_iterator)
        assert b.next is not None
        _log.info("the world changes: re-forming after iteration %d (generation %d: %d rank(s))", iteration,
                  b.next.number, len(b.next.members))
        return True

    return checkpoint_and_decide_exit


def teardown(close: Callable[[], None]) -> None:
    """After a generation's call (its process group destroyed): Megatron-LM's global state destroyed as its own
    in-process restart does (``inprocess_restart.destroy_state``), then the hook's Checkpointer closed (``close``)."""
    from megatron.training.inprocess_restart import destroy_state

    destroy_state()
    close()


def wrap(pretrain: Callable[..., Any], args: Any, argv: list[str], reason: Callable[[int], str], hook: Any,
         flags: Mapping[str, Any] | None = None) -> tuple[Callable[..., Any], None]:
    """``pretrain`` called once per generation (:mod:`~tenplex_megatron.frontdoor.reform_runner`), and the store
    ``pretrain_gpt.py`` passes on (None: each call is given its generation's). Refused (``SystemExit`` naming why)
    where the job cannot re-form; a newcomer is registered and admitted here, before the script reads its flags.
    ``hook``: the installed hook (its ``boundary`` set during a call, its Checkpointer closed after it); ``flags``:
    the job's defining flags (:func:`~tenplex_megatron.frontdoor.reform_runner.job_flags`), a newcomer refused
    before it registers where its own differ."""
    problem = refusal(args, argv)
    if problem:
        raise SystemExit(problem)
    settings = inprocess.timeouts(PROG, args.tenplex_inprocess_timeout)
    members, me = Membership(inprocess.job_store(settings.barrier), settings.barrier), member_id()
    try:
        first = reform_runner.first_generation(members, me, flags, PROG)
    except MembershipError as e:
        raise SystemExit(f"{PROG}: error: {e}") from None
    if first is not None:  # the flags pretrain_gpt.py reads next are this world's
        os.environ.update(RANK=str(first.rank(me)), WORLD_SIZE=str(len(first.members)))

    def run(*a: Any, **kw: Any) -> None:
        if first is None:
            reform_runner.say(f"re-form: {me}: the job ended before admitting it")
            return

        def one(gen: Generation, store: Any, boundary: reform_runner.Boundary) -> None:
            hook.boundary = boundary
            boundary.first = lambda: hook.checkpointer.start_background() if hook.checkpointer is not None else None
            call_args = (a[0].make(), *a[1:]) if a and isinstance(a[0], PerCall) else a
            try:
                pretrain(*call_args, **{**kw, "store": store})
            except SystemExit as e:  # Megatron-LM's loop exits with sys.exit(0) where the world changes
                if boundary.next is None or e.code not in (0, None):
                    raise
            finally:
                hook.boundary = None

        def recover(gen: Generation, error: BaseException) -> Generation | None:  # a member lost
            reform_fault.end_generation()  # the helpers and the broken group ended before Megatron-LM's teardown
            teardown(hook.close)
            return reform_fault.after_fault(members, gen, me, lambda n: not reason(n), settings.timeout, error)

        reform_runner.run(PROG, members, me, lambda n: not reason(n), one, lambda: teardown(hook.close), first,
                          recover=recover)

    return run, None
