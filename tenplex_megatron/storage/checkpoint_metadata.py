"""``metadata.json`` of a tenplex checkpoint as one frozen record, every field checked once, when it is read.

A checkpoint's metadata is input like any other: it may be damaged or hostile. Each field is checked for its type
and range before anything uses it (an unknown dtype, a 5000-digit number, ``tp_parts`` 0, an empty ``model``
record, a 1500-dimension tensor, a negative size, two tensors of one name), and a bad one is one
:class:`CheckpointFileError` naming the file and the field, e.g. ``ckpt/iter_0000004/metadata.json: ptc.tensors[3].dtype:
unknown dtype 'float128x'``: ``verify``, ``inspect`` and ``plan`` print it, and a load treats the copy as damaged
(it falls back to the next). The fields a framework's adapter alone reads (optimizer, scheduler, extra, DeepSpeed's
step counters) stay in :attr:`CheckpointMetadata.records`. A save builds the same record from typed parts
(:meth:`CheckpointMetadata.compose`) and writes :meth:`CheckpointMetadata.to_json`, the inverse of
:meth:`CheckpointMetadata.from_json`. The on-disk format is unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tenplex_megatron.plan.ptc import DTYPE_SIZES, PTC, PTCError
from tenplex_megatron.storage import formats
from tenplex_megatron.storage.files import CheckpointFileError

MAX_DIMS = 64  # a tensor of more dimensions than this is no tensor a framework makes (PyTorch's own limit)
MAX_SIZE = 2**63 - 1  # every count and byte size fits a signed 64-bit integer
MAX_LAYOUT = 1 << 24  # a parallel degree above this is no job's
#: the model record's fields the layout rules need (``plan``, a load's padded vocabulary): checked where given;
#: ``plan`` needs them all (:func:`missing_shape`)
MODEL_SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size")
_MODEL_OPTIONAL_SIZES = ("make_vocab_size_divisible_by", "num_query_groups", "num_experts", "moe_ffn_hidden_size",
                         "ffn_hidden_size")
FORMAT_NAME = formats.FORMAT_NAME  # metadata.json's ``format`` (recognised in formats.py)
FORMAT_VERSION = 2  # written by this version; format 1 (no block CRCs required) is still read
#: the framework's fields :class:`CheckpointMetadata` types (every other field of the framework's is in ``records``)
FRAMEWORK_TYPED = ("framework", "consumed_samples", "model", "padded_vocab_size", "use_distributed_optimizer",
                   "weights_only", "global_samples")
#: every field :class:`CheckpointMetadata` types: the rest of a document is its ``records``
TYPED_KEYS = frozenset(("format", "format_version", "iteration", "layout", "files", "ptc", "rank_local", "saved_at",
                        "memory_job", "rng", *FRAMEWORK_TYPED))


class _Fields:
    """Type and range checks of one document's fields; a failure is one error naming the file and the field."""

    def __init__(self, path: str):
        self.path = path

    def fail(self, field: str, why: str) -> CheckpointFileError:
        return CheckpointFileError(f"{self.path}: {field}: {why}")

    def obj(self, v: object, field: str) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise self.fail(field, f"expected an object, got {_kind(v)}")
        return v

    def seq(self, v: object, field: str) -> list[Any]:
        if not isinstance(v, list):
            raise self.fail(field, f"expected a list, got {_kind(v)}")
        return v

    def text(self, v: object, field: str, *, empty: bool = True) -> str:
        if not isinstance(v, str) or (not empty and not v):
            raise self.fail(field, f"expected a{'' if empty else ' non-empty'} string, got {_kind(v)}")
        return v

    def flag(self, v: object, field: str) -> bool:
        if not isinstance(v, bool):
            raise self.fail(field, f"expected true or false, got {_kind(v)}")
        return v

    def count(self, v: object, field: str, lo: int = 0, hi: int = MAX_SIZE) -> int:
        if type(v) is not int:
            raise self.fail(field, f"expected an integer, got {_kind(v)}")
        if not lo <= v <= hi:
            raise self.fail(field, f"{_short(v)} is out of range ({lo} to {hi})")
        return v

    def opt_count(self, v: object, field: str, lo: int = 0, hi: int = MAX_SIZE) -> int | None:
        return None if v is None else self.count(v, field, lo, hi)

    def number(self, v: object, field: str) -> float:
        if type(v) not in (int, float) or not -MAX_SIZE <= v <= MAX_SIZE:
            raise self.fail(field, f"expected a number, got {_kind(v)}")
        return float(v)

    def counts(self, v: object, field: str, lo: int = 0, hi: int = MAX_SIZE, max_len: int = MAX_DIMS) -> list[int]:
        got = self.seq(v, field)
        if len(got) > max_len:
            raise self.fail(field, f"{len(got)} entries, at most {max_len}")
        return [self.count(x, f"{field}[{i}]", lo, hi) for i, x in enumerate(got)]


def _kind(v: object) -> str:
    if isinstance(v, (dict, list)):
        return f"{type(v).__name__} of {len(v)}"
    return f"{type(v).__name__} {_short(v)}"


def _short(v: object) -> str:
    """``repr(v)`` cut to 40 characters (a 5000-digit number must not fill the message)."""
    if type(v) is int and v.bit_length() > 128:
        return f"an integer of {v.bit_length()} bits"
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass(frozen=True)
class RankLocalEntry:
    """One rank-local entry a rank saved (Transformer Engine's ``_extra_state``): its bytes' count and block CRCs,
    and the adapter's record of it as saved."""

    name: str
    nbytes: int
    block_crc32: tuple[int, ...]
    record: Mapping[str, Any]

    @classmethod
    def written(cls, name: str, record: Mapping[str, Any], block_crc32: tuple[int, ...]) -> RankLocalEntry:
        """The entry a save records: the adapter's record (its ``nbytes`` included) with the bytes' block CRCs."""
        return cls(name, int(record["nbytes"]), tuple(block_crc32), {**record, "block_crc32": list(block_crc32)})


@dataclass(frozen=True)
class RankLocalSection:
    """A rank's rank-local state: the file holding it, the CRC block size, its entries by name."""

    rank: int
    file: str | None
    block_bytes: int
    entries: Mapping[str, RankLocalEntry]

    def to_json(self) -> dict[str, Any]:
        """The section as metadata.json holds it (its rank is the key it is filed under)."""
        return {"file": self.file, "block_bytes": self.block_bytes,
                "entries": {name: dict(e.record) for name, e in self.entries.items()}}


@dataclass(frozen=True)
class CheckpointMetadata:
    """A tenplex checkpoint's ``metadata.json``, checked; ``records`` are the framework's own fields (the adapter's),
    ``raw`` the document as read (empty in a record a save built).

    ``ptc`` is None only in a document that has none (a save's partial record); readers that plan use
    :meth:`require_ptc`.
    """

    path: str
    format_version: int
    iteration: int | None
    framework: str | None
    layout: Mapping[str, Any] | None  # degrees; ``split`` (an uneven pipeline) a list
    files: Mapping[str, int] | None  # None: a record without sizes (written before they were recorded)
    ptc: PTC | None
    consumed_samples: int | None
    padded_vocab_size: int | None
    use_distributed_optimizer: bool | None
    model: Mapping[str, Any] | None
    rank_local: Mapping[int, RankLocalSection]
    saved_at: float | None
    memory_job: str | None  # a host-memory snapshot's job id (None in a durable checkpoint)
    weights_only: bool = False  # saved without the optimizer (--no-save-optim)
    global_samples: int | None = None  # DeepSpeed's data position (its engines record no consumed_samples)
    rng: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)  # rank -> its saved RNG streams (engine/rng.py)
    records: Mapping[str, Any] = field(default_factory=dict)  # the framework's own fields: every field not typed here
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)  # the document as read

    @property
    def data_position(self) -> int:
        """The samples consumed when it was saved: ``consumed_samples``, else DeepSpeed's ``global_samples``, else 0."""
        if self.consumed_samples is not None:
            return self.consumed_samples
        return self.global_samples or 0

    def require_iteration(self) -> int:
        if self.iteration is None:
            raise CheckpointFileError(f"{self.path}: iteration: missing")
        return self.iteration

    @property
    def tensor_keys(self) -> tuple[str, ...]:
        """The keys of the tensors the checkpoint lists (none without a PTC)."""
        return tuple(self.ptc.tensors) if self.ptc is not None else ()

    def record(self, name: str) -> Any:
        """A framework's own record (its optimizer's hyper-parameters and step, its scheduler, its counters): opaque
        to the engine, read by the adapter that wrote it; None where the checkpoint has none."""
        return self.records.get(name)

    def require_ptc(self) -> PTC:
        if self.ptc is None:
            raise CheckpointFileError(f"{self.path}: ptc: missing (the checkpoint lists no tensors)")
        return self.ptc

    @property
    def checksums_required(self) -> bool:
        """Format 2 and later record block CRCs for every stored chunk: a chunk without them is damage."""
        return self.format_version >= 2

    @classmethod
    def from_json(cls, d: Mapping[str, Any], path: str) -> CheckpointMetadata:
        """Check every field of a parsed ``metadata.json`` (its format and version already checked)."""
        f = _Fields(path)
        framework = None if d.get("framework") is None else f.text(d["framework"], "framework")
        model = d.get("model")
        if model is not None:
            model = _model(f, model, framework)
        return cls(
            path=path,
            format_version=f.count(d.get("format_version"), "format_version", 1),
            iteration=f.opt_count(d.get("iteration"), "iteration"),
            framework=framework,
            layout=None if d.get("layout") is None else _layout(f, d["layout"], "layout"),
            files=None if d.get("files") is None else _files(f, d["files"]),
            ptc=None if d.get("ptc") is None else _ptc(f, d["ptc"]),
            consumed_samples=f.opt_count(d.get("consumed_samples"), "consumed_samples"),
            padded_vocab_size=f.opt_count(d.get("padded_vocab_size"), "padded_vocab_size", 1),
            use_distributed_optimizer=None if d.get("use_distributed_optimizer") is None else f.flag(
                d["use_distributed_optimizer"], "use_distributed_optimizer"),
            model=model,
            rank_local=_rank_local(f, d.get("rank_local") or {}),
            saved_at=None if d.get("saved_at") is None else f.number(d["saved_at"], "saved_at"),
            memory_job=None if d.get("memory_job") is None else f.text(d["memory_job"], "memory_job"),
            weights_only=bool(d.get("weights_only") is not None and f.flag(d["weights_only"], "weights_only")),
            global_samples=f.opt_count(d.get("global_samples"), "global_samples"),
            rng=_rng(f, d.get("rng") or {}),
            records={k: v for k, v in d.items() if k not in TYPED_KEYS},
            raw=d,
        )

    def to_json(self) -> dict[str, Any]:
        """The ``metadata.json`` document: the inverse of :meth:`from_json` (what a save writes)."""
        doc: dict[str, Any] = {"format": FORMAT_NAME, "format_version": self.format_version}
        typed = {"iteration": self.iteration, "layout": None if self.layout is None else dict(self.layout),
                 "framework": self.framework, "consumed_samples": self.consumed_samples,
                 "model": None if self.model is None else dict(self.model), "padded_vocab_size": self.padded_vocab_size,
                 "use_distributed_optimizer": self.use_distributed_optimizer,
                 "weights_only": True if self.weights_only else None, "global_samples": self.global_samples}
        doc.update((k, v) for k, v in typed.items() if v is not None)
        doc.update(self.records)
        doc["rng"] = {str(r): dict(state) for r, state in self.rng.items()}
        tail = {"memory_job": self.memory_job, "files": None if self.files is None else dict(self.files),
                "saved_at": self.saved_at,
                "rank_local": {str(r): sec.to_json() for r, sec in self.rank_local.items()} or None,
                "ptc": None if self.ptc is None else self.ptc.to_json()}
        doc.update((k, v) for k, v in tail.items() if v is not None)
        return doc

    @classmethod
    def compose(cls, path: str, *, iteration: int, layout: Mapping[str, int], fields: Mapping[str, Any], ptc: PTC,
                files: Mapping[str, int], rank_local: Mapping[int, RankLocalSection],
                rng: Mapping[int, Mapping[str, Any]], saved_at: float, memory_job: str | None = None
                ) -> CheckpointMetadata:
        """A save's record from its typed parts; ``fields``: the framework's part of the document (its adapter's
        record as JSON, the framework's name included), whose fields this record types are taken out of it."""
        own = {k: v for k, v in fields.items() if k not in TYPED_KEYS}
        return cls(path=path, format_version=FORMAT_VERSION, iteration=iteration, framework=fields.get("framework"),
                   layout=dict(layout), files=dict(files), ptc=ptc, consumed_samples=fields.get("consumed_samples"),
                   padded_vocab_size=fields.get("padded_vocab_size"),
                   use_distributed_optimizer=fields.get("use_distributed_optimizer"), model=fields.get("model"),
                   rank_local=dict(rank_local), saved_at=saved_at, memory_job=memory_job,
                   weights_only=bool(fields.get("weights_only")), global_samples=fields.get("global_samples"),
                   rng=dict(rng), records=own)


def _layout(f: _Fields, v: object, field: str) -> dict[str, Any]:
    """The layout record: degrees, ``sp`` a flag, ``split`` (an uneven pipeline: layers per chunk) a list of counts;
    a record without ``split`` is an even pipeline (every record written before it existed)."""
    out: dict[str, Any] = {}
    for k, x in f.obj(v, field).items():
        if k == "split":
            out[k] = f.counts(x, f"{field}.split", 0, MAX_SIZE, MAX_LAYOUT)
            continue
        out[k] = f.flag(x, f"{field}.{k}") if k == "sp" else f.count(x, f"{field}.{k}", 1 if k in ("tp", "pp", "dp")
                                                                   else 0, MAX_LAYOUT)
    return out


def _files(f: _Fields, v: object) -> dict[str, int]:
    got = f.obj(v, "files")
    return {name: f.count(size, f"files[{name!r}]") for name, size in got.items()}


def _model(f: _Fields, v: object, framework: str | None) -> dict[str, Any]:
    got = f.obj(v, "model")
    if framework == "deepspeed":  # DeepSpeed's engine records no model shape
        return got
    if "vocab_size" not in got:  # every writer records it (a model tenplex did not build: vocabulary and seed)
        raise f.fail("model.vocab_size", "missing (every model record gives the vocabulary)")
    for name in MODEL_SHAPE_FIELDS:  # the shape: checked where given (a user's own loop may record none of it)
        if got.get(name) is not None:
            f.count(got[name], f"model.{name}", 1)
    for name in _MODEL_OPTIONAL_SIZES:
        if got.get(name) is not None:
            f.count(got[name], f"model.{name}", 0)
    return got


def missing_shape(model: Mapping[str, Any]) -> str | None:
    """The first field of :data:`MODEL_SHAPE_FIELDS` a model record lacks (None: it gives the model's shape)."""
    return next((name for name in MODEL_SHAPE_FIELDS if model.get(name) is None), None)


def _tensor(f: _Fields, v: object, at: str) -> None:
    t = f.obj(v, at)
    f.text(t.get("key"), f"{at}.key", empty=False)
    shape = f.counts(t.get("shape"), f"{at}.shape")
    numel = 1
    for s in shape:
        numel *= s
        if numel > MAX_SIZE:
            raise f.fail(f"{at}.shape", f"{len(shape)} dimensions of {numel.bit_length()}+ bits of elements")
    dtype = f.text(t.get("dtype"), f"{at}.dtype")
    if dtype not in DTYPE_SIZES:
        raise f.fail(f"{at}.dtype", f"unknown dtype {_short(dtype)} (known: {', '.join(DTYPE_SIZES)})")
    if t.get("vocab_rows") is not None:
        f.count(t["vocab_rows"], f"{at}.vocab_rows", 0, shape[0] if shape else 0)
    if t.get("tp_axis") is not None:
        f.count(t["tp_axis"], f"{at}.tp_axis", 0, max(len(shape) - 1, 0))
    f.count(t.get("tp_parts", 1), f"{at}.tp_parts", 1, MAX_LAYOUT)
    f.text(t.get("stage", ""), f"{at}.stage")
    f.flag(t.get("tied", False), f"{at}.tied")
    if t.get("param") is not None:
        f.text(t["param"], f"{at}.param")


def _chunk(f: _Fields, v: object, at: str) -> None:
    c = f.obj(v, at)
    f.text(c.get("key"), f"{at}.key", empty=False)
    offsets, shape = f.counts(c.get("offsets"), f"{at}.offsets"), f.counts(c.get("shape"), f"{at}.shape")
    if len(offsets) != len(shape):
        raise f.fail(at, f"{len(offsets)} offsets for {len(shape)} dimensions")
    if c.get("flat") is not None:
        f.counts(c["flat"], f"{at}.flat", max_len=2)
        if len(c["flat"]) != 2:
            raise f.fail(f"{at}.flat", "expected [start, stop]")
    loc = f.obj(c.get("at"), f"{at}.at")
    f.text(loc.get("file"), f"{at}.at.file", empty=False)
    f.text(loc.get("name"), f"{at}.at.name", empty=False)
    f.count(loc.get("rank", 0), f"{at}.at.rank")
    f.text(loc.get("host", ""), f"{at}.at.host")
    if loc.get("crc32") is not None:
        f.count(loc["crc32"], f"{at}.at.crc32", 0, 2**32 - 1)
    if (loc.get("block_crc32") is None) != (loc.get("block_bytes") is None):
        raise f.fail(f"{at}.at", "block_crc32 and block_bytes must be given together")
    if loc.get("block_bytes") is not None:
        f.count(loc["block_bytes"], f"{at}.at.block_bytes", 1)
        f.counts(loc["block_crc32"], f"{at}.at.block_crc32", 0, 2**32 - 1, max_len=MAX_SIZE)


def _ptc(f: _Fields, v: object) -> PTC:
    d = f.obj(v, "ptc")
    seen: set[str] = set()
    for i, t in enumerate(f.seq(d.get("tensors"), "ptc.tensors")):
        _tensor(f, t, f"ptc.tensors[{i}]")
        if t["key"] in seen:
            raise f.fail(f"ptc.tensors[{i}].key", f"tensor {_short(t['key'])} is listed twice")
        seen.add(t["key"])
    stored: dict[tuple[str, str], tuple[Any, ...]] = {}
    for i, c in enumerate(f.seq(d.get("chunks"), "ptc.chunks")):
        _chunk(f, c, f"ptc.chunks[{i}]")
        box = (c["key"], c["offsets"], c["shape"], c.get("flat"))
        if stored.setdefault((c["at"]["file"], c["at"]["name"]), box) != box:
            raise f.fail(f"ptc.chunks[{i}].at.name", f"{_short(c['at']['name'])} in {_short(c['at']['file'])} "
                         "also holds another chunk")
    _layout(f, d.get("layout", {}), "ptc.layout")
    try:
        return PTC.from_json(dict(d))
    except (PTCError, ValueError) as e:
        raise f.fail("ptc", str(e)) from None


def _rng(f: _Fields, v: object) -> dict[int, dict[str, Any]]:
    """Each rank's saved RNG streams (opaque to everything but ``engine/rng.py``): an object per rank number."""
    out = {}
    for r, state in f.obj(v, "rng").items():
        if not r.isdigit() or len(r) > 9:
            raise f.fail(f"rng[{_short(r)}]", "the key must be a rank number")
        out[int(r)] = f.obj(state, f"rng[{r!r}]")
    return out


def _rank_local(f: _Fields, v: object) -> dict[int, RankLocalSection]:
    out = {}
    for r, sec in f.obj(v, "rank_local").items():
        at = f"rank_local[{r!r}]"
        if not r.isdigit() or len(r) > 9:
            raise f.fail(at, "the key must be a rank number")
        s = f.obj(sec, at)
        file = None if s.get("file") is None else f.text(s["file"], f"{at}.file", empty=False)
        block = f.count(s.get("block_bytes"), f"{at}.block_bytes", 1)
        entries = {}
        for name, rec in f.obj(s.get("entries", {}), f"{at}.entries").items():
            e = f.obj(rec, f"{at}.entries[{_short(name)}]")
            entries[name] = RankLocalEntry(
                name, f.count(e.get("nbytes"), f"{at}.entries[{_short(name)}].nbytes"),
                tuple(f.counts(e.get("block_crc32", []), f"{at}.entries[{_short(name)}].block_crc32", 0, 2**32 - 1,
                             max_len=MAX_SIZE)), e)
        out[int(r)] = RankLocalSection(int(r), file, block, entries)
    return out
