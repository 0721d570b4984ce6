"""Untrusted checkpoints: malformed metadata and safetensors headers give clean errors, nothing else.

Loading never unpickles (there is no pickle in the format); these fuzz tests feed
random and mutated metadata JSON and safetensors headers to the parsers and
accept only success or the project's own error types: no other exception, no
hang, no allocation sized by the file's claims.
"""

from __future__ import annotations

import json
import os
import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tenplex_megatron.plan.ptc import PTC, PTCError
from tenplex_megatron.storage.directory import read_metadata
from tenplex_megatron.storage.safetensors_io import CheckpointFileError, SafetensorsReader, read_header

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)

GOOD_PTC = {
    "ptc_version": 1,
    "layout": {"tp": 1, "pp": 1, "dp": 1},
    "tensors": [{"key": "w", "shape": [4, 3], "dtype": "float32"}],
    "chunks": [{"key": "w", "offsets": [0, 0], "shape": [4, 3], "at": {"file": "f", "name": "n"}}],
}


def _mutations(doc: dict) -> st.SearchStrategy:
    paths = []

    def walk(x, path):
        paths.append(path)
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, (*path, k))
        elif isinstance(x, list):
            for i, v in enumerate(x):
                walk(v, (*path, i))

    walk(doc, ())
    return st.tuples(st.sampled_from(paths[1:]), json_values)


def _set(doc, path, value):
    doc = json.loads(json.dumps(doc))
    x = doc
    for p in path[:-1]:
        x = x[p]
    x[path[-1]] = value
    return doc


@settings(max_examples=150, deadline=None)  # random examples: each run draws new ones (no example database in CI)
@given(doc=json_values)
def test_ptc_from_random_json(doc) -> None:
    try:
        PTC.from_json(doc)
    except PTCError:
        pass


@settings(max_examples=200, deadline=None)
@given(mutation=_mutations(GOOD_PTC))
def test_ptc_from_mutated_json(mutation) -> None:
    path, value = mutation
    try:
        PTC.from_json(_set(GOOD_PTC, path, value))
    except PTCError:
        pass


def _safetensors_bytes(header: object, data: bytes = b"\0" * 48, length: int | None = None) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


GOOD_HEADER = {"t": {"dtype": "F32", "shape": [4, 3], "data_offsets": [0, 48]}}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutation=_mutations(GOOD_HEADER), length=st.one_of(st.none(), st.integers(0, 2**64 - 1)))
def test_safetensors_mutated_header(tmp_path, mutation, length) -> None:
    path, value = mutation
    f = os.path.join(tmp_path, "x.safetensors")
    with open(f, "wb") as fh:
        fh.write(_safetensors_bytes(_set(GOOD_HEADER, path, value), length=length))
    try:
        r = SafetensorsReader(f)
        for name in r.entries:
            r.flat(name)
        r.close()
    except CheckpointFileError as e:
        assert f in str(e)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(blob=st.binary(max_size=64))
def test_safetensors_random_bytes(tmp_path, blob) -> None:
    f = os.path.join(tmp_path, "y.safetensors")
    with open(f, "wb") as fh:
        fh.write(blob)
    try:
        read_header(f)
    except CheckpointFileError as e:
        assert f in str(e)


def test_header_claiming_huge_sizes_is_refused_without_allocating(tmp_path) -> None:
    f = os.path.join(tmp_path, "huge.safetensors")
    with open(f, "wb") as fh:
        fh.write(_safetensors_bytes({"t": {"dtype": "F32", "shape": [2**40], "data_offsets": [0, 2**42]}}))
    try:
        read_header(f)
        raise AssertionError("accepted a tensor larger than the file")
    except CheckpointFileError as e:
        assert "truncated" in str(e)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=json_values | st.builds(lambda v: {"format": "tenplex-megatron", "format_version": v}, json_values))
def test_metadata_file_fuzz(tmp_path, doc) -> None:
    d = os.path.join(tmp_path, "ck")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "metadata.json"), "w") as fh:
        json.dump(doc, fh)
    try:
        read_metadata(d)
    except CheckpointFileError as e:
        assert "metadata.json" in str(e)
