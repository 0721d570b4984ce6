"""``frontdoor.elastic.stop_agent_and_exit``: a refusal under torchrun's elastic agent stops the agent before any
worker's exit can make it restart the group. Real processes: a parent standing in for the agent (it records what
it sees in the order it sees it) and two workers, local rank 0 reaching the refusal a second after local rank 1."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

AGENT = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    events = []
    def on_term(signum, frame):
        events.append("agent SIGTERM")
        for w in workers:
            if w.poll() is None:
                w.send_signal(signal.SIGTERM)
        for w in workers:
            w.wait()
        events.append("workers " + ",".join(str(w.returncode) for w in workers))
        print("|".join(events), flush=True)
        os._exit(0)
    signal.signal(signal.SIGTERM, on_term)
    worker = ("import os, time; from tenplex_megatron.frontdoor import elastic; "
              "time.sleep(float(os.environ['DELAY'])); elastic.stop_agent_and_exit(2)")
    env = dict(os.environ, TORCHELASTIC_RUN_ID="x", TORCHELASTIC_MAX_RESTARTS=sys.argv[1])
    workers = [subprocess.Popen([sys.executable, "-c", worker], env=dict(env, LOCAL_RANK=str(r), DELAY=d))
               for r, d in ((0, "1.0"), (1, "0"))]
    while True:  # the agent's monitor: a worker that exits is a failure it would restart the group for
        for r, w in enumerate(workers):
            if w.poll() is not None:
                events.append(f"worker {r} exited {w.returncode}")
                print("|".join(events), flush=True)
                os._exit(1)
        time.sleep(0.05)
""")


def _agent(max_restarts: str) -> str:
    p = subprocess.run([sys.executable, "-c", AGENT, max_restarts], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    return p.stdout.strip()


def test_the_agent_is_stopped_before_a_faster_rank_exits() -> None:
    """Local rank 1 refuses first and waits; local rank 0 SIGTERMs the agent a second later; the agent stops both
    (rank 0 exits 2, or dies of the agent's SIGTERM if that lands first)."""
    events = _agent("3").split("|")
    assert events[0] == "agent SIGTERM" and events[1] in ("workers 2,-15", "workers -15,-15"), events


def test_without_restarts_left_every_rank_exits_at_once() -> None:
    """No restarts to prevent: nothing is signalled, and the rank that refuses first exits first with the code."""
    assert _agent("0") == "worker 1 exited 2"
