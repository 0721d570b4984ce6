"""Parallel layouts (TP, PP, VPP, DP, sequence parallelism, expert parallelism and expert TP) and the checks that a
layout can hold a model. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tenplex_megatron.errors import TenplexError
from tenplex_megatron.plan.pipeline_split import SplitError, chunk_layers, even


class LayoutError(TenplexError, ValueError):
    """A parallel layout that cannot hold the model or does not match the world size."""


@dataclass(frozen=True)
class ModelShape:
    """The few model dimensions that constrain a parallel layout."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    make_vocab_size_divisible_by: int = 128
    num_query_groups: int | None = None  # grouped-query attention; None: one group per head
    num_experts: int | None = None  # mixture of experts: routed experts per MoE layer; None: a dense model
    moe_ffn_hidden_size: int | None = None  # each expert's FFN width (expert TP splits it)

    @classmethod
    def from_record(cls, model: dict[str, Any]) -> ModelShape:
        """The shape in a checkpoint's ``model`` record (the trainer's or the Megatron-LM hook's: same names)."""
        return cls(
            num_layers=int(model["num_layers"]),
            hidden_size=int(model["hidden_size"]),
            num_attention_heads=int(model["num_attention_heads"]),
            vocab_size=int(model["vocab_size"]),
            make_vocab_size_divisible_by=int(model.get("make_vocab_size_divisible_by") or 128),
            num_query_groups=record_query_groups(model),
            num_experts=int(model["num_experts"]) if model.get("num_experts") else None,
            moe_ffn_hidden_size=_moe_ffn(model),
        )


def _moe_ffn(model: dict[str, Any]) -> int | None:
    """An MoE record's expert FFN width: ``moe_ffn_hidden_size``, else ``ffn_hidden_size`` (megatron's default)."""
    if not model.get("num_experts"):
        return None
    value = model.get("moe_ffn_hidden_size") or model.get("ffn_hidden_size")
    return int(value) if value else None


def record_query_groups(model: dict[str, Any]) -> int | None:
    """Key/value head groups in a ``model`` record: ``num_query_groups`` with ``group_query_attention`` (Megatron-LM's
    rule), else None (one per head; also for records written before these fields existed)."""
    if model.get("group_query_attention") and model.get("num_query_groups") is not None:
        return int(model["num_query_groups"])
    return None


@dataclass(frozen=True)
class ParallelLayout:
    """Tensor-, pipeline- and data-parallel degrees of a job, its virtual pipeline stages per rank (``vpp``,
    Megatron's interleaved schedule), whether sequence parallelism is on (``sp``: no tensor changes, recorded), and
    for mixture-of-experts models the expert-parallel size (``ep``) and the experts' own TP (``etp``; 0: the same as
    ``tp``, megatron-core's default). The experts' data-parallel size follows: world / (ETP x EP x PP).
    ``split``: the layer count of each of the PP x VPP model chunks (``plan/pipeline_split.py``: megatron-core's
    order) for an uneven pipeline; empty (also for records written before it existed) is the even split."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int = 1
    sp: bool = False
    ep: int = 1
    etp: int = 0
    split: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self._check_split()
        if not isinstance(self.etp, int) or isinstance(self.etp, bool) or self.etp < 0:
            raise LayoutError(f"etp={self.etp!r}: the expert tensor-parallel size is an integer >= 1 (0: TP's)")
        if self.etp == self.tp:
            object.__setattr__(self, "etp", 0)  # one spelling of "expert TP = TP", so equal layouts compare equal
        for name in ("tp", "pp", "dp", "vpp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"{name}={value!r}: every parallel degree must be an integer >= 1")
        if not isinstance(self.sp, bool):
            raise LayoutError(f"sp={self.sp!r}: sequence parallelism is on or off (a bool)")
        if self.vpp > 1 and self.pp < 2:
            raise LayoutError(f"vpp={self.vpp} needs pp >= 2 (Megatron's interleaved schedule; here pp={self.pp})")
        if self.sp and self.tp < 2:
            raise LayoutError("sp (sequence parallelism) needs tp >= 2")
        expert_mp = self.expert_tp * self.ep * self.pp
        if self.world_size % expert_mp:
            raise LayoutError(f"expert TP x EP x PP = {self.expert_tp} x {self.ep} x {self.pp} = {expert_mp} does not "
                              f"divide the world size TP x PP x DP = {self.world_size}")

    def _check_split(self) -> None:
        """``split``: PP x VPP counts >= 0, kept as a tuple, the even one spelt ``()`` (so equal layouts compare
        equal)."""
        split = self.split
        if not isinstance(split, (tuple, list)) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                                           for n in split):
            raise LayoutError(f"split={split!r}: the layers of each pipeline chunk, integers >= 0")
        pp, vpp = self.pp if isinstance(self.pp, int) else 1, self.vpp if isinstance(self.vpp, int) else 1
        if split and len(split) != pp * vpp:
            raise LayoutError(f"split={'/'.join(map(str, split))} gives {len(split)} pipeline chunks, PP x VPP = "
                              f"{pp} x {vpp} = {pp * vpp}")
        object.__setattr__(self, "split", even(tuple(split)))

    def layers(self, num_layers: int, pp_rank: int, vp_stage: int = 0) -> range:
        """The global layers of pipeline rank ``pp_rank``'s virtual stage ``vp_stage`` (megatron-core's numbering)."""
        try:
            return chunk_layers(self.split, num_layers, self.pp, self.vpp, pp_rank, vp_stage)
        except SplitError as e:
            raise LayoutError(str(e)) from None

    @property
    def expert_tp(self) -> int:
        """The experts' tensor-parallel size (megatron-core's ``expert_tensor_parallel_size``; default TP)."""
        return self.etp or self.tp

    @property
    def expert_dp(self) -> int:
        """The experts' data-parallel size: world / (expert TP x EP x PP)."""
        return self.world_size // (self.expert_tp * self.ep * self.pp)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def stages(self) -> int:
        """Model chunks along the pipeline: PP x VPP."""
        return self.pp * self.vpp

    def __str__(self) -> str:
        return f"tp={self.tp},pp={self.pp},dp={self.dp}" + (f",vpp={self.vpp}" if self.vpp > 1 else "") + (
            ",sp" if self.sp else "") + (f",ep={self.ep}" if self.ep > 1 else "") + (f",etp={self.etp}" if self.etp else "") + (
            f",split={'/'.join(map(str, self.split))}" if self.split else "")

    @classmethod
    def parse(cls, text: str) -> ParallelLayout:
        """Parse ``tp=2,pp=2,dp=1`` (missing degrees default to 1), with optional ``vpp=N``, ``sp``, ``ep=N``, ``etp=N``,
        ``split=3/1`` (each pipeline chunk's layers)."""
        values: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, num = part.partition("=")
            name = name.strip().lower()
            if name == "sp" and (not sep or num.strip() in ("1", "true", "on")):
                values["sp"] = True
                continue
            if not sep or name not in ("tp", "pp", "dp", "vpp", "ep", "etp", "split"):
                raise LayoutError(f"cannot parse layout {text!r}: expected e.g. tp=2,pp=2,dp=1 (optionally vpp=2, sp, "
                                  "ep=2, etp=1, split=3/1)")
            try:
                values[name] = tuple(int(n) for n in num.split("/")) if name == "split" else int(num)
            except ValueError:
                raise LayoutError(f"cannot parse layout {text!r}: {name}={num!r} is not an integer") from None
        return cls(**values)

    def to_json(self) -> dict[str, Any]:
        """``tp``, ``pp``, ``dp``; ``vpp``, ``sp``, ``ep``, ``etp`` and ``split`` only when set (records written before
        they existed match)."""
        out: dict[str, Any] = {"tp": self.tp, "pp": self.pp, "dp": self.dp}
        if self.vpp > 1:
            out["vpp"] = self.vpp
        if self.sp:
            out["sp"] = True
        if self.ep > 1:
            out["ep"] = self.ep
        if self.etp:
            out["etp"] = self.etp
        if self.split:
            out["split"] = list(self.split)
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ParallelLayout:
        return cls(tp=int(d["tp"]), pp=int(d["pp"]), dp=int(d["dp"]), vpp=int(d.get("vpp") or 1),
                   sp=bool(d.get("sp", False)), ep=int(d.get("ep") or 1), etp=int(d.get("etp") or 0),
                   split=tuple(int(n) for n in d.get("split") or ()))

    def rank_coords(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, pp_rank, dp_rank) of a global rank in megatron-core's default order (tp-dp-pp)."""
        tp_rank = rank % self.tp
        dp_rank = (rank // self.tp) % self.dp
        pp_rank = rank // (self.tp * self.dp)
        return tp_rank, pp_rank, dp_rank

    def expert_rank_coords(self, rank: int) -> tuple[int, int, int]:
        """(expert TP rank, EP rank, expert DP rank) of a global rank in megatron-core's expert order (tp-ep-dp-pp with
        the experts' TP and DP sizes; the pipeline rank is the dense one)."""
        etp, ep = self.expert_tp, self.ep
        return rank % etp, (rank // etp) % ep, (rank // (etp * ep)) % self.expert_dp

    def check_fits(self, shape: ModelShape, world_size: int | None = None) -> None:
        """Raise :class:`LayoutError` naming every constraint the layout breaks."""
        problems = []
        if shape.num_attention_heads % self.tp:
            problems.append(
                f"TP={self.tp} does not divide the number of attention heads ({shape.num_attention_heads})"
            )
        if shape.num_query_groups is not None and shape.num_query_groups % self.tp:
            problems.append(
                f"TP={self.tp} does not divide the number of query groups (--num-query-groups "
                f"{shape.num_query_groups})"
            )
        if shape.hidden_size % self.tp:
            problems.append(f"TP={self.tp} does not divide the hidden size ({shape.hidden_size})")
        if self.split:
            if sum(self.split) != shape.num_layers:
                problems.append(f"the uneven pipeline split {'/'.join(map(str, self.split))} holds "
                                f"{sum(self.split)} layers, the model {shape.num_layers}")
        elif self.vpp > 1 and shape.num_layers % (self.pp * self.vpp):
            problems.append(f"PP x VPP = {self.pp} x {self.vpp} does not divide the number of layers "
                            f"({shape.num_layers})")
        elif shape.num_layers % self.pp:
            problems.append(f"PP={self.pp} does not divide the number of layers ({shape.num_layers})")
        if shape.num_experts is None and (self.ep > 1 or self.etp):
            problems.append(f"EP={self.ep} / expert TP={self.expert_tp} need a mixture-of-experts model "
                            "(--num-experts)")
        if shape.num_experts is not None and shape.num_experts % self.ep:
            problems.append(f"--expert-model-parallel-size {self.ep} does not divide --num-experts "
                            f"{shape.num_experts} (each EP rank holds whole experts)")
        if shape.moe_ffn_hidden_size is not None and shape.moe_ffn_hidden_size % self.expert_tp:
            problems.append(f"--expert-tensor-parallel-size {self.expert_tp} does not divide the experts' FFN "
                            f"hidden size ({shape.moe_ffn_hidden_size})")
        if world_size is not None and world_size != self.world_size:
            problems.append(
                f"world size {world_size} != TP x PP x DP = {self.tp} x {self.pp} x {self.dp} = {self.world_size}"
            )
        if problems:
            raise LayoutError(f"layout {self} cannot hold the model: " + "; ".join(problems))


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's padded vocabulary: the next multiple of ``divisible_by x TP``."""
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


def restart_padded_vocab_size(vocab_size: int, divisible_by: int, tp: int, saved: int | None) -> int:
    """Padded vocabulary for a restart: keep the checkpoint's when the new TP divides it.

    Megatron's softmax covers the padding rows, so a different padded size is a
    slightly different model; keeping it makes the resumed loss curve exact.
    Only when TP does not divide the saved size does Megatron's rule apply.
    """
    if saved is not None and saved >= vocab_size and saved % tp == 0:
        return saved
    return padded_vocab_size(vocab_size, divisible_by, tp)
