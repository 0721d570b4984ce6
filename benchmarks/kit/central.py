"""The centralized baseline (the Tenplex paper's "Central"): everything through rank 0 and one file, read whole.

Save: every distinct chunk of the job's state (one DP replica of each) goes to rank 0 by send/recv; rank 0
assembles the full tensors and writes one safetensors file with the project's own fsyncing writer, plus a JSON
of the non-tensor state. Load: every rank reads the whole file into memory (no lazy mmap: a centralized system
fetches the full checkpoint before it can re-partition it), parsed by the project's validating header reader,
then copies its own chunks out of it.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch
import torch.distributed as dist

from tenplex_megatron.execute.collective import all_gather_json
from tenplex_megatron.integrations.megatron_core.optimizer import (
    allocate_state,
    optimizer_state_json,
    restore_optimizer_state,
)
from tenplex_megatron.integrations.megatron_core.sharded import describe_job
from tenplex_megatron.storage.files import fsync_file
from tenplex_megatron.storage.safetensors_io import TORCH_DTYPES, read_header, write_safetensors

TENSORS_FILE = "central.safetensors"
STATE_FILE = "central.json"


def _box(offsets: tuple[int, ...] | list[int], shape: tuple[int, ...] | list[int]) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(offsets, shape))


def _assemble(chunks: list[Any], gathered: list[dict[str, Any]],
              senders: list[list[int]]) -> dict[str, torch.Tensor]:
    """On rank 0: receive every sender's chunks (one message per rank) and place them into full tensors."""
    meta = {k: v for g in gathered for k, v in g["tensors"].items()}
    full = {k: torch.empty(shape, dtype=TORCH_DTYPES[dt]) for k, (shape, dt) in meta.items()}
    staging: dict[str, torch.Tensor] = {}  # flat slices of one box (distributed optimizer), assembled whole
    for r, idx in enumerate(senders):
        if not idx:
            continue
        if r == 0:
            pieces = [chunks[i].data.detach().reshape(-1).cpu() for i in idx]
        else:
            nbytes = [gathered[r]["chunks"][i][4] for i in idx]
            buf = torch.empty(sum(nbytes), dtype=torch.uint8, device=chunks[0].data.device)
            dist.recv(buf, r)
            pieces = [p.view(full[gathered[r]["chunks"][i][0]].dtype) for i, p in zip(idx, buf.cpu().split(nbytes))]
        for i, piece in zip(idx, pieces):
            key, offsets, shape, flat, _ = gathered[r]["chunks"][i]
            if flat is None:
                full[key][_box(offsets, shape)].copy_(piece.view(shape))
            else:
                box = json.dumps([key, offsets, shape])
                if box not in staging:
                    staging[box] = torch.empty(math.prod(shape), dtype=piece.dtype)
                staging[box][flat[0] : flat[1]] = piece
    for box, data in staging.items():
        key, offsets, shape = json.loads(box)
        full[key][_box(offsets, shape)].copy_(data.view(shape))
    return full


def save(job: Any, path: str) -> int:
    """Collective: gather the job's state on rank 0 and write it there as one file; returns the bytes written."""
    rank = dist.get_rank()
    tensors, chunks = describe_job(job)
    mine = [[c.chunk.key, list(c.chunk.offsets), list(c.chunk.shape), list(c.chunk.flat) if c.chunk.flat else None,
             c.data.numel() * c.data.element_size()] for c in chunks]
    gathered = all_gather_json({"chunks": mine,
                                "tensors": {k: [list(m.global_shape), m.dtype] for k, m in tensors.items()}})
    owner: dict[str, tuple[int, int]] = {}  # each distinct chunk is sent by the first rank that holds it
    for r, g in enumerate(gathered):
        for i, c in enumerate(g["chunks"]):
            owner.setdefault(json.dumps(c[:4]), (r, i))
    senders = [[i for i, c in enumerate(g["chunks"]) if owner[json.dumps(c[:4])] == (r, i)]
               for r, g in enumerate(gathered)]
    size = 0
    if rank != 0:
        if senders[rank]:
            dist.send(torch.cat([chunks[i].data.detach().reshape(-1).view(torch.uint8) for i in senders[rank]]), 0)
    else:
        full = _assemble(chunks, gathered, senders)
        os.makedirs(path, exist_ok=True)
        size, _ = write_safetensors(os.path.join(path, TENSORS_FILE), full)
        del full
        state = os.path.join(path, STATE_FILE)
        with open(state, "w") as f:
            json.dump({"iteration": job.iteration, "consumed_samples": job.consumed_samples,
                       "optimizer": optimizer_state_json(job.optimizer), "scheduler": job.scheduler.state_dict()}, f)
        fsync_file(state)
    dist.barrier()
    return size


def read_whole(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, as views of one in-memory copy of the whole file (read sequentially)."""
    entries, size = read_header(path)  # validated: offsets, shapes and dtypes fit the file
    raw = torch.empty(size, dtype=torch.uint8)
    view = memoryview(raw.numpy())
    with open(path, "rb", buffering=0) as f:
        got = 0
        while got < size:
            k = f.readinto(view[got:])
            if not k:
                raise OSError(f"{path}: short read at byte {got} of {size}")
            got += k
    out = {}
    for key, e in entries.items():
        dtype = TORCH_DTYPES[e.dtype]
        part = raw[e.begin : e.end]
        if e.begin % dtype.itemsize:
            part = part.clone()  # unaligned: a reinterpreting view needs an aligned offset
        out[key] = part.view(dtype).view(e.shape)
    return out


def load(job: Any, path: str) -> int:
    """Collective: every rank reads the whole central file and copies its own chunks; returns the bytes it read."""
    allocate_state(job.optimizer)
    file = os.path.join(path, TENSORS_FILE)
    full = read_whole(file)
    with open(os.path.join(path, STATE_FILE)) as f:
        side = json.load(f)
    tensors, chunks = describe_job(job)
    with torch.no_grad():
        for lc in chunks:
            c = lc.chunk
            if c.key not in full:
                raise ValueError(f"{file}: tensor {c.key!r} is not in the central file")
            src = full[c.key]
            if tuple(src.shape) != tuple(tensors[c.key].global_shape):
                raise ValueError(f"{file}: {c.key} has shape {tuple(src.shape)}, the job needs "
                                 f"{tuple(tensors[c.key].global_shape)}")
            region = src[_box(c.offsets, c.shape)].reshape(-1)
            if c.flat is not None:
                region = region[c.flat[0] : c.flat[1]]
            lc.data.copy_(region.view(lc.data.shape))
    del full
    restore_optimizer_state(job.optimizer, side["optimizer"])
    job.scheduler.load_state_dict(side["scheduler"])
    job.iteration, job.consumed_samples = int(side["iteration"]), int(side["consumed_samples"])
    return os.path.getsize(file)
