"""Packaging metadata: pyproject.toml agrees with the pinned set, one version, and missing extras are named."""

from __future__ import annotations

import os
import re

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import tenplex_megatron
from tenplex_megatron import cli
from tenplex_megatron._optional import MissingExtraError, require
from tests.harness import ROOT


def _pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _pins() -> dict[str, str]:
    """requirements.txt: name -> pinned version (every line must be an exact pin)."""
    pins = {}
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                req = Requirement(line)
                (spec,) = req.specifier
                assert spec.operator == "==", f"requirements.txt: {line}: not an exact pin"
                pins[canonicalize_name(req.name)] = spec.version
    return pins


def test_every_declared_dependency_is_pinned_and_tested() -> None:
    """Core and extras (but [megatron-lm], which needs a Megatron-LM checkout) are exactly the pinned, tested set:
    every requirement that applies to this interpreter (its environment marker) allows the pin."""
    project = _pyproject()["project"]
    pins = _pins()
    declared: dict[str, list[Requirement]] = {}
    groups = {"core": project["dependencies"], **project["optional-dependencies"]}
    for group, reqs in groups.items():
        for r in map(Requirement, reqs):
            if canonicalize_name(r.name) == canonicalize_name(project["name"]):
                assert r.extras <= set(groups) - {"test"}, (group, str(r))  # [test] pulls in other extras
                continue
            if group == "megatron-lm" or (r.marker is not None and not r.marker.evaluate()):
                continue
            declared.setdefault(canonicalize_name(r.name), []).append(r)
    torch_pin = re.search(r"^TORCH_SPEC \?= torch==(\S+)$", open(os.path.join(ROOT, "Makefile")).read(), re.M)
    assert torch_pin, "Makefile: TORCH_SPEC ?= torch==X"
    pins_and_torch = {**pins, "torch": torch_pin.group(1)}
    assert set(declared) == set(pins_and_torch), "pyproject.toml and requirements.txt (+ torch) differ"
    for name, reqs in declared.items():
        for req in reqs:
            assert req.specifier.contains(pins_and_torch[name]), f"{req} does not allow the pinned {pins_and_torch[name]}"
    assert "deepspeed" not in {canonicalize_name(Requirement(r).name) for r in project["dependencies"]}


def test_one_version() -> None:
    meta = _pyproject()
    assert "version" in meta["project"]["dynamic"] and "version" not in meta["project"]
    assert meta["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "tenplex_megatron.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", tenplex_megatron.__version__)


def test_package_data_is_declared() -> None:
    data = _pyproject()["tool"]["setuptools"]["package-data"]
    for package, files in data.items():
        for name in files:
            assert os.path.isfile(os.path.join(ROOT, *package.split("."), name)), (package, name)
    assert "models.json" in data["tenplex_megatron.plan.sim"]


def test_cli_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"tenplex-megatron {tenplex_megatron.__version__}"


def test_require_names_the_extra(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert require("json", "hf").__name__ == "json"
    with pytest.raises(MissingExtraError) as e:
        require("tenplex_test_absent_module", "bench", needed_by="the plot")
    assert str(e.value) == ("the plot needs tenplex_test_absent_module, which is not installed: "
                            "pip install 'tenplex-megatron[bench]'")
    assert isinstance(e.value, ImportError) and e.value.name == "tenplex_test_absent_module"
    # the module is there but one of its own imports is not: the message names that one
    (tmp_path / "tenplex_test_half_installed.py").write_text("import tenplex_test_absent_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(MissingExtraError) as e:
        require("tenplex_test_half_installed", "megatron-lm", note="a note")
    assert "no module named 'tenplex_test_absent_dependency'" in str(e.value)
    assert str(e.value).endswith("pip install 'tenplex-megatron[megatron-lm]'; a note")


def test_the_inprocess_extra_fits_each_python() -> None:
    """[inprocess] installs what works together: on Python 3.11 NVRx 0.4.1 with megatron-core up to 0.17.0
    (from 0.17.1 its import asserts NVRx >= 0.6), on Python 3.12 NVRx 0.6 or newer, which megatron-core 0.19 asks for."""
    extra = [Requirement(r) for r in _pyproject()["project"]["optional-dependencies"]["inprocess"]]

    def applying(python: str) -> dict[str, list[Requirement]]:
        out: dict[str, list[Requirement]] = {}
        for r in extra:
            if r.marker is None or r.marker.evaluate({"python_version": python}):
                out.setdefault(canonicalize_name(r.name), []).append(r)
        return out

    py311, py312 = applying("3.11"), applying("3.12")
    assert all(r.specifier.contains("0.4.1") for r in py311["nvidia-resiliency-ext"])
    assert not any(r.specifier.contains(v) for r in py311["megatron-core"] for v in ("0.17.1", "0.18.2", "0.19.0"))
    assert all(r.specifier.contains("0.17.0") and r.specifier.contains("0.16.1") for r in py311["megatron-core"])
    assert all(r.specifier.contains("0.7.0") and not r.specifier.contains("0.5.0")
               for r in py312["nvidia-resiliency-ext"])
    assert "megatron-core" not in py312
