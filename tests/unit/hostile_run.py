"""Run hostile-checkpoint cases in one child process, each under a time limit: ``hostile_run.py TASKS.json OUT.json``.

TASKS is a JSON list of ``{"name", "kind", "args"}``; kinds: ``cli`` (``tenplex_megatron``'s CLI with ``args``),
``load`` (what a front door does with load directory ``args[0]``: choose the copy, ``storage/copies.py``, then load it
through the fallback, ``memory/fallback.py``, with the engine's real ``load_chunks``), ``te`` (Transformer Engine's
``set_extra_state`` handed a checkpoint's rank-local bytes by ``extra_state.prepare``: ``args`` = directory, payload,
``trust``/``check``). Each case runs under ``signal.alarm`` (a blocked ``open`` of a FIFO is interrupted too); the
caller sets the process's address-space limit, so a read without bound ends in a MemoryError recorded for its case.
OUT maps each name to ``{"code", "out", "err", ...}``. Used by tests/unit/test_hostile_checkpoints.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import pickle
import signal
import sys
import traceback
import types
from typing import Any

import torch

from tenplex_megatron import cli
from tenplex_megatron.engine import rank_local
from tenplex_megatron.engine.chunks import LocalChunk
from tenplex_megatron.engine.load import load_chunks
from tenplex_megatron.integrations.megatron_core import extra_state
from tenplex_megatron.memory import fallback
from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.plan.ptc import Chunk, TensorMeta
from tenplex_megatron.storage import copies
from tenplex_megatron.storage.checkpoint_metadata import CheckpointMetadata
from tenplex_megatron.storage.safetensors_io import write_safetensors

LIMIT_S = int(os.environ.get("HOSTILE_LIMIT_S", "30"))
SHAPE = (64, 32)


class Hang(Exception):
    """A case ran past its time limit."""


def _alarm(signum: int, frame: Any) -> None:
    raise Hang(f"still running after {LIMIT_S} s")


def load(load_dir: str) -> dict[str, Any]:
    """Choose the copy as the front doors do at start, then load it (falling back past damaged copies)."""
    dst = torch.zeros(SHAPE[0] * SHAPE[1])

    def describe(meta: dict[str, Any]) -> list[LocalChunk]:
        return [LocalChunk(TensorMeta("w", SHAPE, "float32"), Chunk("w", (0, 0), SHAPE), dst, True)]

    copy, damaged = copies.choose(load_dir)
    if copy is None:
        return {"fresh": True}
    newest = copy.path
    got = fallback.restart(lambda c: None, lambda path: load_chunks(path, None, describe, lambda meta: None),
                           None, None, load_dir, newest, damaged)
    return {"path": got.result.path, "iteration": got.result.metadata.iteration, "skipped": list(got.skipped),
            "equal": bool(torch.equal(dst, torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float32)))}


class TELike(torch.nn.Module):
    """Transformer Engine's ``get_extra_state``/``set_extra_state`` (transformer_engine/pytorch/module/base.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.state: Any = {"scale_fwd": torch.zeros(2)}  # a fresh module's

    def get_extra_state(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(pickle.dumps(self.state)), dtype=torch.uint8)

    def set_extra_state(self, s: torch.Tensor) -> None:
        self.state = pickle.loads(s.detach().cpu().numpy().tobytes())


def _payload(what: str, marker: str) -> Any:
    class Evil:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {marker}",))

    class Storage:  # a tensor's storage (torch.storage._load_from_bytes: torch.load, weights_only=False) with code
        def __reduce__(self) -> Any:
            inner = io.BytesIO()
            torch.save(Evil(), inner, _use_new_zipfile_serialization=False)
            return (torch.storage._load_from_bytes, (inner.getvalue(),))

    if what == "te":  # what TE pickles: CPU tensors, numbers, strings, containers
        return {"scale_fwd": torch.tensor([1.5, 2.0]), "amax_history_fwd": torch.arange(6.0).reshape(3, 2),
                "extra_fp8_variables": {"num_gemms": 1, "fp8_checkpoint": True, "amax_history_len": 3}}
    return Evil() if what == "evil" else Storage()


def te(d: str, what: str, trust: str) -> dict[str, Any]:
    """The probe's finding 1: a checkpoint's rank-local bytes for a TE module, at the same layout."""
    os.makedirs(d, exist_ok=True)
    marker = os.path.join(d, "PWNED")
    payload = _payload(what, marker)
    raw = pickle.dumps(payload)
    n = "rank_local:model0.decoder.layers.0.self_attention.linear_qkv._extra_state"
    _, sums = write_safetensors(f"{d}/rank_00000.safetensors",
                                {n: torch.frombuffer(bytearray(raw), dtype=torch.uint8)})
    layout = ParallelLayout(1, 1, 1)
    meta = {"format_version": 2, "layout": layout.to_json(), "rank_local": {"0": {
        "file": "rank_00000.safetensors", "block_bytes": 1 << 20, "entries": {n: {
            "kind": "tensor", "dtype": "uint8", "shape": [len(raw)], "nbytes": len(raw), "chunk": 0,
            "module": "decoder.layers.0.self_attention.linear_qkv", "block_crc32": list(sums[n])}}}}}
    m = torch.nn.Module()
    m.decoder = torch.nn.Module()
    m.decoder.layers = torch.nn.ModuleList([torch.nn.Module()])
    m.decoder.layers[0].self_attention = torch.nn.Module()
    module = m.decoder.layers[0].self_attention.linear_qkv = TELike()
    job = types.SimpleNamespace(model=[m], layout=layout, trust_pickles=trust == "trust")
    checked = CheckpointMetadata.from_json(meta, os.path.join(d, "metadata.json"))  # as a load reads it
    apply = extra_state.prepare(job, checked, rank_local.reader(d, checked.rank_local, 0), 0)
    if apply is not None:
        apply()
    restored = what == "te" and torch.equal(module.state["amax_history_fwd"], payload["amax_history_fwd"]) \
        and module.state["extra_fp8_variables"] == payload["extra_fp8_variables"]
    return {"ran": os.path.exists(marker), "handed_over": apply is not None, "restored": bool(restored)}


def run_one(task: dict[str, Any]) -> dict[str, Any]:
    out, err = io.StringIO(), io.StringIO()
    got: dict[str, Any] = {"code": 0}
    signal.alarm(LIMIT_S)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            if task["kind"] == "cli":
                got["code"] = cli.main(task["args"])
            elif task["kind"] == "load":
                got.update(load(task["args"][0]))
            else:
                got.update(te(*task["args"]))
    except BaseException as e:  # noqa: BLE001 - each case's failure is what the test checks
        got.update(code=1, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc())
    finally:
        signal.alarm(0)
    got.update(out=out.getvalue(), err=err.getvalue())
    return got


if __name__ == "__main__":
    signal.signal(signal.SIGALRM, _alarm)
    logging.getLogger("tenplex_megatron")  # the library's handlers write to sys.stdout/stderr of the moment
    with open(sys.argv[1]) as f:
        tasks = json.load(f)
    results = {t["name"]: run_one(t) for t in tasks}
    with open(sys.argv[2], "w") as f:
        json.dump(results, f)
