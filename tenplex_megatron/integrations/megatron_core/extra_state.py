"""Transformer Engine's ``_extra_state`` (FP8 scaling factors and amax history), kept per rank.

A module's ``_extra_state`` is torch's generic protocol (``get_extra_state`` / ``set_extra_state``); TE implements
it returning its FP8 metadata serialized into a uint8 tensor (older TE: an ``io.BytesIO``), and megatron-core turns
every ``*._extra_state`` key into a ``ShardedObject``. Such state is not a tensor that can be re-sharded: it is the
rank's own. So each rank saves the raw bytes of its modules' extra state as rank-local entries of its own file
(``engine/rank_local.py``), and a load at the same layout, with the same modules, hands every module its bytes back
exactly. TE's own ``set_extra_state`` unpickles them (``pickle.loads``; the older io.BytesIO kind with
``torch.load``), so a checkpoint's bytes could run code there: before any is handed over, each is unpickled here
with a restricted unpickler (``storage/pickles.py``: tensors, numbers, strings, containers, TE's recipe classes),
and when one names anything else none is handed over, with the warning below, unless the job trusts the
checkpoint (``--tenplex-trust-pickles``). At another layout (or from a checkpoint without them) they are left out
with one warning: with FP8, the scaling factors and amax history re-warm over the next iterations. megatron-core's
own linear layers return None: nothing to keep there.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tenplex_megatron import log as tlog
from tenplex_megatron.engine.rank_local import PREFIX, saved_entries
from tenplex_megatron.integrations.megatron_core.sharded import unwrap
from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.storage.files import CheckpointFileError
from tenplex_megatron.storage.pickles import why_unsafe_extra_state
from tenplex_megatron.storage.source import Metadata

log = tlog.get("megatron_core")
KINDS = ("tensor", "bytesio", "bytes")
#: what re-warms when the state is left out, said in every warning
REWARMS = "with FP8, the scaling factors and amax history re-warm over the next iterations"
#: set on a module whose extra state is of a kind not saved, once that was logged (once per module, not per save)
UNSAVED_WARNED = "_tenplex_extra_state_unsaved_warned"


def entry_name(chunk: int, module: str) -> str:
    """The rank-local entry of model chunk ``chunk``'s module ``module`` (its ``named_modules()`` name)."""
    return f"{PREFIX}model{chunk}.{module}._extra_state"


def _modules(job: Any) -> Iterator[tuple[int, str, torch.nn.Module]]:
    """Every module of every model chunk that implements torch's extra-state protocol itself."""
    for i, model in enumerate(job.model):
        for name, module in unwrap(model).named_modules():
            if type(module).get_extra_state is not torch.nn.Module.get_extra_state:
                yield i, name, module


def encode(value: Any, where: str, warn: bool = True) -> tuple[torch.Tensor, dict[str, Any]] | None:
    """A module's extra state as flat uint8 bytes and the record that gives it back (None: nothing to keep, or a
    kind tenplex does not store without pickling, which is logged if ``warn``)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous()
        flat = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        rec = {"kind": "tensor", "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
    elif isinstance(value, io.BytesIO | bytes | bytearray):
        raw = value.getvalue() if isinstance(value, io.BytesIO) else bytes(value)
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        rec = {"kind": "bytesio" if isinstance(value, io.BytesIO) else "bytes"}
    else:
        if warn:
            log.warning("%s: extra state of type %s is not saved (tenplex keeps tensors and bytes only, never a "
                        "pickle)", where, type(value).__name__)
        return None
    return flat, {**rec, "nbytes": int(flat.numel())}


def decode(data: torch.Tensor, rec: dict[str, Any], where: str) -> Any:
    """The value ``set_extra_state`` gets back: the saved tensor (same dtype and shape), bytes or a BytesIO."""
    kind = rec.get("kind")
    if kind == "tensor":
        dtype = getattr(torch, str(rec.get("dtype")), None)
        if not isinstance(dtype, torch.dtype):
            raise CheckpointFileError(f"{where}: metadata.json records extra state of dtype {rec.get('dtype')!r}")
        shape = tuple(int(n) for n in rec.get("shape", ()))
        return data.view(dtype).reshape(shape) if data.numel() else torch.empty(shape, dtype=dtype)
    if kind in ("bytes", "bytesio"):
        raw = data.numpy().tobytes()
        return io.BytesIO(raw) if kind == "bytesio" else raw
    raise CheckpointFileError(f"{where}: metadata.json records extra state of kind {kind!r} (expected one of {KINDS})")


def collect(job: Any) -> dict[str, tuple[torch.Tensor, dict[str, Any]]]:
    """This rank's extra state to save: entry name -> (flat uint8 bytes, record)."""
    out = {}
    for chunk, name, module in _modules(job):
        where = entry_name(chunk, name).removeprefix(PREFIX)
        value = module.get_extra_state()
        got = encode(value, where, warn=not getattr(module, UNSAVED_WARNED, False))
        if got is None and value is not None:
            setattr(module, UNSAVED_WARNED, True)
        if got is not None:
            out[entry_name(chunk, name)] = (got[0], {**got[1], "chunk": chunk, "module": name})
    return out


def _layout(saved: Any) -> str:
    """A saved layout as the trainer prints one (tp=2,pp=1,dp=1), or as recorded if it does not parse."""
    try:
        return str(ParallelLayout.from_json(saved))
    except (TypeError, ValueError, KeyError, AttributeError):
        return str(saved)


def _warn_dropped(names: list[str], why: str, every_rank: bool = False) -> None:
    """One line per load (rank 0 logs it as a warning; other ranks below the level they show, unless
    ``every_rank``: a reason this rank alone may have)."""
    level = logging.WARNING if every_rank or tlog.rank() == 0 else logging.DEBUG
    first = names[0].removeprefix(PREFIX)
    log.log(level, "Transformer Engine's _extra_state of %d module(s) on this rank (%s, ...) is not restored: %s; "
            "%s", len(names), first, why, REWARMS)


def _refused(raw: dict[str, torch.Tensor], saved: dict[str, dict[str, Any]]) -> dict[str, str]:
    """The entries whose bytes the restricted unpickler refuses (``storage/pickles.py``), each with why: a module's
    ``set_extra_state`` would unpickle them (TE's does: ``pickle.loads``, or ``torch.load`` of the BytesIO kind)."""
    out = {}
    for k, data in raw.items():
        why = why_unsafe_extra_state(data.numpy().tobytes(), saved[k].get("kind") == "bytesio") if data.numel() \
            else None
        if why is not None:
            out[k] = why
    return out


def prepare(job: Any, metadata: Metadata, read: Callable[[str], torch.Tensor],
            rank: int) -> Callable[[], None] | None:
    """At load, before any tensor is copied: read back this rank's saved extra state when it applies (the saved
    layout is the job's and the saved rank held the same modules), checked, and its pickles checked unless
    ``job.trust_pickles``; returns what hands it to the modules."""
    live = {entry_name(c, n): m for c, n, m in _modules(job)}
    saved = {k: v for k, v in (saved_entries(metadata.rank_local, rank) or {}).items() if k.endswith("._extra_state")}
    have = sorted(k for k, m in live.items() if m.get_extra_state() is not None)
    if not saved:
        if have and not metadata.rank_local:
            _warn_dropped(have, "the checkpoint holds none (not a tenplex save of it)")
        return None
    if metadata.layout != job.layout.to_json():
        _warn_dropped(sorted(saved), f"saved at layout {_layout(metadata.layout)}, loaded at {job.layout}")
        return None
    missing = sorted(set(saved) - set(live))
    if missing:
        _warn_dropped(missing, "this model has no such module (the model's module paths changed)")
        return None
    raw = {k: read(k) for k in saved}
    refused = {} if getattr(job, "trust_pickles", False) else _refused(raw, saved)
    if refused:
        first = min(refused)
        _warn_dropped(sorted(saved), f"the bytes of {first.removeprefix(PREFIX)} are a pickle that could run code when "
                      f"the module unpickles them ({refused[first]}); pass --tenplex-trust-pickles only for a "
                      "checkpoint you trust", every_rank=True)
        return None
    values = {k: decode(raw[k], rec, k.removeprefix(PREFIX)) for k, rec in saved.items()}

    def apply() -> None:
        for k, value in values.items():
            live[k].set_extra_state(value)
        log.info("Transformer Engine's _extra_state of %d module(s) restored exactly (same layout)", len(values))

    return apply
