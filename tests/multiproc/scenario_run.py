"""Run several ``scripts/pretrain_gpt.py`` jobs, failing ones included, in one torchrun launch; record each outcome.

``scenario_run.py TASKS.json OUT_DIR``: TASKS is a JSON list of ``{"name", "flags", "fault"}`` (``fault``: the
job's TENPLEX_FAULT, optional). Each job is parsed and run exactly as ``pretrain_gpt.py FLAGS`` would run it
(``pretrain.parse_args`` then ``pretrain.run``, megatron-core's parallel state built afresh for every job) in the
launch's one process group; ``"fake_te": true`` runs it with Transformer Engine's kind of ``_extra_state`` on
megatron-core's linear layers (tests/fake_te.py). Every rank writes ``OUT_DIR/NAME.rankR.json``: ``code`` (the exit status the script
would have had: 0, argparse's 2, or 1), ``error`` (``"Type: message"`` as a traceback's last line reads, or null)
and ``log`` (what the job printed, then the traceback of an exception, then that error line). A job must fail on every rank alike (flag and layout
checks do; collective phases raise on every rank through the phase runner), else the launch hangs and the
caller's timeout fails the test. Saves ~10 s of process start-up per rank and job.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import logging
import os
import sys
import traceback

import torch

from tenplex_megatron import log as tlog
from tenplex_megatron.training import gpt, pretrain
from tests.fake_te import fake_te_extra_state


def _run_one(flags: list[str], fault: str | None, fake_te: bool = False) -> dict:
    os.environ.pop("TENPLEX_FAULT", None)
    if fault:
        os.environ["TENPLEX_FAULT"] = fault
    buf = io.StringIO()
    code, error, trace = 0, None, ""
    # the library's log lines too (its handlers hold the streams they were made with), as the job's own launch shows
    handlers = [h for h in logging.getLogger(tlog.ROOT).handlers if isinstance(h, logging.StreamHandler)]
    streams = [h.setStream(buf) for h in handlers]
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf), \
                (fake_te_extra_state() if fake_te else contextlib.nullcontext()):
            pretrain.run(pretrain.parse_args(flags))
    except SystemExit as e:  # argparse (status 2) or a check's SystemExit("pretrain_gpt.py: error: ...")
        code = e.code if isinstance(e.code, int) else 1
        error = None if isinstance(e.code, int) else f"SystemExit: {e.code}"
    except Exception as e:  # noqa: BLE001 - the job's failure is what the test checks
        code, error, trace = 1, f"{type(e).__name__}: {e}", traceback.format_exc()
    finally:
        os.environ.pop("TENPLEX_FAULT", None)
        for h, stream in zip(handlers, streams):
            h.setStream(stream)
    log = buf.getvalue() + trace + (f"{error}\n" if error else "")
    return {"code": code, "error": error, "log": log}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        tasks = json.load(f)
    out = sys.argv[2]
    gpt.init_distributed()
    rank = torch.distributed.get_rank()
    for i, task in enumerate(tasks):
        res = _run_one(task["flags"], task.get("fault"), bool(task.get("fake_te")))
        gc.collect()
        with open(os.path.join(out, f"{task['name']}.rank{rank}.json"), "w") as f:
            json.dump(res, f)
        torch.distributed.barrier()
        if rank == 0:
            print(f"> scenario_run: task {i + 1}/{len(tasks)} {task['name']}: exit status {res['code']}", flush=True)
    torch.distributed.destroy_process_group()
