"""``python -m tenplex_megatron layouts`` run as a user runs it: the ranked candidates, the exclusions and their reasons."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from tenplex_megatron.plan.autolayout import choose_layout, parse_candidate_key
from tenplex_megatron.plan.sim.gpt_catalogue import load_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tenplex_megatron", "layouts", *args], capture_output=True, text=True,
                          cwd=ROOT, env={"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"}, timeout=120)


def test_layouts_for_12_gpus_ranks_legal_layouts_and_says_why_others_are_excluded() -> None:
    p = _cli("--model", "gpt3-1.3b", "--gpus", "12", "--gpus-per-node", "4", "--memory-gb", "80",
             "--global-batch-size", "512")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    rows = re.findall(r"^\s+(\d+)\s+(tp=\d+,pp=\d+,dp=\d+(?:,vpp=\d+)?,mbs=\d+)\s+(\d+)\s+([\d.]+) GiB .* ([\d.]+)\s+\(.*\) modelled$",
                      out, re.M)
    assert rows and rows[0][0] == "1"
    # the top row is the library's choice, and it is legal by the rules written out here
    assert rows[0][1] == choose_layout(load_model("gpt3-1.3b"), 12, 4, 512, memory_gb=80).best.key
    for _, key, micro_batches, mem, _seconds in rows:
        layout, mbs = parse_candidate_key(key)
        tp, pp, dp, vpp = layout.tp, layout.pp, layout.dp, layout.vpp
        assert tp * pp * dp == 12 and tp <= 4 and 16 % tp == 0 and 24 % (pp * vpp) == 0 and 512 % (dp * mbs) == 0
        assert int(micro_batches) == 512 // (dp * mbs) and float(mem) <= 80
    assert [float(r[4]) for r in rows] == sorted(float(r[4]) for r in rows)
    # every (TP, PP, DP) of 12, at PP > 1 with every VPP splitting a rank's 24 / PP layers evenly, x 4 micro-batch sizes
    splits = [(pp, v) for tp in range(1, 13) for pp in range(1, 13) if 12 % (tp * pp) == 0
              for v in range(1, 25) if v == 1 or (pp > 1 and 24 % (pp * v) == 0)]
    assert f"candidates   {4 * len(splits)}: " in out
    # exclusions, each with its reasons
    assert "tp=3,pp=1,dp=4 mbs=1,2,4,8: TP=3 does not divide the attention heads (16)" in out
    assert re.search(r"^  tp=6,pp=2,dp=1 mbs=1,2,4,8: TP=6 spans more than the 4 GPUs of a node", out, re.M)
    assert "tp=1,pp=1,dp=12 mbs=1,2,4,8: DP=12 does not divide the global batch size 512" in out
    assert re.search(r"^  tp=1,pp=3,dp=4 mbs=8: needs [\d.]+ GiB per rank \(stage 0\), over the budget of 80 GiB$",
                     out, re.M)


def test_layouts_json_lists_every_candidate_in_rank_order() -> None:
    p = _cli("--model", "tiny", "--gpus", "4", "--gpus-per-node", "2", "--global-batch-size", "8", "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    cands = doc["candidates"]
    assert doc["best"] == cands[0]["key"] and cands[0]["usable"]
    assert len(cands) == 6 * 4  # (tp, pp, dp) with product 4, times micro-batch sizes 1, 2, 4, 8
    usable = [c for c in cands if c["usable"]]
    assert cands[: len(usable)] == usable
    assert all(c["tp"] <= 2 for c in usable) and any(c["tp"] == 4 for c in cands if not c["usable"])
    assert all(c["memory"]["total"] == sum(c["memory"][k] for k in ("weights", "gradients", "optimizer", "activations"))
               for c in usable)


def test_layouts_with_measured_times_puts_the_measured_first(tmp_path) -> None:
    times = tmp_path / "times.json"
    times.write_text(json.dumps({"version": 1, "times": {"4": {"tp=1,pp=2,dp=2,mbs=4": 0.125}}}))
    p = _cli("--model", "tiny", "--gpus", "4", "--gpus-per-node", "4", "--global-batch-size", "8",
             "--times", str(times))
    assert p.returncode == 0, p.stderr
    assert re.search(r"^\s+1\s+tp=1,pp=2,dp=2,mbs=4\s.*\s0\.125\s+\(.*\) measured$", p.stdout, re.M), p.stdout


def test_no_usable_layout_is_an_error_listing_every_candidate() -> None:
    """5 processes, 4 heads, global batch 8: exit status 2, each refused candidate printed with its reasons."""
    p = _cli("--model", "tiny", "--gpus", "5", "--gpus-per-node", "4", "--global-batch-size", "8")
    assert p.returncode == 2
    assert "no usable layout for 5 GPUs" in p.stderr
    assert "tp=1,pp=1,dp=5 mbs=1,2,4,8: DP=5 does not divide the global batch size 8" in p.stdout
    assert "tp=1,pp=5,dp=1 mbs=1,2,4,8: PP=5 does not divide the 2 layers" in p.stdout
    assert "tp=5,pp=1,dp=1 mbs=1,2,4,8: TP=5 spans more than the 4 GPUs of a node" in p.stdout


def test_unknown_model_and_bad_flags_are_named() -> None:
    p = _cli("--model", "gpt5", "--gpus", "4")
    assert p.returncode == 2 and "unknown model 'gpt5'; known: " in p.stderr and "gpt3-xl" in p.stderr
    p = _cli("--model", "tiny", "--gpus", "0")
    assert p.returncode == 2 and "world size must be a positive integer, got 0" in p.stderr
    p = _cli("--model", "tiny", "--gpus", "4", "--micro-batch-sizes", "1,x")
    assert p.returncode == 2 and "--micro-batch-sizes" in p.stderr


def test_layouts_of_a_mixture_of_experts_show_the_expert_layout() -> None:
    """Mixtral 8x7B on 16 GPUs: each row names expert TP x EP x expert DP and the EP and expert TP communication; the
    top row is the library's choice (expert TP 1 below TP 4: the experts whole, spread over EP); JSON has both."""
    p = _cli("--model", "mixtral-8x7b", "--gpus", "16", "--global-batch-size", "256", "--top", "4")
    assert p.returncode == 0, p.stderr
    assert "(bubble, TP, PP, DP, EP, expert TP comm)" in p.stdout
    rows = re.findall(r"^\s+\d+\s+(\S+,mbs=\d+)\s+(\d+)x(\d+)x(\d+)\s+\d+\s+.*\(([^)]*)\) modelled$", p.stdout, re.M)
    assert len(rows) == 4, p.stdout
    best = choose_layout(load_model("mixtral-8x7b"), 16, 8, 256, memory_gb=80).best
    assert rows[0][0] == best.key and best.layout.expert_tp == 1 < best.layout.tp
    for key, etp, ep, edp, comm in rows:
        layout, _ = parse_candidate_key(key)
        assert (layout.expert_tp, layout.ep, layout.expert_dp) == (int(etp), int(ep), int(edp))
        assert len(comm.split(", ")) == 6 and (float(comm.split(", ")[5]) > 0) == (layout.expert_tp > 1)
    p = _cli("--model", "mixtral-8x7b", "--gpus", "16", "--global-batch-size", "256", "--json")
    cands = json.loads(p.stdout)["candidates"]
    assert all(c["expert_tp"] * c.get("ep", 1) * c["expert_dp"] * c["pp"] == 16 for c in cands)
    assert cands[0]["expert_tp"] == 1 and cands[0]["modelled"]["etp_comm"] == 0


def test_layouts_without_sequence_parallelism() -> None:
    """--no-sequence-parallel: a dense model's candidates at TP > 1 need more activation memory (10 x hidden bytes a
    token stay whole on every TP rank); a mixture of experts keeps only TP 1 candidates, the others refused with
    megatron-core's reason."""
    args = ("--model", "gpt3-1.3b", "--gpus", "8", "--json")
    sp, nosp = (json.loads(_cli(*args, *extra).stdout) for extra in ((), ("--no-sequence-parallel",)))
    assert sp["sequence_parallel"] is True and nosp["sequence_parallel"] is False
    act = {flag: {c["key"]: c["memory"]["activations"] for c in doc["candidates"] if c["legal"]}
           for flag, doc in ((True, sp), (False, nosp))}
    for key, with_sp in act[True].items():
        layout, _ = parse_candidate_key(key)
        assert (act[False][key] > with_sp) == (layout.tp > 1), key
    p = _cli("--model", "mixtral-8x7b", "--gpus", "16", "--global-batch-size", "256", "--memory-gb", "120",
             "--flash-attention", "--no-sequence-parallel")
    assert p.returncode == 0, p.stderr
    assert "TP 1 only: megatron-core needs --sequence-parallel with MoE at TP > 1" in p.stdout
    rows = re.findall(r"^\s+\d+\s+(\S+,mbs=\d+)\s", p.stdout, re.M)
    assert rows and all(parse_candidate_key(key)[0].tp == 1 for key in rows), p.stdout
