"""How the transformer layers are split over the pipeline's model chunks: evenly, or unevenly as Megatron-LM's
``--decoder-first-pipeline-num-layers``, ``--decoder-last-pipeline-num-layers``,
``--account-for-embedding-in-pipeline-split``, ``--account-for-loss-in-pipeline-split`` and
``--pipeline-model-parallel-layout`` say. Pure Python.

A split is the layer count of each of the PP x VPP model chunks in megatron-core's order (chunk ``v x PP + r`` is
pipeline rank ``r``'s virtual stage ``v``); the global layers are numbered along that order, so a chunk's first
layer is the sum of the counts before it: what megatron-core's ``get_transformer_layer_offset`` and
``get_num_layers_to_build`` (core_v0.16 to core_v0.19) compute from the same flags. The empty split is the even one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from tenplex_megatron.errors import TenplexError

FIRST, LAST = "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"
EMBEDDING, LOSS = "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"
LAYOUT = "--pipeline-model-parallel-layout"


class SplitError(TenplexError, ValueError):
    """An uneven pipeline split that the layers or the pipeline size cannot take."""


@dataclass(frozen=True)
class SplitRule:
    """Megatron-LM's flags for an uneven split, as given (each None / False: not given); :meth:`counts` resolves
    them for one PP x VPP."""

    first: int | None = None  # --decoder-first-pipeline-num-layers
    last: int | None = None  # --decoder-last-pipeline-num-layers
    embedding: bool = False  # --account-for-embedding-in-pipeline-split
    loss: bool = False  # --account-for-loss-in-pipeline-split
    layout: str | None = None  # --pipeline-model-parallel-layout

    @property
    def given(self) -> bool:
        """Whether any uneven-split flag is set."""
        return self.first is not None or self.last is not None or self.embedding or self.loss or bool(self.layout)

    def flags(self) -> str:
        """The flags as a command line gives them (empty: none)."""
        out = [f"{FIRST} {self.first}" if self.first is not None else "",
               f"{LAST} {self.last}" if self.last is not None else "",
               EMBEDDING if self.embedding else "", LOSS if self.loss else "",
               f"{LAYOUT} {self.layout!r}" if self.layout else ""]
        return " ".join(x for x in out if x)

    def counts(self, num_layers: int, pp: int, vpp: int = 1) -> tuple[int, ...]:
        """The layer count of each model chunk at ``pp`` x ``vpp`` (megatron-core's order), :class:`SplitError`
        naming the flags and the numbers where they do not fit."""
        if (self.first is not None or self.last is not None) and (self.embedding or self.loss):
            raise SplitError(f"{self.flags()}: the first/last counts and the account-for flags exclude each other "
                             "(megatron-core's rule)")
        if self.layout:
            if self.first is not None or self.last is not None or self.embedding or self.loss:
                raise SplitError(f"{self.flags()}: {LAYOUT} excludes the other split flags (megatron-core's rule)")
            return layout_counts(self.layout, num_layers, pp, vpp)
        if self.first is not None or self.last is not None:
            return _first_last(self, num_layers, pp, vpp)
        return _accounted(self, num_layers, pp, vpp)


def _first_last(rule: SplitRule, num_layers: int, pp: int, vpp: int) -> tuple[int, ...]:
    """``--decoder-first/last-pipeline-num-layers``: those on the first / last pipeline rank, the rest evenly over
    the ranks between; each rank's split evenly over its VPP chunks."""
    where = f"{rule.flags()} at --num-layers {num_layers}, PP {pp}" + (f", VPP {vpp}" if vpp > 1 else "")
    given = [(flag, n) for flag, n in ((FIRST, rule.first), (LAST, rule.last)) if n is not None]
    for flag, n in given:
        if n <= 0:
            raise SplitError(f"{where}: {flag} must be > 0")
        if n % vpp:
            raise SplitError(f"{where}: VPP {vpp} does not divide {flag} {n}")
    middle_stages, middle = pp - len(given), num_layers - sum(n for _, n in given)
    if vpp > 1 and middle_stages == 0:
        raise SplitError(f"{where}: with VPP, megatron-core (core_v0.16 to core_v0.19, get_transformer_layer_offset) "
                         "divides by the pipeline ranks between the first and last, none here")
    if middle_stages < 0 or middle < 0 or bool(middle) != bool(middle_stages):
        raise SplitError(f"{where}: {middle} layers are left for the {max(middle_stages, 0)} pipeline ranks "
                         "between the first and last (each needs layers, and no layer may be left over)")
    per = middle // middle_stages if middle_stages else 0
    if middle_stages and (middle % middle_stages or per % vpp):
        raise SplitError(f"{where}: the {middle} layers left do not split evenly over the {middle_stages} pipeline "
                         f"ranks between the first and last" + (f" and their {vpp} virtual stages" if vpp > 1 else ""))
    ranks = [per] * pp
    if rule.first is not None:
        ranks[0] = rule.first
    if rule.last is not None:
        ranks[-1] = rule.last
    return tuple(ranks[r] // vpp for _ in range(vpp) for r in range(pp))


def _accounted(rule: SplitRule, num_layers: int, pp: int, vpp: int) -> tuple[int, ...]:
    """The even split, the embedding and the loss each counted as one more layer on the first / last chunk when
    the account-for flags say so."""
    total = num_layers + int(rule.embedding) + int(rule.loss)
    named = f" ({rule.flags()}: {total} counted)" if rule.embedding or rule.loss else ""
    if total % (pp * vpp):
        what = f"PP x VPP = {pp} x {vpp}" if vpp > 1 else f"PP {pp}"
        raise SplitError(f"{what} does not divide --num-layers {num_layers}{named}")
    counts = [total // (pp * vpp)] * (pp * vpp)
    counts[0] -= int(rule.embedding)
    counts[-1] -= int(rule.loss)
    if min(counts) < 0:
        raise SplitError(f"--num-layers {num_layers}{named} at PP {pp}: the first or last chunk would hold fewer "
                         "than no layers")
    return tuple(counts)


def _unrolled(text: str) -> list[str]:
    """A ``--pipeline-model-parallel-layout`` string as its stages' characters (megatron-core's
    ``parse_str_to_list``: commas dropped, ``(..)*n`` and ``x*n`` unrolled, stages split at ``|``)."""
    text = text.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        text = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), text)
    return text.split("|")


def layout_counts(text: str, num_layers: int, pp: int, vpp: int = 1) -> tuple[int, ...]:
    """The decoder layers (``t``) of each stage of a ``--pipeline-model-parallel-layout`` string, checked as
    megatron-core checks it (E first, L last, the layers' sum); MTP stages (``m``) are refused with
    ``--mtp-num-layers``."""
    stages = _unrolled(text)
    where = f"{LAYOUT} {text!r}"
    bad = sorted({c for s in stages for c in s} - set("EtLm"))
    if bad:
        raise SplitError(f"{where}: unknown layer characters {bad} (E, t, m, L)")
    if "m" in "".join(stages):
        raise SplitError(f"{where}: multi-token-prediction stages (m) are refused under --tenplex (--mtp-num-layers)")
    if len(stages) != pp * vpp:
        raise SplitError(f"{where} has {len(stages)} stages, PP x VPP = {pp} x {vpp} = {pp * vpp} needed")
    flat = "".join(stages)
    if not flat.startswith("E") or not flat.endswith("L") or flat.count("E") != 1 or flat.count("L") != 1:
        raise SplitError(f"{where}: the embedding (E) must open the first stage and the loss (L) close the last, "
                         "once each")
    counts = tuple(s.count("t") for s in stages)
    if sum(counts) != num_layers:
        raise SplitError(f"{where} places {sum(counts)} transformer layers (t), --num-layers is {num_layers}")
    return counts


def layout_stages(text: str) -> int:
    """How many PP x VPP stages a ``--pipeline-model-parallel-layout`` string has (its VPP is that over PP)."""
    return len(_unrolled(text))


def chunk_counts(split: tuple[int, ...], num_layers: int, pp: int, vpp: int = 1) -> tuple[int, ...]:
    """Each model chunk's layer count: ``split``'s, or the even split's when ``split`` is empty."""
    if split:
        return split
    stages = pp * vpp
    if num_layers % stages:
        raise SplitError(f"PP x VPP = {pp} x {vpp} does not divide the number of layers ({num_layers})")
    return (num_layers // stages,) * stages


def chunk_layers(split: tuple[int, ...], num_layers: int, pp: int, vpp: int, pp_rank: int,
                 vp_stage: int = 0) -> range:
    """The global layers of pipeline rank ``pp_rank``'s virtual stage ``vp_stage`` (megatron-core's offset and
    count)."""
    counts = chunk_counts(split, num_layers, pp, vpp)
    c = vp_stage * pp + pp_rank
    start = sum(counts[:c])
    return range(start, start + counts[c])


def even(split: tuple[int, ...]) -> tuple[int, ...]:
    """One spelling of the even split: the empty tuple where every chunk holds the same count."""
    return () if len(set(split)) <= 1 else tuple(split)


def megatron_kwargs(split: tuple[int, ...], pp: int, vpp: int = 1) -> dict[str, Any]:
    """megatron-core's ``TransformerConfig`` arguments that build ``split``: the first/last counts where they say it
    (each rank's layers even over its VPP chunks, the ranks between alike), else the equivalent
    ``pipeline_model_parallel_layout`` string; nothing for the even split."""
    if not split:
        return {}
    ranks = [[split[v * pp + r] for v in range(vpp)] for r in range(pp)]
    uniform = all(len(set(chunks)) == 1 for chunks in ranks)
    totals = [sum(chunks) for chunks in ranks]
    middle = set(totals[1:-1])
    if uniform and pp == 2 and totals[0] > 0 and totals[1] > 0:
        return {"num_layers_in_first_pipeline_stage": totals[0]}
    if uniform and pp > 2 and len(middle) == 1 and min(totals) > 0:
        out = {}
        if totals[0] != totals[1]:
            out["num_layers_in_first_pipeline_stage"] = totals[0]
        if totals[-1] != totals[1]:
            out["num_layers_in_last_pipeline_stage"] = totals[-1]
        return out
    stages = ["t" * n for n in split]
    stages[0], stages[-1] = "E" + stages[0], stages[-1] + "L"
    return {"pipeline_model_parallel_layout": "|".join(stages)}


def rule_of(args: Any) -> SplitRule:
    """The uneven-split flags of Megatron-LM's parsed ``args`` (a namespace or a dict; its attribute names; missing
    ones: not given)."""
    def get(name: str) -> Any:
        return args.get(name) if isinstance(args, dict) else getattr(args, name, None)

    layout = get("pipeline_model_parallel_layout")
    return SplitRule(first=get("decoder_first_pipeline_num_layers"), last=get("decoder_last_pipeline_num_layers"),
                     embedding=bool(get("account_for_embedding_in_pipeline_split")),
                     loss=bool(get("account_for_loss_in_pipeline_split")),
                     layout=None if not layout else layout if isinstance(layout, str) else str(layout))


def start_problem(args: Any) -> str | None:
    """Why Megatron-LM's uneven-split flags do not fit its PP (and VPP) as given, naming the flags and the numbers;
    None where they fit or none is given. Read before any process group (Megatron-LM's own checks come later, one
    assertion at a time)."""
    rule = rule_of(args)
    if not rule.given:
        return None
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    if rule.layout:
        stages = layout_stages(rule.layout)
        if stages % pp:
            return f"{LAYOUT} {rule.layout!r} has {stages} stages: --pipeline-model-parallel-size {pp} must divide them"
        vpp = stages // pp
    else:
        vpp = int(getattr(args, "num_virtual_stages_per_pipeline_rank", None) or 1)
        if getattr(args, "num_layers_per_virtual_pipeline_stage", None) is not None:
            return (f"{rule.flags()} with --num-layers-per-virtual-pipeline-stage: give the interleaving as "
                    "--num-virtual-stages-per-pipeline-rank (Megatron-LM's rule)")
    try:
        rule.counts(int(args.num_layers), pp, vpp)
    except SplitError as e:
        return str(e)
    return None
