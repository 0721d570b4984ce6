"""The main oracle: train at layout A, save, resume at layout B, compare with the uninterrupted run.

Each case runs the real pre-training flow (``training.pretrain.run``, what
scripts/pretrain_gpt.py runs) under torchrun (gloo, real megatron-core GPTModel,
DDP and optimizer): a reference run of 8 steps at layout A saves at step 3; a
second job at layout B loads that checkpoint, immediately saves what it loaded
(``--tenplex-resave``), then trains steps 4..8. The 89 jobs run in 7 torchrun
launches (``matrix_run.py``: jobs of one world size share a process group, each
with megatron-core's parallel state built afresh); every case keeps its own
assertions. The Llama-style, SP/VPP, fp16, overlapped-DDP and MoE families
(SLOW_FAMILIES) are marked slow: they run in launches of their own in
``make test-bench``. GPT-style models (learned positions, LayerNorm, biases) and a
Llama-style one (RoPE, RMSNorm, no biases, grouped-query attention) share them.

- Tensors: every tensor of the re-saved checkpoint (weights, Adam moments, fp32
  main weights where they exist) equals the original element for element at full
  size (read with safetensors' own reader, not our planner): bit-exact.
- Losses: steps 4..8 equal the reference within LOSS_RTOL. Only the order of
  floating-point reductions changes with the layout (TP splits the matmul
  reductions, PP/DP change where sums happen), so fp32 losses differ by a few
  ulps (fp32 epsilon is 1.2e-7; observed differences are at most ~3e-8
  relative) and five Adam steps do not amplify that beyond 2e-6.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import pytest
import torch

from tenplex_megatron.plan.experts import expert_summary
from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.plan.ptc import PTC
from tenplex_megatron.plan.sim.gpt_catalogue import GPTDims, gpt_tensors
from tenplex_megatron.plan.sim.sharding import layout_chunks
from tenplex_megatron.storage.directory import committed_iterations
from tests.harness import ROOT, TINY_GPT, layout_flags, metrics, read_full_tensors, stored_chunks, torchrun

pytestmark = pytest.mark.dist
MATRIX_RUN = os.path.join(ROOT, "tests", "multiproc", "matrix_run.py")

LOSS_RTOL = 2e-6
#: fp16's two loss-scaler regimes, each far from the overflow limit (near it, TP and DP round fp16 gradients
#: differently and a step one layout takes the other may skip): "skip": Megatron's default start (2^32) overflows
#: every step, the scale halves after 3 overflows in a row (the hysteresis tracker is mid-way at the save);
#: "grow": from 1024 the scale doubles every 2 steps without overflow (the growth tracker is mid-way at the save).
FP16_SCALERS = {"skip": ("--initial-loss-scale", str(2**32), "--hysteresis", "3"),
                "grow": ("--initial-loss-scale", "1024", "--loss-scale-window", "2")}
BF16_LOSS_RTOL = 2e-2
FP16_LOSS_RTOL = 1e-4  # fp16 weights (fp32 main weights and loss): measured up to 1e-6 relative  # bf16 weights: layout-dependent reduction order costs bf16 ulps (2^-8)
TRAIN_ITERS = 8
SAVE_AT = 3


#: A Llama-style model (with SwiGLU, untied output layer): 8 heads (the later flag overrides TINY_GPT's 4) in 4
#: key/value groups, so TP2 < groups, TP4 = groups, and TP2 <-> TP4 re-splits the groups (2 per rank <-> 1).
LLAMA_QUERY_GROUPS = 4
LLAMA_FLAGS = ("--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", str(LLAMA_QUERY_GROUPS),
               "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--disable-bias-linear")


@dataclass(frozen=True)
class Variant:
    distopt: bool = True
    vocab: int = 96  # 96 pads to 96 at TP1 and TP2: the padded vocab does not change
    untie: bool = False
    bf16: bool = False
    llama: bool = False  # LLAMA_FLAGS: RoPE, RMSNorm, no biases, 8 heads in 4 key/value groups
    sp: bool = False  # --sequence-parallel on both sides (Megatron-LM's rule turns it off at TP 1)
    layers: int = 2  # 4: PP2 x VPP2 has one layer per model chunk
    fp16: str = ""  # FP16_SCALERS' key: fp16 weights and the loss scaler's regime
    overlap: bool = False  # OVERLAP_DDP: overlapped grad reduce and param gather in 4,000-element buckets
    moe: str = ""  # MOE_FLAGS' key: a mixture-of-experts model (4 experts, top-2, load balancing on)
    grouped: bool = False  # --moe-grouped-gemm: megatron-core's GroupedMLP experts (bf16 only)

    def tag(self) -> str:
        return f"{'dist' if self.distopt else 'plain'}_v{self.vocab}{'_untied' if self.untie else ''}" \
               f"{'_bf16' if self.bf16 else ''}{'_llama' if self.llama else ''}{'_sp' if self.sp else ''}" \
               f"{f'_l{self.layers}' if self.layers != 2 else ''}{f'_fp16{self.fp16}' if self.fp16 else ''}" \
               f"{'_overlap' if self.overlap else ''}{f'_moe{self.moe}' if self.moe else ''}" \
               f"{'_grouped' if self.grouped else ''}"

    def flags(self) -> list[str]:
        f = ["--vocab-size", str(self.vocab), "--swiglu", "--train-iters", str(TRAIN_ITERS),
             "--num-layers", str(self.layers)]
        if self.sp:
            f.append("--sequence-parallel")
        if self.fp16:
            f.extend(["--fp16", *FP16_SCALERS[self.fp16]])
        if self.overlap:
            f.extend(OVERLAP_DDP)
        if self.llama:
            f.extend(LLAMA_FLAGS)
        if self.distopt:
            f.append("--use-distributed-optimizer")
        if self.untie:
            f.append("--untie-embeddings-and-output-weights")
        if self.bf16:
            f.append("--bf16")
        if self.moe:
            f.extend(MOE_FLAGS[self.moe])
        if self.grouped:
            f.append("--moe-grouped-gemm")
        return f


@dataclass(frozen=True)
class Scenario:
    """A resume: the checkpoint of ``src`` (a reference ``(layout, variant)`` or another scenario's re-save)
    loaded at layout ``dst``, re-saved at once, trained to ``iters``. ``solo``: in a launch of its own."""

    src: tuple[tuple[int, int, int], Variant] | str
    dst: tuple[int, int, int]
    variant: Variant
    iters: int = TRAIN_ITERS
    extra: tuple[str, ...] = ()
    solo: bool = False
    every: bool = False  # --load the source's directory with every checkpoint of it (3, 6, 8), not iteration 3's


def _world(layout: tuple[int, ...]) -> int:
    return layout[0] * layout[1] * layout[2]


def _layout_flags(layout: tuple[int, ...]) -> list[str]:
    """(TP, PP, DP), (TP, PP, DP, VPP) or (TP, PP, DP, VPP, EP, expert TP; 0: TP's) as the trainer's flags."""
    flags = layout_flags(layout[0], layout[1], layout[3] if len(layout) > 3 else 1)
    if len(layout) > 4:
        flags += ["--expert-model-parallel-size", str(layout[4])]
    if len(layout) > 5 and layout[5]:
        flags += ["--expert-tensor-parallel-size", str(layout[5])]
    return flags


class Runs:
    """Reference runs and resumes, shared between cases and batched into few torchrun launches.

    Each launch runs several jobs in turn (``matrix_run.py``): all references of
    one world size in one launch, all resumes of one world size in another (a
    resume whose source is another scenario's re-save runs after it). A failed
    launch fails every case that needs it, with its log.
    """

    def __init__(self, root: str, scenarios: dict[str, Scenario]):
        self.root = root
        self.scenarios = scenarios
        self.done: set[str] = set()
        self.failed: dict[str, str] = {}

    def ref_dir(self, layout: tuple[int, ...], v: Variant) -> str:
        return os.path.join(self.root, f"ref_{''.join(map(str, layout))}_{v.tag()}")

    def _refs(self) -> set[tuple]:
        return {sc.src for sc in self.scenarios.values() if not isinstance(sc.src, str)}

    def _launch(self, key: str, world: int, tasks: list[list[str]]) -> None:
        if key in self.failed:
            raise AssertionError(self.failed[key])
        path = os.path.join(self.root, f"{key}.json")
        with open(path, "w") as f:
            json.dump(tasks, f)
        r = torchrun(world, [path], timeout=240 + 60 * len(tasks), script=MATRIX_RUN)
        if r.returncode != 0 or r.log.count("tenplex-megatron: done") < len(tasks):
            self.failed[key] = f"launch {key} ({len(tasks)} jobs) failed:\n{r.log[-6000:]}"
            raise AssertionError(self.failed[key])
        self.done.add(key)

    def reference(self, layout: tuple[int, int, int], v: Variant) -> str:
        """The reference run at ``layout``: 8 steps from scratch, saving at step 3 (all of one world size at once)."""
        world = _world(layout)
        key = f"refs_w{world}"
        if key not in self.done:
            tasks = []
            for lay, var in sorted((r for r in self._refs() if _world(r[0]) == world), key=lambda r: (r[0], r[1].tag())):
                d = self.ref_dir(lay, var)
                os.makedirs(d, exist_ok=True)  # a failed launch made it: the retry reports that launch's error
                tasks.append([*TINY_GPT, *var.flags(), *_layout_flags(lay), "--save", f"{d}/ckpt",
                              "--save-interval", str(SAVE_AT), "--tenplex-metrics", f"{d}/metrics.jsonl"])
            self._launch(key, world, tasks)
        return self.ref_dir(layout, v)

    def source(self, sc: Scenario) -> str:
        """The checkpoint ``sc`` loads (made by then: ``resume`` runs every source first)."""
        return _resaved(os.path.join(self.root, sc.src)) if isinstance(sc.src, str) else _ckpt(self.ref_dir(*sc.src))

    def _group(self, name: str) -> str:
        sc = self.scenarios[name]
        return f"solo_{name}" if sc.solo else f"resumes_w{_world(sc.dst)}"

    def resume(self, name: str) -> str:
        """The directory of scenario ``name`` (``resave/`` and ``metrics.jsonl``), running its launch if needed."""
        key = self._group(name)
        if key not in self.done:
            members = [n for n in self.scenarios if self._group(n) == key]
            order: list[str] = []

            def visit(n: str) -> None:  # sources inside this launch first; others' launches before this one
                if n in order:
                    return
                src = self.scenarios[n].src
                if isinstance(src, str):
                    if self._group(src) == key:
                        visit(src)
                    else:
                        self.resume(src)
                else:
                    self.reference(*src)
                order.append(n)

            for n in members:
                visit(n)
            tasks = []
            for n in order:
                s = self.scenarios[n]
                d = os.path.join(self.root, n)
                os.makedirs(d, exist_ok=True)  # a failed launch made it: the retry reports that launch's error
                load = os.path.dirname(self.source(s)) if s.every else self.source(s)
                tasks.append([*TINY_GPT, *s.variant.flags(), *_layout_flags(s.dst), "--load", load,
                              "--tenplex-resave", f"{d}/resave", "--tenplex-metrics", f"{d}/metrics.jsonl",
                              "--exit-interval", str(s.iters), *s.extra])
            self._launch(key, _world(self.scenarios[name].dst), tasks)
        return os.path.join(self.root, name)


#: the families marked slow (make test-bench): Llama-style, SP/VPP, fp16, overlapped DDP and MoE, by scenario name
SLOW_FAMILIES = ("llama-", "sp-", "vpp-", "fp16-", "overlap-", "moe-")


def selected_scenarios(selected: set[str], slow: set[str]) -> dict[str, Scenario]:
    """The scenarios the selected tests need (the references of one world size share a launch, so the others'
    would run for nothing): ``test_transition``'s alone (``make test-compat``), the slow families' where a slow
    test is selected (``make test-bench``), the rest where another is (``make test``)."""
    if not selected - {"test_transition"}:
        return {n: sc for n, sc in SCENARIOS.items()
                if n in {f"{t}-{v.tag()}" for t in TRANSITIONS for v in (V_DIST, V_PLAIN)}}
    return {n: sc for n, sc in SCENARIOS.items() if (selected & slow if n.startswith(SLOW_FAMILIES)
                                                     else selected - slow)}


@pytest.fixture(scope="session")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """The shared runs of the selected tests (``selected_scenarios``)."""
    items = [item for item in request.session.items
             if getattr(item, "module", None) is not None and item.module.__name__ == __name__]
    selected = {getattr(item, "originalname", "") for item in items}
    slow = {getattr(item, "originalname", "") for item in items if item.get_closest_marker("slow")}
    return Runs(str(tmp_path_factory.mktemp("reshard")), selected_scenarios(selected, slow))


def _ckpt(ref: str, it: int = SAVE_AT) -> str:
    return os.path.join(ref, "ckpt", f"iter_{it:07d}")


def _resaved(d: str) -> str:
    return os.path.join(d, "resave", f"iter_{SAVE_AT:07d}")


def assert_tensors_equal(src_dir: str, dst_dir: str, vocab: int) -> int:
    """Full-size equality of every tensor; where the padded vocab size changed, real rows equal, padding zero."""
    a, b = read_full_tensors(src_dir), read_full_tensors(dst_dir)
    assert set(a) == set(b), set(a) ^ set(b)
    for key in a:
        x, y = a[key], b[key]
        assert not torch.isnan(x.double()).any() and not torch.isnan(y.double()).any(), f"{key}: not fully covered"
        if x.shape != y.shape:
            assert x.shape[1:] == y.shape[1:], key
            assert torch.equal(x[:vocab], y[:vocab]), f"{key}: real vocabulary rows differ"
            assert torch.all(y[vocab:] == 0), f"{key}: padding rows of a changed padded size must be zero"
        else:
            assert x.dtype == y.dtype, key
            assert torch.equal(x, y), f"{key}: differs after re-sharding"
    return len(a)


def assert_losses_continue(ref: str, resumed: str, rtol: float, first_only: bool = False) -> None:
    a = {m["iteration"]: m for m in metrics(os.path.join(ref, "metrics.jsonl"))}
    b = metrics(os.path.join(resumed, "metrics.jsonl"))
    assert [m["iteration"] for m in b] == list(range(SAVE_AT + 1, TRAIN_ITERS + 1))
    for m in b[:1] if first_only else b:
        r = a[m["iteration"]]
        assert m["samples"] == r["samples"], f"iteration {m['iteration']}: global batch differs"
        assert m["lr"] == pytest.approx(r["lr"], rel=1e-12)
        assert m["loss"] == pytest.approx(r["loss"], rel=rtol), (m["iteration"], m["loss"], r["loss"])


TRANSITIONS = {
    "TP2-TP1": ((2, 1, 1), (1, 1, 1)),
    "TP1-TP2": ((1, 1, 1), (2, 1, 1)),
    "PP2-PP1": ((1, 2, 1), (1, 1, 1)),
    "PP1-PP2": ((1, 1, 1), (1, 2, 1)),
    "DP2-DP1": ((1, 1, 2), (1, 1, 1)),
    "DP1-DP2": ((1, 1, 1), (1, 1, 2)),
    "TP2-PP2": ((2, 1, 1), (1, 2, 1)),
    "TP2PP2-DP4": ((2, 2, 1), (1, 1, 4)),
}

V_DIST, V_PLAIN, V_UNTIE, V_100, V_BF16 = (Variant(), Variant(distopt=False), Variant(untie=True), Variant(vocab=100),
                                           Variant(bf16=True))
V_LLAMA = Variant(vocab=128, untie=True, llama=True)  # 128: the padded vocabulary is 128 at TP 1, 2 and 4
#: name -> (from, to, what it covers) for the Llama-style model (distributed optimizer)
LLAMA_TRANSITIONS = {
    "llama-TP2-TP4": ((2, 1, 1), (4, 1, 1), "TP < groups -> TP = groups: 2 groups per rank split to 1"),
    "llama-TP4-TP2": ((4, 1, 1), (2, 1, 1), "TP = groups -> TP < groups: groups joined 2 per rank"),
    "llama-TP2-PP2": ((2, 1, 1), (1, 2, 1), "a PP change (and TP2 -> TP1: all groups on one rank)"),
    "llama-DP1-DP2": ((2, 1, 1), (2, 1, 2), "a DP change: the distributed optimizer's shards re-cut"),
}
#: What GPU runs turn on: sequence parallelism and interleaved (virtual) pipelines, each changed in both directions.
#: name -> (from, to, variant, what it covers); a 4th layout entry is VPP (model chunks per pipeline rank).
V_SP, V_L4, V_L4_PLAIN, V_L4_SP = (Variant(sp=True), Variant(layers=4), Variant(layers=4, distopt=False),
                                   Variant(layers=4, sp=True))
GPU_FLAG_TRANSITIONS = {
    "sp-TP2-TP1DP2": ((2, 1, 1), (1, 1, 2), V_SP, "TP2 + SP -> TP1 x DP2 (SP off at TP 1, as in Megatron-LM)"),
    "sp-TP1DP2-TP2": ((1, 1, 2), (2, 1, 1), V_SP, "TP1 x DP2 -> TP2 + SP"),
    "vpp-PP2VPP2-TP2": ((1, 2, 1, 2), (2, 1, 1), V_L4, "PP2 x VPP2 -> TP2"),
    "vpp-TP2-PP2VPP2": ((2, 1, 1), (1, 2, 1, 2), V_L4, "TP2 -> PP2 x VPP2"),
    "vpp-PP2VPP2-PP2": ((1, 2, 1, 2), (1, 2, 1), V_L4, "VPP2 -> plain PP2 on the same ranks"),
    "vpp-PP2VPP2-DP2-plain": ((1, 2, 1, 2), (1, 1, 2), V_L4_PLAIN, "PP2 x VPP2 -> DP2, plain optimizer"),
    "vpp-sp-TP2PP2VPP2-DP4": ((2, 2, 1, 2), (1, 1, 4), V_L4_SP, "TP2 + SP x PP2 x VPP2 -> DP4"),
    "vpp-sp-DP4-TP2PP2VPP2": ((1, 1, 4), (2, 2, 1, 2), V_L4_SP, "DP4 -> TP2 + SP x PP2 x VPP2"),
}
OVERLAP_DDP = ("--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "4000")
V_OVERLAP = Variant(bf16=True, overlap=True)
#: bf16 with overlapped DDP in many buckets, as a GPU run at scale sets it; each side of a TP <-> DP change
OVERLAP_TRANSITIONS = {"overlap-DP2-TP2": ((1, 1, 2), (2, 1, 1)), "overlap-TP2-DP2": ((2, 1, 1), (1, 1, 2))}
FP16_TRANSITIONS = {f"fp16-{regime}": ((2, 1, 1), (1, 1, 2), Variant(fp16=regime)) for regime in FP16_SCALERS}
#: Mixture-of-experts models (Mixtral-style: SwiGLU experts, no biases; top-2 routing with the load-balancing loss
#: on): "mixtral" with the allgather dispatcher; "deepseek" with sigmoid scores, the aux-loss-free expert bias (router
#: state that is not a parameter), a shared expert beside the routed ones and the alltoall dispatcher.
MOE_BASE = ("--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear")
MOE_FLAGS = {"mixtral": (*MOE_BASE, "--moe-aux-loss-coeff", "0.01"),
             "deepseek": (*MOE_BASE, "--moe-aux-loss-coeff", "0.01", "--moe-router-score-function", "sigmoid",
                          "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.01",
                          "--moe-token-dispatcher-type", "alltoall", "--moe-shared-expert-intermediate-size", "32")}
V_MOE, V_MOE_SP, V_MOE_DS = Variant(moe="mixtral"), Variant(moe="mixtral", sp=True), Variant(moe="deepseek")
#: grouped-GEMM experts (GroupedMLP runs in bf16 only), with the distributed and the plain optimizer
V_GG, V_GG_PLAIN = Variant(moe="mixtral", bf16=True, grouped=True), Variant(moe="mixtral", bf16=True, grouped=True,
                                                                             distopt=False)
#: bf16 (GroupedMLP's only precision) with the layout-dependent reduction order: up to 1.9e-5 relative on these
#: transitions, and the same size for SequentialMLP's experts in bf16; describing weight1 with its gate/up axis in the
#: wrong place moved the losses by 6e-4 to 2e-3 (measured 2026-11-27 on the 2-core CPU runner, scratch runs of these
#: jobs on branch moe-grouped, in the commit that added them; the wrong description a local edit of grouped.py)
GROUPED_LOSS_RTOL = 1e-4
EP2, EP1_DP2 = (1, 1, 2, 1, 2, 0), (1, 1, 2, 1, 1, 0)
#: name -> (source: a reference (layout, variant) or another scenario's re-save, destination, variant, extra flags of
#: the destination, what it covers); layouts are (TP, PP, DP, VPP, EP, expert TP; 0: TP's)
MOE_TRANSITIONS: dict[str, tuple] = {
    "moe-EP2-EP1DP2": ((EP2, V_MOE), EP1_DP2, V_MOE, (), "EP2 -> EP1 x DP2: the experts' own sub-optimizer joins "
                       "the dense one, same world size"),
    "moe-EP1DP2-EP2": ("moe-EP2-EP1DP2", EP2, V_MOE, (), "EP1 x DP2 -> EP2 (back: bit-exact round trip)"),
    "moe-EP2-PP2": ((EP2, V_MOE), (1, 2, 1, 1, 1, 0), V_MOE, (), "EP2 -> PP2 x EP1: each stage's layers' experts"),
    "moe-EP2-TP2": ((EP2, V_MOE), (2, 1, 1, 1, 1, 0), V_MOE, ("--sequence-parallel",),
                    "EP2 -> TP2 x EP1 (with SP, which megatron-core needs for MoE at TP > 1): experts cut by TP"),
    "moe-ETP2-ETP1": (((2, 1, 1, 1, 1, 0), V_MOE_SP), (2, 1, 1, 1, 2, 1), V_MOE_SP, (),
                      "TP2 + SP, expert TP2 x EP1 -> expert TP1 x EP2: experts whole again, spread over EP"),
    "moe-EP2DP2-EP4": (((1, 1, 4, 1, 2, 0), V_MOE_DS), (1, 1, 4, 1, 4, 0), V_MOE_DS, (),
                       "EP2 x expert DP2 -> EP4 on 4 ranks, alltoall dispatcher, expert bias"),
    "moe-grouped-EP2-EP1DP2": ((EP2, V_GG), EP1_DP2, V_GG, (), "grouped-GEMM experts, EP2 -> EP1 x DP2: each rank's "
                               "one box of two experts re-cut into four, distributed optimizer's flat ranges"),
    "moe-grouped-EP2-TP2": ((EP2, V_GG), (2, 1, 1, 1, 1, 0), V_GG, ("--sequence-parallel",),
                            "grouped-GEMM experts, EP2 -> TP2 + SP x EP1: every expert cut by expert TP 2"),
    "moe-grouped-EP2-TP2-plain": ((EP2, V_GG), (2, 1, 1, 1, 1, 0), V_GG_PLAIN, ("--sequence-parallel",),
                                  "the same into the plain optimizer (its state described and re-saved whole)"),
}
MEGATRON_PADDING = ("--tenplex-vocab-padding", "megatron")
#: Megatron-LM's checkpoint flags (plan/megatron_ckpt_flags.py), each loading the TP2 reference's directory (its
#: checkpoints of iterations 3, 6 and 8): name -> (destination layout, flags, iterations trained to). Fine-tunes and
#: fresh optimizers have no uninterrupted run to follow: each is run at TP2 and at TP1 x DP2, whose losses must agree.
CKPT_FLAG_CASES = {
    "ckpt-step-TP2-DP2": ((1, 1, 2), ("--ckpt-step", str(SAVE_AT)), TRAIN_ITERS),
    **{f"finetune-{tag}": (dst, ("--finetune",), SAVE_AT) for tag, dst in (("TP2", (2, 1, 1)), ("DP2", (1, 1, 2)))},
    **{f"no-load-optim-{tag}": (dst, ("--ckpt-step", str(SAVE_AT), "--no-load-optim"), TRAIN_ITERS)
       for tag, dst in (("TP2", (2, 1, 1)), ("DP2", (1, 1, 2)))},
}
SCENARIOS: dict[str, Scenario] = {
    **{f"{n}-{v.tag()}": Scenario((a, v), b, v) for n, (a, b) in TRANSITIONS.items() for v in (V_DIST, V_PLAIN)},
    **{f"untied-{a}-{b}": Scenario((a, V_UNTIE), b, V_UNTIE) for a, b in (((2, 1, 1), (1, 2, 1)),
                                                                           ((1, 2, 1), (2, 1, 1)))},
    **{f"vocab-megatron-{a}-{b}": Scenario((a, V_100), b, V_100, extra=MEGATRON_PADDING)
       for a, b in (((2, 1, 1), (1, 1, 1)), ((1, 1, 1), (2, 1, 1)))},
    **{f"vocab-keep-{a}-{b}": Scenario((a, V_100), b, V_100) for a, b in (((2, 1, 1), (1, 1, 1)),
                                                                           ((1, 1, 1), (2, 1, 1)))},
    "bf16": Scenario(((2, 1, 1), V_BF16), (1, 1, 2), V_BF16),
    **{n: Scenario((a, V_LLAMA), b, V_LLAMA) for n, (a, b, _) in LLAMA_TRANSITIONS.items()},
    **{n: Scenario((a, v), b, v) for n, (a, b, v, _) in GPU_FLAG_TRANSITIONS.items()},
    **{n: Scenario((a, v), b, v) for n, (a, b, v) in FP16_TRANSITIONS.items()},
    **{n: Scenario((a, V_OVERLAP), b, V_OVERLAP) for n, (a, b) in OVERLAP_TRANSITIONS.items()},
    "rt-there-(2, 2, 1)-(1, 1, 4)": Scenario(((2, 2, 1), V_DIST), (1, 1, 4), V_DIST, iters=SAVE_AT),
    "rt-back-(2, 2, 1)-(1, 1, 4)": Scenario("rt-there-(2, 2, 1)-(1, 1, 4)", (2, 2, 1), V_DIST, iters=SAVE_AT),
    "rt-there-(1, 1, 2)-(1, 1, 1)": Scenario(((1, 1, 2), V_PLAIN), (1, 1, 1), V_PLAIN, iters=SAVE_AT),
    "rt-back-(1, 1, 2)-(1, 1, 1)": Scenario("rt-there-(1, 1, 2)-(1, 1, 1)", (1, 1, 2), V_PLAIN, iters=SAVE_AT),
    **{n: Scenario(src, dst, v, extra=extra) for n, (src, dst, v, extra, _) in MOE_TRANSITIONS.items()},
    "moe-rng-same": Scenario((EP2, V_MOE), EP2, V_MOE, iters=SAVE_AT),
    # TP 2 given, EP and expert TP left to --tenplex-layout auto (MOE_AUTO_ETP)
    "moe-auto-ETP": Scenario(((2, 1, 1, 1, 1, 0), V_MOE_SP), (2, 1, 1), V_MOE_SP, extra=("--tenplex-layout", "auto")),
    "rng-same": Scenario(((2, 1, 1), V_DIST), (2, 1, 1), V_DIST, iters=SAVE_AT),
    **{n: Scenario(((2, 1, 1), V_DIST), dst, V_DIST, every=True, extra=extra, iters=iters)
       for n, (dst, extra, iters) in CKPT_FLAG_CASES.items()},
    "rng-changed-a": Scenario(((2, 1, 1), V_DIST), (1, 1, 2), V_DIST, iters=SAVE_AT),
    "rng-changed-b": Scenario(((2, 1, 1), V_DIST), (1, 1, 2), V_DIST, iters=SAVE_AT, solo=True),
}


@pytest.mark.parametrize("distopt", [True, False], ids=["distopt", "plainopt"])
@pytest.mark.parametrize("name", list(TRANSITIONS))
def test_transition(runs: Runs, name: str, distopt: bool) -> None:
    src, dst = TRANSITIONS[name]
    v = Variant(distopt=distopt)
    ref = runs.reference(src, v)
    d = runs.resume(f"{name}-{v.tag()}")
    n = assert_tensors_equal(_ckpt(ref), _resaved(d), v.vocab)
    keys = set(read_full_tensors(_resaved(d)))
    assert any(k.startswith("optimizer.state.exp_avg.") for k in keys)
    assert any(k.startswith("optimizer.state.exp_avg_sq.") for k in keys)
    assert n > 20
    assert_losses_continue(ref, d, LOSS_RTOL)
    assert_layout_model_matches(_resaved(d), dst, distopt)


def assert_layout_model_matches(ckpt_dir: str, layout: tuple[int, int, int] | ParallelLayout, distopt: bool) -> None:
    """The pure layout model (used by the dry-run planner) puts chunks exactly where megatron-core did.

    Under the distributed optimizer only model tensors are compared: its flat
    boundaries follow megatron-core's bucket order, which the model approximates.
    """
    import json

    with open(os.path.join(ckpt_dir, "metadata.json")) as f:
        ptc = PTC.from_json(json.load(f)["ptc"])
    lay = layout if isinstance(layout, ParallelLayout) else ParallelLayout(*layout)
    predicted = {c for cs in layout_chunks(ptc.tensors, lay, distopt).values() for c in cs}
    stored = {sc.chunk for sc in ptc.chunks}
    if distopt:
        predicted = {c for c in predicted if ptc.tensors[c.key].param is None}
        stored = {c for c in stored if ptc.tensors[c.key].param is None}
    assert predicted == stored, (predicted ^ stored)


@pytest.mark.parametrize("src,dst", [((2, 1, 1), (1, 2, 1)), ((1, 2, 1), (2, 1, 1))], ids=["TP2-PP2", "PP2-TP2"])
def test_untied_output_layer(runs: Runs, src, dst) -> None:
    v = Variant(untie=True)
    ref = runs.reference(src, v)
    d = runs.resume(f"untied-{src}-{dst}")
    assert "output_layer.weight" in read_full_tensors(_resaved(d))
    assert_tensors_equal(_ckpt(ref), _resaved(d), v.vocab)
    assert_losses_continue(ref, d, LOSS_RTOL)


@pytest.mark.parametrize("src,dst", [((2, 1, 1), (1, 1, 1)), ((1, 1, 1), (2, 1, 1))], ids=["TP2-TP1", "TP1-TP2"])
def test_vocab_padding_megatron_rule_changes_padded_size(runs: Runs, src, dst) -> None:
    """vocab 100 pads to 128 at TP2 and 112 at TP1 by Megatron's rule: real rows move exactly, new padding is zero.

    Megatron's softmax runs over the padded vocabulary, so padding rows take part
    in the loss: a different padded size is a different model, and the losses can
    only be close (bound 5e-2 relative; measured 2.4e-2 on this tiny model, whose
    trained padding logits are a large share of the softmax). This is why the
    default (``keep``, next test) keeps the padded size when the new TP divides it.
    """
    v = Variant(vocab=100)
    ref = runs.reference(src, v)
    d = runs.resume(f"vocab-megatron-{src}-{dst}")
    full = read_full_tensors(_resaved(d))
    assert full["embedding.word_embeddings.weight"].shape[0] == (112 if dst[0] == 1 else 128)
    assert_tensors_equal(_ckpt(ref), _resaved(d), v.vocab)
    assert_losses_continue(ref, d, 5e-2)


@pytest.mark.parametrize("src,dst", [((2, 1, 1), (1, 1, 1)), ((1, 1, 1), (2, 1, 1))], ids=["TP2-TP1", "TP1-TP2"])
def test_vocab_padding_kept_when_tp_divides_it(runs: Runs, src, dst) -> None:
    """vocab 100 (not a multiple of the padding): the restart keeps the saved padded size, losses are exact."""
    v = Variant(vocab=100)
    ref = runs.reference(src, v)
    d = runs.resume(f"vocab-keep-{src}-{dst}")
    saved = read_full_tensors(_ckpt(ref))["embedding.word_embeddings.weight"].shape[0]
    assert saved == (128 if src[0] == 2 else 112)
    assert read_full_tensors(_resaved(d))["embedding.word_embeddings.weight"].shape[0] == saved
    assert_tensors_equal(_ckpt(ref), _resaved(d), v.vocab)
    assert_losses_continue(ref, d, LOSS_RTOL)


def test_bf16_distributed_optimizer_fp32_main_params(runs: Runs) -> None:
    v = Variant(bf16=True)
    ref = runs.reference((2, 1, 1), v)
    d = runs.resume("bf16")
    full = read_full_tensors(_resaved(d))
    assert full["decoder.layers.mlp.linear_fc2.weight"].dtype == torch.bfloat16
    assert full["optimizer.state.fp32_param.decoder.layers.mlp.linear_fc2.weight"].dtype == torch.float32
    assert_tensors_equal(_ckpt(ref), _resaved(d), v.vocab)
    assert_losses_continue(ref, d, BF16_LOSS_RTOL)


@pytest.mark.parametrize(
    "a,b,distopt", [((2, 2, 1), (1, 1, 4), True), ((1, 1, 2), (1, 1, 1), False)], ids=["TP2PP2-DP4", "DP2-DP1-plain"]
)
def test_round_trip_is_bit_exact(runs: Runs, a, b, distopt: bool) -> None:
    v = Variant(distopt=distopt)
    ref = runs.reference(a, v)
    back = runs.resume(f"rt-back-{a}-{b}")
    orig, again = stored_chunks(_ckpt(ref)), stored_chunks(_resaved(back))
    assert set(orig) == set(again)
    for k in orig:
        assert orig[k].dtype == again[k].dtype and torch.equal(orig[k], again[k]), k


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LLAMA_TRANSITIONS))
def test_llama_style_model(runs: Runs, name: str) -> None:
    """RoPE + RMSNorm + SwiGLU + no biases + untied output + grouped-query attention: bit-exact re-save, exact
    losses, the layout model's chunks, and a model record from which the catalogue rebuilds the tensor table."""
    src, dst, _ = LLAMA_TRANSITIONS[name]
    v = V_LLAMA
    ref = runs.reference(src, v)
    d = runs.resume(name)
    full = read_full_tensors(_resaved(d))
    heads, hidden = 8, 64
    kv = hidden // heads
    assert full["decoder.layers.self_attention.linear_qkv.weight"].shape == (2, hidden + 2 * LLAMA_QUERY_GROUPS * kv,
                                                                              hidden)
    assert "output_layer.weight" in full
    assert not [k for k in full if k.endswith("bias") or "position_embeddings" in k], sorted(full)
    assert_tensors_equal(_ckpt(ref), _resaved(d), v.vocab)
    assert_losses_continue(ref, d, LOSS_RTOL)
    assert_layout_model_matches(_resaved(d), dst, True)
    with open(os.path.join(_resaved(d), "metadata.json")) as f:
        meta = json.load(f)
    model = meta["model"]
    assert (model["position_embedding_type"], model["normalization"], model["add_bias_linear"],
            model["group_query_attention"], model["num_query_groups"], model["rotary_base"],
            model["rotary_percent"]) == ("rope", "RMSNorm", False, True, LLAMA_QUERY_GROUPS, 10000, 1.0)
    assert gpt_tensors(GPTDims.from_record(model), meta["padded_vocab_size"]) == PTC.from_json(meta["ptc"]).tensors


def _rng(ckpt_dir: str) -> dict:
    import json

    with open(os.path.join(ckpt_dir, "metadata.json")) as f:
        return json.load(f)["rng"]


def test_rng_policy(runs: Runs) -> None:
    """Same layout: every rank's RNG states come back exactly. Changed layout: re-seeded from (seed, iteration),
    so two restarts at the same new layout agree with each other (and not with the saved streams)."""
    v = Variant()
    ref = runs.reference((2, 1, 1), v)
    same = runs.resume("rng-same")
    assert _rng(_resaved(same)) == _rng(_ckpt(ref))
    a = runs.resume("rng-changed-a")
    b = runs.resume("rng-changed-b")  # in a launch of its own: a restart in a fresh process agrees
    ra, rb = _rng(_resaved(a)), _rng(_resaved(b))
    assert ra == rb
    assert ra["0"]["torch"] != _rng(_ckpt(ref))["0"]["torch"]
    assert ra["0"]["tracker"] != _rng(_ckpt(ref))["0"]["tracker"]


def _recorded_layout(ckpt_dir: str) -> ParallelLayout:
    with open(os.path.join(ckpt_dir, "metadata.json")) as f:
        return ParallelLayout.from_json(json.load(f)["layout"])


def _expected_layout(layout: tuple[int, ...], v: Variant) -> ParallelLayout:
    return ParallelLayout(*layout, sp=v.sp and layout[0] > 1)  # type: ignore[misc]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(GPU_FLAG_TRANSITIONS))
def test_sequence_parallel_and_interleaved_pipelines(runs: Runs, name: str) -> None:
    """SP and VPP on either side of a restart: the layout (with SP and VPP) recorded, the re-saved tensors equal the
    originals element by element, the losses continue the uninterrupted run's, and the pure layout model puts the
    model's chunks (every virtual stage's layers) where megatron-core did."""
    src, dst, v, _ = GPU_FLAG_TRANSITIONS[name]
    ref = runs.reference(src, v)
    d = runs.resume(name)
    assert _recorded_layout(_ckpt(ref)) == _expected_layout(src, v)
    assert _recorded_layout(_resaved(d)) == _expected_layout(dst, v)
    full = read_full_tensors(_resaved(d))
    assert full["decoder.layers.mlp.linear_fc2.weight"].shape[0] == v.layers
    assert_tensors_equal(_ckpt(ref), _resaved(d), v.vocab)
    assert_losses_continue(ref, d, LOSS_RTOL)
    assert_layout_model_matches(_resaved(d), dst, v.distopt)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FP16_TRANSITIONS))
def test_fp16_loss_scaler_continues(runs: Runs, name: str) -> None:
    """fp16 with a dynamic loss scaler, TP2 -> TP1 x DP2: the scaler's state (scale, growth and hysteresis trackers)
    comes back, so after the restart every step is skipped or taken as in the uninterrupted run, at the same scale;
    the fp32 main weights and moments are bit-exact and the losses continue."""
    src, dst, v = FP16_TRANSITIONS[name]
    ref = runs.reference(src, v)
    d = runs.resume(name)
    full = read_full_tensors(_resaved(d))
    assert full["decoder.layers.mlp.linear_fc2.weight"].dtype == torch.float16
    assert full["optimizer.state.fp32_param.decoder.layers.mlp.linear_fc2.weight"].dtype == torch.float32
    assert_tensors_equal(_ckpt(ref), _resaved(d), v.vocab)
    a = {m["iteration"]: m for m in metrics(os.path.join(ref, "metrics.jsonl"))}
    b = metrics(os.path.join(d, "metrics.jsonl"))
    assert [(m["skipped"], m["loss_scale"]) for m in b] == [(a[m["iteration"]]["skipped"], a[m["iteration"]][
        "loss_scale"]) for m in b]
    skipped = [m["skipped"] for m in a.values()]
    assert all(skipped) if v.fp16 == "skip" else not any(skipped)
    scales = [m["loss_scale"] for m in b]
    assert scales == sorted(scales, reverse=v.fp16 == "skip") and len(set(scales)) > 1  # the scale moved
    assert_losses_continue(ref, d, FP16_LOSS_RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OVERLAP_TRANSITIONS))
def test_overlapped_ddp_in_buckets(runs: Runs, name: str) -> None:
    """bf16 with --overlap-grad-reduce --overlap-param-gather in 4,000-element buckets (the distributed optimizer's
    shards cut bucket by bucket): the save sees the stepped weights (the deferred all-gather is forced first), the
    re-saved tensors equal the originals, and the losses continue."""
    src, dst = OVERLAP_TRANSITIONS[name]
    ref = runs.reference(src, V_OVERLAP)
    d = runs.resume(name)
    assert_tensors_equal(_ckpt(ref), _resaved(d), V_OVERLAP.vocab)
    assert_losses_continue(ref, d, BF16_LOSS_RTOL)


def _moe_ref(name: str) -> tuple[tuple[int, ...], Variant]:
    """The reference run a MoE scenario continues: its own source, or its source scenario's."""
    src = MOE_TRANSITIONS[name][0]
    return MOE_TRANSITIONS[src][0] if isinstance(src, str) else src


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MOE_TRANSITIONS))
def test_mixture_of_experts(runs: Runs, name: str) -> None:
    """A mixture-of-experts GPT restarted at another EP, expert TP, TP or PP: the layout (EP, expert TP) recorded,
    every expert present once at full size and equal to the original element by element (router, expert bias and
    the chained dense + expert optimizer's moments and main weights included), and the losses (top-2 routing with
    the load-balancing loss on) continue the uninterrupted run's. SequentialMLP's experts in fp32, and GroupedMLP's
    (``--moe-grouped-gemm``, bf16 only: the first step after the restart, which only the loaded state decides, within
    LOSS_RTOL where the restart changes no reduction, the others within GROUPED_LOSS_RTOL)."""
    _, dst, v, extra, _ = MOE_TRANSITIONS[name]
    ref_layout, ref_v = _moe_ref(name)
    ref = runs.reference(ref_layout, ref_v)
    d = runs.resume(name)
    recorded = _recorded_layout(_resaved(d))
    assert (recorded.ep, recorded.expert_tp) == (dst[4], dst[5] or dst[0])
    full = read_full_tensors(_resaved(d))
    fc1 = GROUPED_FC1 if v.grouped else SEQUENTIAL_FC1
    assert full[fc1].shape[:2] == (2, 4)  # (layers, experts, ...): all four experts of both layers
    assert f"optimizer.state.exp_avg.{fc1}" in full
    assert (SEQUENTIAL_FC1 in full) != v.grouped  # one kind of experts only
    if v.grouped:  # GroupedMLP's memory order: [layers, experts, hidden, gate and up, ffn], [.., ffn, hidden]
        assert full[fc1].shape == (2, 4, 64, 2, 256) and full[GROUPED_FC2].shape == (2, 4, 256, 64)
        assert full[fc1].dtype == torch.bfloat16 and full[f"optimizer.state.fp32_param.{fc1}"].dtype == torch.float32
    assert "decoder.layers.mlp.router.weight" in full
    if v.moe == "deepseek":
        bias = full["decoder.layers.mlp.router.expert_bias"]
        assert bias.shape == (2, 4) and bool(bias.abs().sum() > 0)  # the balancing state moved: it is compared
        shared = [k for k in full if k.startswith("decoder.layers.mlp.shared_experts.")]
        assert shared and all(f"optimizer.state.exp_avg.{k}" in full for k in shared), shared  # and its moments
    assert_tensors_equal(_ckpt(ref), _resaved(d), v.vocab)
    assert_losses_continue(ref, d, GROUPED_LOSS_RTOL if v.grouped else LOSS_RTOL)
    if v.grouped and dst[0] == ref_layout[0]:  # no TP change: the first step's forward is the uninterrupted run's
        assert_losses_continue(ref, d, LOSS_RTOL, first_only=True)
    # the pure layout model behind `plan --model` describes and places the experts as megatron-core did, and the
    # expert check (inspect, verify) finds every expert stored in full
    with open(os.path.join(_resaved(d), "metadata.json")) as f:
        meta = json.load(f)
    ptc = PTC.from_json(meta["ptc"])
    assert gpt_tensors(GPTDims.from_record(meta["model"]), meta["padded_vocab_size"]) == ptc.tensors
    assert_layout_model_matches(_resaved(d), recorded, v.distopt)
    summary = expert_summary(ptc, meta["layout"])
    assert summary is not None and summary.complete
    assert (summary.num_experts, summary.ep, summary.expert_tp) == (4, recorded.ep, recorded.expert_tp)


SEQUENTIAL_FC1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
GROUPED_FC1, GROUPED_FC2 = "decoder.layers.mlp.experts.weight1", "decoder.layers.mlp.experts.weight2"


@pytest.mark.slow
def test_mixture_of_experts_rng(runs: Runs) -> None:
    """The expert-parallel RNG stream comes back exactly at the same layout (every rank's), and is re-seeded from
    (seed, iteration) at a new one, as the dense streams are."""
    ref = runs.reference(EP2, V_MOE)
    same = runs.resume("moe-rng-same")
    saved = _rng(_ckpt(ref))
    assert "expert-parallel-rng" in saved["0"]["tracker"]
    assert _rng(_resaved(same)) == saved
    assert saved["0"]["tracker"]["expert-parallel-rng"] != saved["1"]["tracker"]["expert-parallel-rng"]
    changed = _rng(_resaved(runs.resume("moe-EP2-EP1DP2")))
    assert changed["1"]["tracker"]["expert-parallel-rng"] != saved["1"]["tracker"]["expert-parallel-rng"]


@pytest.mark.slow
def test_auto_chooses_and_applies_expert_tp(runs: Runs, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--tenplex-layout auto`` for a mixture of experts with TP 2 given (and --sequence-parallel), restarting from
    an expert TP 2 checkpoint: the job ran the model's choice, expert TP 1 x EP 2 (experts whole, spread over EP:
    cheaper than expert TP's gathers in the model), built megatron-core's expert groups for it, loaded the
    checkpoint re-sharded into it and trained: every iteration's metrics and the re-save record that layout, every
    tensor equals the original, and the losses continue the uninterrupted expert TP 2 run's."""
    from tenplex_megatron.training.pretrain import parse_args

    sc = SCENARIOS["moe-auto-ETP"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    args = parse_args([*TINY_GPT, *sc.variant.flags(), *_layout_flags(sc.dst), *sc.extra])  # what the job parsed
    want = ParallelLayout(2, 1, 1, sp=True, ep=args.expert_model_parallel_size, etp=args.expert_tensor_parallel_size)
    assert (want.tp, want.expert_tp, want.ep) == (2, 1, 2), want
    ref = runs.reference(*sc.src)  # type: ignore[misc]
    d = runs.resume("moe-auto-ETP")
    assert _recorded_layout(_resaved(d)) == want
    got = metrics(os.path.join(d, "metrics.jsonl"))
    assert [m["iteration"] for m in got] == list(range(SAVE_AT + 1, TRAIN_ITERS + 1))
    assert all(ParallelLayout.from_json(m["layout"]) == want for m in got)
    assert_tensors_equal(_ckpt(ref), _resaved(d), sc.variant.vocab)
    assert_losses_continue(ref, d, LOSS_RTOL)


def _model_tensors(ckpt_dir: str) -> dict[str, torch.Tensor]:
    return {k: t for k, t in read_full_tensors(ckpt_dir).items() if not k.startswith("optimizer.")}


def _metadata(ckpt_dir: str) -> dict:
    with open(os.path.join(ckpt_dir, "metadata.json")) as f:
        return json.load(f)


def test_ckpt_step_loads_an_earlier_checkpoint_at_another_layout(runs: Runs) -> None:
    """--ckpt-step 3 over a directory whose newest is 8, at TP1 x DP2: iteration 3's state, its losses continued."""
    ref = runs.reference((2, 1, 1), V_DIST)
    d = runs.resume("ckpt-step-TP2-DP2")
    assert committed_iterations(os.path.join(ref, "ckpt"))[-1] == TRAIN_ITERS  # a newer one was there
    assert_tensors_equal(_ckpt(ref), _resaved(d), V_DIST.vocab)
    assert_losses_continue(ref, d, LOSS_RTOL)


def test_finetune_at_another_layout(runs: Runs) -> None:
    """--finetune from the newest checkpoint (8): its weights exactly, iteration 0, no optimizer state taken, the
    data and LR schedule from the start; TP2 and TP1 x DP2 train alike."""
    ref = runs.reference((2, 1, 1), V_DIST)
    ref_metrics = {m["iteration"]: m for m in metrics(os.path.join(ref, "metrics.jsonl"))}
    newest = _model_tensors(_ckpt(ref, TRAIN_ITERS))
    losses = {}
    for tag in ("TP2", "DP2"):
        d = runs.resume(f"finetune-{tag}")
        resaved = os.path.join(d, "resave", "iter_0000000")
        meta = _metadata(resaved)
        assert meta["iteration"] == 0 and meta["consumed_samples"] == 0
        got = _model_tensors(resaved)
        assert set(got) == set(newest)
        assert all(torch.equal(got[k], newest[k]) for k in newest), tag
        assert not any(k.startswith("optimizer.state.exp_avg") for k in read_full_tensors(resaved))
        run = metrics(os.path.join(d, "metrics.jsonl"))
        assert [m["iteration"] for m in run] == list(range(1, SAVE_AT + 1))
        for m in run:
            assert m["samples"] == ref_metrics[m["iteration"]]["samples"]
            assert m["lr"] == pytest.approx(ref_metrics[m["iteration"]]["lr"], rel=1e-12)
        losses[tag] = [m["loss"] for m in run]
    assert losses["DP2"] == pytest.approx(losses["TP2"], rel=LOSS_RTOL)
    assert losses["TP2"][0] < ref_metrics[1]["loss"]  # trained weights: lower than the first step from scratch


def test_no_load_optim_takes_the_weights_alone(runs: Runs) -> None:
    """--ckpt-step 3 --no-load-optim: iteration 3's weights and data position, a fresh optimizer. The first step
    (the same weights on the same batch) has the uninterrupted run's loss; later ones differ from it (fresh Adam
    moments, schedule from the start) and agree between TP2 and TP1 x DP2."""
    ref = runs.reference((2, 1, 1), V_DIST)
    ref_metrics = {m["iteration"]: m for m in metrics(os.path.join(ref, "metrics.jsonl"))}
    weights = _model_tensors(_ckpt(ref))
    losses = {}
    for tag in ("TP2", "DP2"):
        d = runs.resume(f"no-load-optim-{tag}")
        got = _model_tensors(_resaved(d))
        assert all(torch.equal(got[k], weights[k]) for k in weights), tag
        run = metrics(os.path.join(d, "metrics.jsonl"))
        assert [m["iteration"] for m in run] == list(range(SAVE_AT + 1, TRAIN_ITERS + 1))
        assert [m["samples"] for m in run] == [ref_metrics[m["iteration"]]["samples"] for m in run]
        assert run[0]["loss"] == pytest.approx(ref_metrics[SAVE_AT + 1]["loss"], rel=LOSS_RTOL)
        assert run[1]["loss"] != pytest.approx(ref_metrics[SAVE_AT + 2]["loss"], rel=1e-4)
        losses[tag] = [m["loss"] for m in run]
    assert losses["DP2"] == pytest.approx(losses["TP2"], rel=LOSS_RTOL)
