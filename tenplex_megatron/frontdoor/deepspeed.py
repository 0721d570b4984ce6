"""DeepSpeed's front door (``tenplex_megatron.deepspeed``): ``save_checkpoint`` / ``load_checkpoint`` beside
``engine.save_checkpoint`` / ``engine.load_checkpoint``, through a
:class:`~tenplex_megatron.frontdoor.checkpointer.Checkpointer` as behind the other front doors.

A save claims its directory's lease (one writer per directory, ``storage/lease.py``: another live job's directory
is refused on every rank, naming it and its holder, before anything is written); a load of the newest checkpoint
falls back past a damaged copy to the previous, naming it (``frontdoor/resume.py``); DeepSpeed's own
``global_stepN`` checkpoints, written at any DP size, are read in place (``integrations/deepspeed/native.py``); under
torchrun a worker dies with its agent (``engine/orphan.py``). A training loop that saves again and again passes one
``checkpointer`` (:func:`open_checkpointer`) and closes it at the end; without one each call builds its own and
closes it after (the lease released at once, taken again by the next save). Nothing is kept on the user's engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NoReturn

from tenplex_megatron.engine import orphan
from tenplex_megatron.engine.load import LoadResult, load
from tenplex_megatron.engine.save import SaveResult, save
from tenplex_megatron.errors import TenplexError
from tenplex_megatron.execute.collective import run_phase
from tenplex_megatron.frontdoor.checkpointer import Checkpointer, load_for_api, save_for_api
from tenplex_megatron.integrations.deepspeed import native
from tenplex_megatron.integrations.deepspeed.adapter import DeepSpeedAdapter
from tenplex_megatron.plan.megatron_ckpt_flags import LoadScope, Retention, SaveScope
from tenplex_megatron.storage import formats, lease
from tenplex_megatron.storage.checkpoint_metadata import CheckpointMetadata

PROG = "tenplex_megatron.deepspeed"


class NoDeepSpeedCheckpointError(TenplexError, FileNotFoundError):
    """DeepSpeed's ``load_checkpoint``: the directory holds neither a complete tenplex checkpoint nor DeepSpeed's own.

    Megatron's own checkpoint there, or a Hugging Face start, is not a DeepSpeed engine's to load."""


def _refuse(what: str, message: str) -> NoReturn:
    """Collective: raise ``message`` on every rank, as a load that finds nothing raises it (``run_phase``)."""
    def fail() -> None:
        raise NoDeepSpeedCheckpointError(message)

    run_phase(what, fail)  # raises what fail() raised, on every rank
    raise NoDeepSpeedCheckpointError(message)


@dataclass(frozen=True)
class DeepSpeedEngine:
    """A user's DeepSpeed engine (``engine``) as the Checkpointer's
    :class:`~tenplex_megatron.frontdoor.resume.Engine`: tenplex's checkpoints only (``where``: the load directory,
    named in errors; ``verify``, ``seed`` and ``client_state`` as the call passed them)."""

    engine: Any
    where: str = ""
    verify: bool = True
    seed: int = 1234
    client_state: dict[str, Any] = field(default_factory=dict)

    def adapter(self, scope: SaveScope | None = None) -> DeepSpeedAdapter:
        """A fresh adapter over the engine (each load, each save; ``scope``: a DeepSpeed engine always saves it all,
        and its front doors take no flag that narrows it)."""
        return DeepSpeedAdapter(self.engine, self.seed, dict(self.client_state), where=self.where)

    def load(self, path: str, scope: LoadScope | None = None,
             metadata: CheckpointMetadata | None = None) -> LoadResult:
        """Collective: tenplex's checkpoint ``path`` into the engine, re-sharded (``metadata``: its record, read
        already)."""
        return load(self.adapter(), path, None, strict=True, verify=self.verify, scope=scope, metadata=metadata)

    def adopt(self, path: str, scope: LoadScope | None = None) -> LoadResult:
        """Refused on every rank: Megatron's own checkpoint ``path`` is not a DeepSpeed engine's."""
        _refuse(f"load from {self.where or path}",
                f"no complete tenplex checkpoint under {self.where or path}: {path} is Megatron's own checkpoint, "
                "which a DeepSpeed engine cannot load")

    def init_hf(self, hf_dir: str) -> Any:
        """Refused on every rank: a DeepSpeed engine starts from no Hugging Face checkpoint here."""
        _refuse(f"load from {self.where or hf_dir}",
                f"no complete tenplex checkpoint under {self.where or hf_dir}: a DeepSpeed engine is not started "
                f"from the Hugging Face checkpoint {hf_dir}")

    def save(self, save_dir: str, keep: int | Retention | None, scope: SaveScope,
             fence: lease.Fence = lease.no_fence) -> SaveResult:
        """Collective: the engine's full state under ``save_dir/iter_NNNNNNN`` (N = global steps), committed
        (``scope``: a DeepSpeed engine always saves it all)."""
        return save(self.adapter(), save_dir, keep, fence=fence)


def open_checkpointer() -> Checkpointer:
    """A Checkpointer for a training loop's calls (``checkpointer=``): each save directory claimed at its first save
    and held until :meth:`~Checkpointer.close` (or the end of a ``with`` block)."""
    return Checkpointer.for_api(PROG)


def claim_save_dir(save_dir: str, job_id: str | None = None, take_over: bool = False,
                   ttl: float = lease.DEFAULT_TTL, *, checkpointer: Checkpointer | None = None) -> None:
    """Collective: rank 0 takes ``save_dir``'s lease for ``job_id`` (default: the launch's id, as the trainers derive
    it), the other ranks check it; another live job's lease is refused on every rank, naming the directory and its
    holder, before anything is written. With ``checkpointer``: once, held until it is closed; without: a check that
    the directory may be written now (the lease released at once)."""
    ckpt = checkpointer if checkpointer is not None else open_checkpointer()
    try:
        ckpt.claim_dir(save_dir, job_id, take_over, ttl)
    finally:
        if checkpointer is None:
            ckpt.close()


def save_checkpoint(engine: Any, save_dir: str, client_state: dict[str, Any] | None = None,
                    keep: int | None = None, *, job_id: str | None = None, take_over: bool = False,
                    checkpointer: Checkpointer | None = None) -> SaveResult:
    """Collective: write the engine's full state under ``save_dir/iter_NNNNNNN`` (N = global steps) and commit it.

    The save claims ``save_dir``'s lease first (:func:`claim_save_dir`): ``job_id`` names this job
    (``--tenplex-job-id``), ``take_over`` takes a lease whose holder may still live (``--tenplex-take-over``).
    ``client_state``: JSON the load hands back (``LoadResult.extra``); ``keep``: the newest complete checkpoints
    kept. ``checkpointer``: the loop's (:func:`open_checkpointer`), else one for this call."""
    orphan.die_with_agent()
    return save_for_api(DeepSpeedEngine(engine, client_state=dict(client_state or {})), save_dir, keep, PROG,
                        checkpointer, job_id=job_id, take_over=take_over)


def load_checkpoint(engine: Any, load_dir: str, iteration: int | None = None, *, verify: bool = True,
                    seed: int = 1234, trust_pickles: bool = False,
                    checkpointer: Checkpointer | None = None) -> LoadResult:
    """Collective: load the newest complete checkpoint under ``load_dir`` into ``engine``, re-sharded; a damaged one
    falls back to the previous, naming it (``iteration``: that one, no fallback).

    ``load_dir`` may hold tenplex checkpoints or DeepSpeed's own (``latest`` and ``global_stepN/``, read with
    ``weights_only=True`` unless ``trust_pickles``), written at any DP size. ``verify``: check tenplex checksums.
    ``seed``: for the RNG re-seed when the layout changed (always, for DeepSpeed's own files: they carry no RNG
    state). ``checkpointer``: the loop's (:func:`open_checkpointer`), else one for this call.
    """
    orphan.die_with_agent()
    if formats.is_deepspeed_checkpoint_dir(load_dir):
        return _load_native(engine, load_dir, iteration, seed=seed, trust_pickles=trust_pickles)
    res = load_for_api(DeepSpeedEngine(engine, load_dir, verify, seed), load_dir, iteration, PROG, checkpointer)
    if res is None:  # nothing there: refused on every rank, as a load that finds nothing
        _refuse(f"load from {load_dir}", f"no complete tenplex checkpoint under {load_dir}")
    return res


def _load_native(engine: Any, load_dir: str, iteration: int | None, *, seed: int,
                 trust_pickles: bool) -> LoadResult:
    """Collective: DeepSpeed's own ``global_stepN`` checkpoint (the newest, or ``iteration``'s), read in place."""
    adapter = DeepSpeedAdapter(engine, seed, where=load_dir)

    def opener() -> Any:  # runs before the adapter describes the engine for the load
        opened, adapter.source = native.open_native(native.step_dir(load_dir, iteration), trust_pickles=trust_pickles)
        return opened

    return load(adapter, load_dir, None, strict=True, verify=False, opener=opener, source_format="deepspeed")
