"""Megatron's own checkpoints (written without --tenplex by megatron-core's save paths: torch_dist, and the legacy
torch format from megatron-core's objects as Megatron-LM writes it, training/legacy_ckpt.py) adopted by tenplex at a new
layout: the adopted state equals the state at save element for element, losses continue as the uninterrupted run's,
and bad input fails on every rank, naming what is wrong, before the job's state is touched.

One writer launch writes every checkpoint (and, at the same layout with --tenplex, the uninterrupted reference
run with a tenplex checkpoint of the same state, one per job and layout: the MoE formats share theirs); one adopter
launch adopts them all (some at a second layout) and tries the bad inputs.
``inspect`` and ``plan --to`` then run on the written checkpoints with torch blocked (no further launch).

The way back rides the same launches: ``export-megatron`` (the CLI: one launch of its own) writes a reference run's
tenplex checkpoint as Megatron's torch_dist at another layout, the adopter launch exports another one in its own
process group, then resumes both through the reference trainer's megatron-core path (no ``--tenplex``) with the loss
oracle, and a job without ``--tenplex`` over a tenplex save directory stops naming ``export-megatron``.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.storage.directory import find_checkpoint
from tests.harness import CHILD_PYTHONPATH, ROOT, TINY_GPT, layout_flags, metrics, read_full_tensors, torchrun

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # about 4 CPU minutes: make test-bench and make test-compat

RUNNER = os.path.join(ROOT, "tests", "multiproc", "megatron_adopt_run.py")
MODEL = [a for a in TINY_GPT if a != "--tenplex"] + ["--vocab-size", "96", "--swiglu", "--train-iters", "6"]
DIST = ["--use-distributed-optimizer"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear", "--moe-aux-loss-coeff", "0.01"]
# DeepSeek-style routing: sigmoid scores, the aux-loss-free expert bias (a router buffer, no optimizer state), and a
# shared expert every token goes through (dense parameters, in the dense buffer beside the router)
MOE_DS = [*MOE, "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
          "--moe-router-bias-update-rate", "0.01", "--moe-shared-expert-intermediate-size", "64"]
EP2 = [*layout_flags(1, 1), "--expert-model-parallel-size", "2"]
# name: (training flags, saving layout, extra flags of the writer only, adopting layout)
SCENARIOS = {
    "tp2_dp_reshardable": (DIST, layout_flags(2, 1), [], layout_flags(1, 1)),  # TP2 -> TP1 x DP2
    "dp2_dp_reshardable": (DIST, layout_flags(1, 1), [], layout_flags(2, 1)),  # TP1 x DP2 -> TP2 (DP2 -> DP1)
    "pp2_dp_reshardable": (DIST, layout_flags(1, 2), [], layout_flags(1, 1)),  # PP2 -> PP1 x DP2 (tied embedding)
    "dp2_fully_reshardable": (DIST, layout_flags(1, 1), ["--dist-ckpt-optim-fully-reshardable"], layout_flags(2, 1)),
    "tp2_plain_optimizer": ([], layout_flags(2, 1), [], layout_flags(1, 1)),
    "tp2_bf16_dp_reshardable": ([*DIST, "--bf16"], layout_flags(2, 1), [], layout_flags(1, 1)),
    # overlapped DDP in 4,000-element buckets at DP2 (each bucket's shards stored apart), adopted at TP2
    "dp2_bf16_overlap_dp_reshardable": ([*DIST, "--bf16", "--overlap-grad-reduce", "--overlap-param-gather",
                                         "--ddp-bucket-size", "4000"], layout_flags(1, 1), [], layout_flags(2, 1)),
    "tp2_legacy_torch": (DIST, layout_flags(2, 1), ["--ckpt-format", "torch"], layout_flags(1, 1)),
    "pp2_bf16_legacy_torch": ([*DIST, "--bf16"], layout_flags(1, 2), ["--ckpt-format", "torch"], layout_flags(1, 1)),
    # no distributed optimizer: the plain optimizer's state in model_optim_rng.pt (fp32: Float32Optimizer; bf16:
    # Float16Optimizer with its fp32 main params), PP2's last stage holding the tied output layer's copy
    "tp2_plain_legacy_torch": ([], layout_flags(2, 1), ["--ckpt-format", "torch"], layout_flags(1, 1)),
    "pp2_bf16_plain_legacy_torch": (["--bf16"], layout_flags(1, 2), ["--ckpt-format", "torch"], layout_flags(1, 1)),
    # a mixture of experts saved at EP2 by megatron-core (fully_reshardable: the chained dense + expert optimizer's
    # state in model space), adopted at EP1 x DP2 (the experts' sub-optimizer joins the dense one)
    "ep2_moe_fully_reshardable": ([*DIST, *MOE_DS], EP2, ["--dist-ckpt-optim-fully-reshardable"],
                                  layout_flags(1, 1)),
    # Megatron-LM's default format for a mixture of experts at EP2: the chained optimizer's dense buffer (router, shared
    # expert) and the experts' own buffer (each EP rank's experts, cut over expert DP), adopted at EP1 x DP2
    "ep2_moe_dp_reshardable": ([*DIST, *MOE_DS], EP2, [], layout_flags(1, 1)),
}
#: adoptions besides each scenario's own: name -> (scenario whose Megatron checkpoint is adopted, adopting layout)
EXTRA_ADOPTIONS = {
    # the experts' buffer read at another EP and PP (the first stage's rank reads the last stage's norm's state)
    "ep2_moe_dp_reshardable_at_pp2": ("ep2_moe_dp_reshardable", layout_flags(1, 2)),
}
ADOPTIONS = {**{name: (name, s[3]) for name, s in SCENARIOS.items()}, **EXTRA_ADOPTIONS}
#: the way back: name -> (scenario whose tenplex reference checkpoint of iteration 3 is exported, its layout there,
#: the resuming job's layout flags, the distributed optimizer's format the export writes (None: the plain optimizer))
EXPORTS = {
    # by the CLI: TP2 -> TP1 x DP2 (auto: fully_reshardable)
    "export_tp1dp2": ("tp2_dp_reshardable", "tp=1,pp=1,dp=2", layout_flags(1, 1), "fully_reshardable"),
    # in the adopter launch: the plain optimizer, TP2 -> PP2 (the tied embedding's copy on the last stage)
    "export_pp2_plain": ("tp2_plain_optimizer", "tp=1,pp=2,dp=1", layout_flags(1, 2), None),
}
#: each scenario's uninterrupted reference run: the first scenario's that trains the same job at the same layout
REF = {name: next(n for n, o in SCENARIOS.items() if o[:2] == s[:2]) for name, s in SCENARIOS.items()}


def _run(tmp: str, name: str, tasks: list[dict]) -> str:
    path = os.path.join(tmp, f"{name}.json")
    with open(path, "w") as f:
        json.dump(tasks, f)
    r = torchrun(2, [path], timeout=900, script=RUNNER)
    assert r.returncode == 0, r.log[-4000:]
    return r.log


def _read_common(ckpt: str) -> dict:
    """A torch_dist checkpoint's common state (the test's own trusted file): ``common.pt``, or from megatron-core
    0.19 an object in the .distcp files."""
    legacy = os.path.join(ckpt, "common.pt")
    if os.path.isfile(legacy):
        return torch.load(legacy, weights_only=False)
    from megatron.core.dist_checkpointing.serialization import load_common_state_dict

    return load_common_state_dict(ckpt)


def _edit_common(ckpt: str, edit: Callable[[dict], None]) -> None:
    """Change a torch_dist checkpoint's common state (the test crafts bad input from its own trusted file); a
    common.pt is read first, also from megatron-core 0.19."""
    common = _read_common(ckpt)
    edit(common)
    torch.save(common, os.path.join(ckpt, "common.pt"))


def _rewrite_index(ckpt: str, old: str, new: str) -> None:
    """Rename optimizer keys in a torch_dist index (the test crafts bad input from its own trusted file)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    path = os.path.join(ckpt, ".metadata")
    with open(path, "rb") as f:
        md = pickle.load(f)
    md.state_dict_metadata = {k.replace(old, new): v for k, v in md.state_dict_metadata.items()}
    md.storage_data = {MetadataIndex(k.fqn.replace(old, new), k.offset, k.index): v for k, v in md.storage_data.items()}
    with open(path, "wb") as f:
        pickle.dump(md, f)


class NotPlain:
    """A class no Megatron checkpoint holds."""


@pytest.fixture(scope="module")
def adopted(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    tmp = str(tmp_path_factory.mktemp("megatron_adopt"))
    writers = []
    for name, (train, saving, writer_only, _) in SCENARIOS.items():
        writers.append({"flags": [*MODEL, *train, *saving, *writer_only, "--save", f"{tmp}/{name}/mc",
                                  "--exit-interval", "3"]})
        if REF[name] == name:
            writers.append({"flags": [*MODEL, *train, *saving, "--tenplex", "--save", f"{tmp}/{name}/ref",
                                      "--save-interval", "3", "--tenplex-metrics", f"{tmp}/{name}/ref.jsonl"]})
    _run(tmp, "writers", writers)
    base = f"{tmp}/tp2_dp_reshardable/mc/iter_0000003"
    bad = {}
    for case in ("missing", "version", "optimizer", "pickle"):
        bad[case] = shutil.copytree(base, f"{tmp}/bad_{case}")
    os.remove(os.path.join(bad["missing"], "__1_0.distcp"))
    bad["legacy"] = shutil.copytree(f"{tmp}/tp2_legacy_torch/mc/iter_0000003", f"{tmp}/bad_legacy")
    shutil.rmtree(os.path.join(bad["legacy"], "mp_rank_01"))
    # the plain (non-distributed) optimizer's state in model_optim_rng.pt, as SGD with momentum would leave it
    bad["plain"] = shutil.copytree(f"{tmp}/tp2_plain_legacy_torch/mc/iter_0000003", f"{tmp}/bad_plain")
    rank0 = os.path.join(bad["plain"], "mp_rank_00", "model_optim_rng.pt")
    sd = torch.load(rank0, weights_only=False)
    for st in sd["optimizer"]["state"].values():
        st["momentum_buffer"] = st.pop("exp_avg_sq")
    torch.save(sd, rank0)
    with open(os.path.join(bad["version"], "metadata.json")) as f:
        meta = json.load(f)
    with open(os.path.join(bad["version"], "metadata.json"), "w") as f:
        json.dump({**meta, "sharded_backend_version": 99}, f)
    _rewrite_index(bad["optimizer"], ".exp_avg_sq", ".momentum_buffer")
    # a mixture of experts whose saved args name another EP than its expert buffer's groups show
    bad["moe_ep"] = shutil.copytree(f"{tmp}/ep2_moe_dp_reshardable/mc/iter_0000003", f"{tmp}/bad_moe_ep")
    _edit_common(bad["moe_ep"], lambda c: setattr(c["args"], "expert_model_parallel_size", 4))
    _edit_common(bad["pickle"], lambda c: c.update(extra=NotPlain()))
    p = subprocess.run([sys.executable, "-m", "tenplex_megatron", "export-megatron",
                        f"{tmp}/{EXPORTS['export_tp1dp2'][0]}/ref/iter_0000003", f"{tmp}/export_tp1dp2", "--to",
                        EXPORTS["export_tp1dp2"][1]], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=CHILD_PYTHONPATH))
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    with open(f"{tmp}/export_tp1dp2.out", "w") as f:
        f.write(p.stdout)
    adopters: list[dict] = [
        {"export": f"{tmp}/{EXPORTS['export_pp2_plain'][0]}/ref/iter_0000003", "out": f"{tmp}/export_pp2_plain",
         "to": EXPORTS["export_pp2_plain"][1], "optimizer_format": "dp_reshardable"},
        # a job without --tenplex whose --load holds tenplex checkpoints (the tracker names iteration 6)
        {"flags": [*MODEL, *DIST, *layout_flags(1, 1), "--load", f"{tmp}/tp2_dp_reshardable/ref"], "refused": True},
    ]
    for name, (scenario, _, resuming, _) in EXPORTS.items():
        train = SCENARIOS[scenario][0]
        adopters.append({"flags": [*MODEL, *train, *resuming, "--load", f"{tmp}/{name}",
                                   "--tenplex-metrics", f"{tmp}/{name}.jsonl"]})
    for name, (scenario, adopting) in ADOPTIONS.items():
        adopters.append({"flags": [*MODEL, *SCENARIOS[scenario][0], *adopting, "--tenplex", "--load",
                                   f"{tmp}/{scenario}/mc/iter_0000003", "--tenplex-resave", f"{tmp}/{name}/resaved",
                                   "--save", f"{tmp}/{name}/out", "--tenplex-metrics", f"{tmp}/{name}/got.jsonl"]})
    tp1 = [*MODEL, *DIST, *layout_flags(1, 1)]
    adopters += [
        {"flags": [*tp1, "--ffn-hidden-size", "128"], "load": base,
         "error": "tensor 'decoder.layers.mlp.linear_fc1.bias' has shape [2, 512] in the checkpoint, [2, 256] in "
                  "the model"},
        {"flags": tp1, "load": bad["missing"], "error": "__1_0.distcp: missing"},
        {"flags": tp1, "load": bad["version"],
         "error": "sharded backend torch_dist version 99 is not supported (tenplex reads torch_dist version 1)"},
        {"flags": tp1, "load": bad["optimizer"], "error": "optimizer state 'momentum_buffer' is not supported"},
        {"flags": tp1, "load": bad["pickle"], "error": "test_megatron_adopt.NotPlain"},
        {"flags": tp1, "load": bad["legacy"],
         "error": "mp_rank_01/model_optim_rng.pt: missing (the checkpoint was written at TP2 PP1)"},
        {"flags": [*MODEL, *layout_flags(1, 1)], "load": bad["plain"],
         "error": "mp_rank_00/model_optim_rng.pt: optimizer state ['exp_avg', 'momentum_buffer', 'step'] of"},
        {"flags": [*MODEL, *DIST, *MOE_DS, *layout_flags(1, 1)], "load": bad["moe_ep"],
         "error": "the expert buffer has 2 groups (EP 2 at expert TP 1 x PP 1); the saved args record "
                  "expert_model_parallel_size=4"},
    ]
    return tmp, _run(tmp, "adopters", adopters)


@pytest.mark.parametrize("name", list(ADOPTIONS))
def test_adopted_state_equals_saved_and_losses_continue(adopted: tuple[str, str], name: str) -> None:
    tmp, log = adopted
    scenario = ADOPTIONS[name][0]
    got = read_full_tensors(os.path.join(tmp, name, "resaved", "iter_0000003"))
    ref = read_full_tensors(os.path.join(tmp, REF[scenario], "ref", "iter_0000003"))
    assert sorted(got) == sorted(ref)
    assert any(k.startswith("optimizer.state.exp_avg_sq.") for k in got)
    if "bf16" in name:
        assert any(k.startswith("optimizer.state.fp32_param.") for k in got)
    if "moe" in name:  # every expert's, the router's and (DeepSeek-style) the shared expert's and expert bias
        want = ["optimizer.state.exp_avg.decoder.layers.mlp.experts.experts.linear_fc1.weight",
                "optimizer.state.exp_avg_sq.decoder.layers.mlp.router.weight", "decoder.layers.mlp.router.expert_bias",
                "optimizer.state.exp_avg.decoder.layers.mlp.shared_experts.linear_fc2.weight"]
        assert all(k in got for k in want), sorted(got)
    for key in ref:
        assert got[key].dtype == ref[key].dtype and torch.equal(got[key], ref[key]), key
    assert find_checkpoint(os.path.join(tmp, name, "out")) == os.path.join(tmp, name, "out", "iter_0000006")
    after = metrics(os.path.join(tmp, name, "got.jsonl"))
    assert [m["iteration"] for m in after] == [4, 5, 6]
    before = {m["iteration"]: m for m in metrics(os.path.join(tmp, REF[scenario], "ref.jsonl"))}
    for m in after:
        assert m["samples"] == before[m["iteration"]]["samples"]
        if "bf16" not in name:  # the oracle is fp32; bf16's state is compared above
            assert m["loss"] == pytest.approx(before[m["iteration"]]["loss"], rel=1e-5)


def test_bad_input_named_before_state_is_touched(adopted: tuple[str, str]) -> None:
    """Each bad checkpoint fails on every rank with the message naming the file or tensor, and every rank's job
    (weights, optimizer state, iteration) is exactly as before the attempt."""
    tmp, _ = adopted
    with open(os.path.join(tmp, "adopters.json")) as f:
        tasks = json.load(f)
    bad = {str(i): t for i, t in enumerate(tasks) if "error" in t}
    assert len(bad) == 8
    for r in range(2):
        with open(os.path.join(tmp, f"adopters.json.rank{r}.json")) as f:
            results = {i: got for i, got in json.load(f).items() if "refused" not in got}
        assert sorted(results) == sorted(bad), results
        for i, task in bad.items():
            got = results[i]
            assert got["error"] is not None, f"rank {r}: adopting {task['load']} did not fail"
            assert task["error"] in got["error"], (r, task["error"], got["error"])
            assert got["unchanged"], f"rank {r}: the job's state changed before the error for {task['load']}"


@pytest.mark.parametrize("name", list(EXPORTS))
def test_exported_megatron_checkpoint_resumes_without_tenplex_and_losses_continue(adopted: tuple[str, str],
                                                                                 name: str) -> None:
    """A tenplex checkpoint exported as Megatron's torch_dist at another layout loads through megatron-core's own
    dist_checkpointing (the reference trainer without --tenplex) and iterations 4-6 equal the uninterrupted run's."""
    tmp, log = adopted
    scenario, to, _, optimizer_format = EXPORTS[name]
    out = os.path.join(tmp, name)
    with open(os.path.join(out, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "3"
    with open(os.path.join(out, "iter_0000003", "metadata.json")) as f:
        assert json.load(f)["sharded_backend"] == "torch_dist"
    common = _read_common(os.path.join(out, "iter_0000003"))
    args, lay = common["args"], ParallelLayout.parse(to)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.data_parallel_size) == \
        (lay.tp, lay.pp, lay.dp)
    assert args.consumed_train_samples == 24 and args.no_save_rng and common["iteration"] == 3, vars(args)
    assert common["checkpoint_version"] == 3.0 and "opt_param_scheduler" in common
    assert args.use_distributed_optimizer == (optimizer_format is not None)
    if optimizer_format is not None:
        with open(os.path.join(tmp, f"{name}.out")) as f:
            said = f.read()
        assert f"iteration 3 written to {out}/iter_0000003 as Megatron torch_dist at {lay} (distributed optimizer " \
               f"{optimizer_format})" in said, said
        assert dist_checkpointing_sharding(out) == optimizer_format
    assert f"> megatron-core dist_checkpointing: loaded iteration 3 from {out}/iter_0000003 at layout {lay}" in log
    after = metrics(os.path.join(tmp, f"{name}.jsonl"))
    assert [m["iteration"] for m in after] == [4, 5, 6]
    before = {m["iteration"]: m for m in metrics(os.path.join(tmp, REF[scenario], "ref.jsonl"))}
    for m in after:
        assert m["samples"] == before[m["iteration"]]["samples"]
        assert m["loss"] == pytest.approx(before[m["iteration"]]["loss"], rel=1e-5)


def dist_checkpointing_sharding(save_dir: str) -> str | None:
    """The distributed optimizer's format an iteration-3 torch_dist checkpoint records (its content metadata)."""
    from megatron.core import dist_checkpointing

    md = dist_checkpointing.load_content_metadata(os.path.join(save_dir, "iter_0000003"))
    return (md or {}).get("distrib_optim_sharding_type")


def test_a_job_without_tenplex_over_tenplex_checkpoints_stops_naming_export_megatron(adopted: tuple[str, str]) -> None:
    tmp, _ = adopted
    with open(os.path.join(tmp, "adopters.json")) as f:
        tasks = json.load(f)
    (i,) = [str(i) for i, t in enumerate(tasks) if t.get("refused")]
    for r in range(2):
        with open(os.path.join(tmp, f"adopters.json.rank{r}.json")) as f:
            msg = json.load(f)[i]["refused"]
        assert msg is not None, f"rank {r}: the job did not stop"
        assert f"{tmp}/tp2_dp_reshardable/ref/iter_0000006 is a tenplex checkpoint" in msg, msg
        assert "tenplex-megatron export-megatron" in msg and "run with --tenplex" in msg, msg


def test_inspect_reads_megatron_checkpoints_without_torch(adopted: tuple[str, str]) -> None:
    tmp, _ = adopted
    code = "import sys; sys.modules['torch'] = None\nfrom tenplex_megatron.cli import main\nsys.exit(main(sys.argv[1:]))"
    env = dict(os.environ, PYTHONPATH=ROOT)
    for name, layout in (("tp2_dp_reshardable", (2, 1, 1)), ("pp2_dp_reshardable", (1, 2, 1)),
                         ("dp2_dp_reshardable", (1, 1, 2))):
        p = subprocess.run([sys.executable, "-c", code, "inspect", f"{tmp}/{name}/mc", "--json"], capture_output=True,
                           text=True, env=env, timeout=120)
        assert p.returncode == 0, p.stderr[-2000:]
        summary = json.loads(p.stdout)
        assert summary["iteration"] == 3 and summary["consumed_samples"] == 24, summary
        assert summary["layout"] == dict(zip(("tp", "pp", "dp"), layout)), summary
        assert summary["format"] == "megatron torch_dist (dp_reshardable)" and summary["padded_vocab_size"] == 96
    for name, sharding in (("ep2_moe_dp_reshardable", "dp_reshardable"), ("ep2_moe_fully_reshardable",
                                                                          "fully_reshardable")):
        summary = json.loads(_cli(code, env, "inspect", f"{tmp}/{name}/mc", "--json"))
        assert summary["format"] == f"megatron torch_dist ({sharding})" and summary["distributed_optimizer"], summary
        assert summary["layout"] == {"tp": 1, "pp": 1, "dp": 2, "ep": 2}, summary
        assert summary["layout_source"] == "as plan describes it", summary
        experts = summary["experts"]
        assert (experts["num_experts"], experts["ep"], experts["expert_tp"], experts["expert_dp"]) == (4, 2, 1, 1)
        assert experts["complete"] and experts["expert_tensors"] > 0, experts
    ref = read_full_tensors(f"{tmp}/{REF['tp2_legacy_torch']}/ref/iter_0000003")
    params = sum(t.numel() for k, t in ref.items() if not k.startswith("optimizer."))
    tied_copy = ref["embedding.word_embeddings.weight"].numel()  # PP2: the last stage's copy, counted as stored
    for name, layout, optimizer in (("tp2_legacy_torch", (2, 1), "distributed (distrib_optim.pt)"),
                                    ("pp2_bf16_plain_legacy_torch", (1, 2), "plain (in model_optim_rng.pt)")):
        summary = json.loads(_cli(code, env, "inspect", f"{tmp}/{name}/mc", "--json", "--tensors"))
        assert summary["iteration"] == 3 and summary["consumed_samples"] == 24, summary
        assert (summary["layout"]["tp"], summary["layout"]["pp"]) == layout, summary
        assert summary["format"] == f"megatron legacy torch (optimizer: {optimizer})"
        assert summary["model_parameters"] == params + (tied_copy if layout[1] > 1 else 0), summary
        assert summary["padded_vocab_size"] == 96
        assert summary["num_layers"] == 2 and "decoder.layers.1.mlp.linear_fc2.weight" in summary["tensor_table"]
    p = subprocess.run([sys.executable, "-c", code, "inspect", f"{tmp}/bad_legacy"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert p.returncode == 2 and "mp_rank_01: missing" in p.stderr, p.stderr[-2000:]


def _cli(code: str, env: dict[str, str], *argv: str) -> str:
    p = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


def test_plan_on_megatron_checkpoints_without_torch(adopted: tuple[str, str]) -> None:
    """``plan --to`` on Megatron's own checkpoints (torch_dist and legacy) plans the same destination, rank by rank, as on the
    tenplex checkpoint of the same state at the same layout (written by the uninterrupted reference run)."""
    tmp, _ = adopted
    code = "import sys; sys.modules['torch'] = None\nfrom tenplex_megatron.cli import main\nsys.exit(main(sys.argv[1:]))"
    env = dict(os.environ, PYTHONPATH=ROOT)
    for name, (_, _, _, adopting) in SCENARIOS.items():
        tp, pp = (int(adopting[adopting.index(f) + 1]) for f in ("--tensor-model-parallel-size",
                                                                   "--pipeline-model-parallel-size"))
        tos = [f"tp={tp},pp={pp},dp={2 // (tp * pp)}"]
        if "moe" in name:  # a mixture of experts (router, experts, shared experts, expert bias) at other EP and PP
            tos += ["tp=1,pp=2,dp=1", "tp=1,pp=1,dp=2,ep=2"]
        for to in tos:
            got = json.loads(_cli(code, env, "plan", f"{tmp}/{name}/mc", "--to", to, "--json"))
            want = json.loads(_cli(code, env, "plan", f"{tmp}/{REF[name]}/ref", "--to", to, "--json"))
            assert got["from"] == want["from"] and got["to"] == want["to"], (got, want)
            assert got["distributed_optimizer"] == want["distributed_optimizer"], name
            assert got["padded_vocab_size"] == want["padded_vocab_size"] == 96, name
            assert got["bytes_per_rank"] == want["bytes_per_rank"] and got["bytes_total"] > 0, (name, to, got, want)
            # the same state, whatever copies each format keeps of it (Megatron's: each TP rank's of replicated
            # parameters' optimizer state)
            assert got["distinct_state_bytes"] == want["distinct_state_bytes"] <= got["state_bytes"], (name, got, want)
