"""The one resume order (``frontdoor/resume.py``), every front door's: which source the sequence takes, given what
the query found, and what the engine is asked to do. The engine here records its calls (the framework boundary:
the loads behind it are the multi-process tests'); the sources are the query's frozen record."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from tenplex_megatron.frontdoor import resume
from tenplex_megatron.frontdoor.job_config import JobConfig
from tenplex_megatron.frontdoor.restart_sources import Sources
from tenplex_megatron.plan.megatron_ckpt_flags import LoadScope
from tenplex_megatron.storage.directory import FORMAT_NAME


def _committed(path: Any) -> None:
    """A directory the query recognises as a committed tenplex checkpoint (its metadata's format; what a load finds
    inside is the engine's, recorded here)."""
    path.mkdir(parents=True)
    (path / "metadata.json").write_text(json.dumps({"format": FORMAT_NAME}))


@dataclass
class Recording:
    """An engine that records what the sequence asks of it; ``load`` returns a stand-in result naming the path."""

    calls: list[tuple[str, Any]] = field(default_factory=list)

    def adapter(self, scope: Any = None) -> Any:
        self.calls.append(("adapter", None))
        return object()

    def load(self, path: str, scope: LoadScope | None = None, metadata: Any = None) -> Any:
        self.calls.append(("load", (path, scope)))
        self.metadata = metadata
        return type("Res", (), {"iteration": 7, "path": path})()

    def adopt(self, path: str, scope: LoadScope | None = None) -> Any:
        self.calls.append(("adopt", (path, scope)))
        return type("Res", (), {"iteration": 5, "path": path})()

    def init_hf(self, hf_dir: str) -> Any:
        self.calls.append(("init_hf", hf_dir))
        return "read"

    def save(self, *a: Any) -> Any:
        self.calls.append(("save", a))


def test_megatrons_own_checkpoint_is_adopted_with_tenplex_and_left_to_megatron_without() -> None:
    found = Sources(None, None, "/ck/iter_0000005")
    eng = Recording()
    got = resume.from_sources(JobConfig("p", tenplex=True), eng, None, found, "/ck")
    assert got.kind == "adopted" and eng.calls == [("adopt", ("/ck/iter_0000005", None))]
    eng = Recording()
    got = resume.from_sources(JobConfig("p", tenplex=False), eng, None, found, "/ck")
    assert got.kind == "native" and got.native == "/ck/iter_0000005" and not got.loaded and eng.calls == []


def test_hugging_face_only_where_there_is_no_checkpoint_and_scratch_last() -> None:
    eng = Recording()
    got = resume.from_sources(JobConfig("p", tenplex=True, init_from_hf="/hf"), eng, None, Sources(None, None, None),
                              "/ck")
    assert got.kind == "hf" and got.hf == "read" and eng.calls == [("init_hf", "/hf")]
    eng = Recording()
    got = resume.from_sources(JobConfig("p", tenplex=True, init_from_hf="/hf"), eng, None,
                              Sources(None, None, "/ck/iter_0000005"), "/ck")
    assert got.kind == "adopted"  # a checkpoint wins over Hugging Face weights
    got = resume.from_sources(JobConfig("p", tenplex=True), Recording(), None, Sources(None, None, None), "/ck")
    assert got.kind == "scratch" and not got.loaded


def test_exit_on_missing_checkpoint_refuses_a_scratch_start_naming_the_directory() -> None:
    with pytest.raises(resume.MissingCheckpointError, match="--exit-on-missing-checkpoint: no checkpoint under /ck"):
        resume.from_sources(JobConfig("p", tenplex=True, exit_on_missing=True), Recording(), None,
                            Sources(None, None, None), "/ck")


def test_tenplex_durable_checkpoint_is_loaded_before_megatrons(tmp_path) -> None:
    """The query found tenplex's own checkpoint (the load directory itself here): the engine loads it; Megatron's
    is not looked at."""
    ck = str(tmp_path)
    eng = Recording()
    got = resume.from_sources(JobConfig("p", tenplex=True), eng, None, Sources(None, ck, None), ck)
    assert got.kind == "durable" and got.result.path == ck and eng.calls == [("load", (ck, None))]


def test_a_scope_the_checkpoint_flags_give_is_loaded_first_and_without_them_nothing_is_scoped(tmp_path) -> None:
    """--ckpt-step / --finetune / --no-load-optim: the scoped step comes first, from the directory they name;
    a job without them, or without --tenplex, has no scoped step."""
    ck = tmp_path / "ck"
    _committed(ck / "iter_0000003")
    scope = LoadScope(optimizer=False)
    assert resume.scoped(JobConfig("p", tenplex=True), Recording(), str(ck)) is None
    assert resume.scoped(JobConfig("p", tenplex=False, load_scope=scope), Recording(), str(ck)) is None
    eng = Recording()
    got = resume.scoped(JobConfig("p", tenplex=True, load_scope=scope), eng, str(ck))
    assert got is not None and got.kind == "scoped" and got.scope == scope
    assert eng.calls == [("load", (str(ck / "iter_0000003"), scope))]


def test_a_pretrained_checkpoint_is_a_fine_tune_when_load_holds_nothing(tmp_path) -> None:
    pre = tmp_path / "pre"
    _committed(pre / "iter_0000009")
    eng = Recording()
    got = resume.scoped(JobConfig("p", tenplex=True, pretrained=str(pre)), eng, str(tmp_path / "empty"))
    assert got is not None and got.scope == LoadScope(optimizer=False, rng=False, finetune=True)
    assert eng.calls[0][0] == "load" and eng.calls[0][1][0] == str(pre / "iter_0000009")
