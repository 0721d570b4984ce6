"""Confinement: a name read from a checkpoint names a file inside it, or it is a CheckpointFileError.

Property tests over generated names (absolute, ``..`` at any depth, symbolic
links inside and outside, unicode, very long names) for ``storage.confine``;
then crafted checkpoints for each reader (tenplex metadata, the tracker,
DeepSpeed's own directories, the CLI): a name outside the directory fails
with the error naming the checkpoint, the name and why, and nothing outside is
opened (seen by an audit hook on every ``open``).
"""

from __future__ import annotations

import os
import shutil
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tenplex_megatron import cli
from tenplex_megatron.engine.chunks import LocalChunk
from tenplex_megatron.engine.load import load_chunks
from tenplex_megatron.engine.save import save_chunks
from tenplex_megatron.execute.collective import RankFailure
from tenplex_megatron.integrations.deepspeed import native
from tenplex_megatron.plan.ptc import Chunk, TensorMeta
from tenplex_megatron.storage.confine import NAME_MAX, PATH_MAX, confine, confine_all
from tenplex_megatron.storage.directory import find_checkpoint, find_megatron_checkpoint, read_metadata
from tenplex_megatron.storage.files import CheckpointFileError
from tests.harness import rewrite_metadata

# ---------------------------------------------------------------------------------------------------------------
# every file opened by this process, seen by an audit hook (the real opens, nothing mocked)
# ---------------------------------------------------------------------------------------------------------------

_OPENED: list[str] = []


def _audit(event: str, args: tuple) -> None:
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


def opened_under(path: str) -> list[str]:
    """Files opened since the last call whose real path lies under ``path``."""
    real = os.path.realpath(path)
    got = [p for p in _OPENED if os.path.realpath(p) == real or os.path.realpath(p).startswith(real + os.sep)]
    _OPENED.clear()
    return got


# ---------------------------------------------------------------------------------------------------------------
# the confinement function, property-tested
# ---------------------------------------------------------------------------------------------------------------

_CHARS = st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="/\\")
component = st.text(_CHARS, min_size=1, max_size=30).filter(lambda c: c not in (".", "..") and len(c.encode()) <= NAME_MAX)
relative = st.lists(component, min_size=1, max_size=6).map("/".join)


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A checkpoint directory with links of every kind in it, and a directory outside it.

    root/data/f.safetensors, root/data/up -> ../.. (out);  root/in_link -> data, root/in_abs -> /abs/root/data,
    root/back_in -> ../root/data (out and back in), root/dangling -> missing (in), root/root_link -> . (root),
    root/up_link -> .. (out), root/out_abs -> /abs/outside (out), root/chain -> up_link (out), root/loop -> loop
    """
    base = tmp_path_factory.mktemp("confine")
    root, outside = base / "root", base / "outside"
    (root / "data").mkdir(parents=True)
    outside.mkdir()
    (root / "data" / "f.safetensors").write_bytes(b"in")
    (outside / "f.safetensors").write_bytes(b"out")
    links = {"data/up": "../..", "in_link": "data", "in_abs": str(root / "data"), "back_in": "../root/data",
             "dangling": "missing", "root_link": ".", "up_link": "..", "out_abs": str(outside), "chain": "up_link",
             "loop": "loop"}
    for name, target in links.items():
        os.symlink(target, root / name)
    return str(root), str(outside)


def _expected_state(parts: list[str]) -> str:
    """Where ``parts`` leads in :func:`tree`, worked out from the links' definitions (not with realpath)."""
    state = "root"
    for p in parts:
        if state == "root":
            state = {"data": "data", "in_link": "data", "in_abs": "data", "back_in": "data", "root_link": "root",
                     "up_link": "out", "out_abs": "out", "chain": "out", "loop": "loop"}.get(p, "inside")
        elif state == "data":
            state = "out" if p == "up" else "inside"
        elif state == "inside":
            state = "inside"
    return state


@settings(max_examples=300, deadline=None)
@given(relative)
def test_plain_relative_names_stay_as_they_are_inside_the_directory(tree, name: str) -> None:
    root, _ = tree
    first = name.split("/")[0]
    if first in ("data", "in_link", "in_abs", "back_in", "dangling", "root_link", "up_link", "out_abs", "chain",
                 "loop"):
        return  # the links' own names: the next test
    assert confine(root, name) == os.path.join(os.path.abspath(root), name)


link_names = st.sampled_from(["data", "in_link", "in_abs", "back_in", "dangling", "root_link", "up_link", "out_abs",
                              "chain", "loop", "plain", "données"])
tails = st.lists(st.one_of(st.sampled_from(["up", "f.safetensors", "data", "loop"]), component), max_size=4)


@settings(max_examples=400, deadline=None)
@given(link_names, tails)
def test_names_through_links_are_accepted_exactly_when_they_stay_inside(tree, first: str, tail: list[str]) -> None:
    root, outside = tree
    parts = [first, *tail]
    name = "/".join(parts)
    state = _expected_state(parts)
    if state in ("data", "inside"):
        assert confine(root, name) == os.path.join(os.path.abspath(root), name)
        return
    with pytest.raises(CheckpointFileError) as e:
        confine(root, name, "the test's index")
    msg = str(e.value)
    assert msg.startswith(f"{root}: the test's index names the file {name!r}, which ")
    if state == "loop":
        assert "symbolic link loop" in msg
    else:
        assert "through a symbolic link, outside the checkpoint directory" in msg


@settings(max_examples=200, deadline=None)
@given(relative)
def test_absolute_names_are_refused(tree, name: str) -> None:
    root, outside = tree
    for absolute in ("/" + name, os.path.join(outside, name), "//" + name):
        with pytest.raises(CheckpointFileError, match="is an absolute path"):
            confine(root, absolute)


@settings(max_examples=300, deadline=None)
@given(st.lists(component, max_size=6), st.data())
def test_a_dotdot_component_at_any_depth_is_refused(tree, parts: list[str], data) -> None:
    root, _ = tree
    at = data.draw(st.integers(0, len(parts)))
    name = "/".join([*parts[:at], "..", *parts[at:]])
    with pytest.raises(CheckpointFileError) as e:
        confine(root, name)
    assert "has a '..' component" in str(e.value) and repr(name) in str(e.value)


@settings(max_examples=200, deadline=None)
@given(relative, st.data())
def test_odd_names_are_refused(tree, name: str, data) -> None:
    root, _ = tree
    at = data.draw(st.integers(0, len(name)))
    for bad, why in [(name[:at] + "\0" + name[at:], "NUL byte"), (name[:at] + "\n" + name[at:], "control character"),
                     (name[:at] + "\\" + name[at:], "backslash"), (name + "/", "empty or '.' component"),
                     (name.replace("/", "//", 1) if "/" in name else "./" + name, "empty or '.' component"),
                     (name + "/.", "empty or '.' component"), (name[:at] + "\udc80" + name[at:], "UTF-8")]:
        with pytest.raises(CheckpointFileError, match=why):
            confine(root, bad)


def test_empty_and_non_string_names_are_refused(tree) -> None:
    root, _ = tree
    for bad, why in [("", "is empty"), (".", "'.' component"), ("..", "'..' component"), (5, "is a int")]:
        with pytest.raises(CheckpointFileError, match=why):
            confine(root, bad)  # type: ignore[arg-type]


@settings(max_examples=100, deadline=None)
@given(component, st.integers(1, 40))
def test_very_long_names_are_refused_naming_the_limit(tree, part: str, extra: int) -> None:
    root, _ = tree
    long_part = (part * (NAME_MAX + extra))[: NAME_MAX + extra]  # over NAME_MAX bytes (characters may take 4)
    with pytest.raises(CheckpointFileError, match=f"at most {NAME_MAX}"):
        confine(root, long_part)
    ok = "a" * NAME_MAX
    assert confine(root, ok).endswith(ok)
    many = "/".join(["b" * 200] * (PATH_MAX // 200 + 1))
    with pytest.raises(CheckpointFileError, match=f"at most {PATH_MAX}"):
        confine(root, many)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(st.characters(min_codepoint=0x80, blacklist_categories=("Cs", "Cc")), min_size=1,
                        max_size=20).filter(lambda c: len(c.encode()) <= NAME_MAX), min_size=1, max_size=4))
def test_unicode_names_are_accepted(tree, parts: list[str]) -> None:
    root, _ = tree
    name = "/".join(parts)
    assert confine(root, name) == os.path.join(os.path.abspath(root), name)


def test_confine_all_checks_each_distinct_name_once_and_raises_on_a_bad_one(tree) -> None:
    root, _ = tree
    got = confine_all(root, ["a", "b/c", "a"])
    assert got == {"a": os.path.join(root, "a"), "b/c": os.path.join(root, "b/c")}
    with pytest.raises(CheckpointFileError, match="'../x'"):
        confine_all(root, ["a", "../x"])


def test_a_relative_checkpoint_directory_gives_an_absolute_path(tree, monkeypatch) -> None:
    root, _ = tree
    monkeypatch.chdir(os.path.dirname(root))
    assert confine("root", "data/f.safetensors") == os.path.join(root, "data/f.safetensors")
    with pytest.raises(CheckpointFileError, match=r"^root: the metadata names the file 'up_link/f.safetensors'"):
        confine("root", "up_link/f.safetensors")


# ---------------------------------------------------------------------------------------------------------------
# a crafted tenplex checkpoint: a load fails before anything is read, and reads nothing outside
# ---------------------------------------------------------------------------------------------------------------

FULL = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48)
HALVES = [Chunk("w", (0, 0), (64, 48), (0, 1536)), Chunk("w", (0, 0), (64, 48), (1536, 3072))]


def _local(full: torch.Tensor, chunk: Chunk) -> LocalChunk:
    box = full[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.shape))].reshape(-1)
    a, b = chunk.flat_range
    return LocalChunk(TensorMeta("w", tuple(full.shape), "float32"), chunk, box[a:b].clone(), True)


def _save(save: str, full: torch.Tensor) -> str:
    return save_chunks([_local(full, c) for c in HALVES], save, 1, {"tp": 1}, {}, lambda infos: {}).path


@pytest.fixture
def crafted(tmp_path) -> tuple[str, str]:
    """A checkpoint (of FULL) and, beside it, a valid shard file of other data with the same tensor names."""
    ckpt = _save(str(tmp_path / "save"), FULL)
    other = _save(str(tmp_path / "other"), -FULL)
    outside = str(tmp_path / "outside.safetensors")
    shutil.move(os.path.join(other, "rank_00000.safetensors"), outside)
    shutil.rmtree(tmp_path / "other")
    _OPENED.clear()
    return ckpt, outside


def _load_into_zeros(save: str) -> tuple[LocalChunk, BaseException]:
    dst = _local(torch.zeros_like(FULL), Chunk("w", (0, 0), (64, 48)))
    with pytest.raises(RankFailure) as e:
        load_chunks(save, None, lambda meta: [dst], lambda meta: None, strict=True)
    return dst, e.value


def _point_chunks_at(name: str):
    def edit(meta: dict) -> None:
        for c in meta["ptc"]["chunks"]:
            c["at"]["file"] = name
    return edit


@pytest.mark.parametrize("how", ["dotdot", "absolute", "files-map"])
def test_metadata_naming_a_file_outside_fails_at_load_and_reads_nothing_outside(crafted, how: str, capsys) -> None:
    ckpt, outside = crafted
    name = "../outside.safetensors" if how != "absolute" else outside
    if how == "files-map":
        rewrite_metadata(ckpt, lambda meta: meta.update(files={name: os.path.getsize(outside)}))
    else:
        rewrite_metadata(ckpt, _point_chunks_at(name))
    dst, err = _load_into_zeros(os.path.dirname(ckpt))
    cause = err.__cause__
    assert isinstance(cause, CheckpointFileError), err
    msg = str(cause)
    assert ckpt in msg and repr(name) in msg and "a checkpoint may only name files inside its own directory" in msg
    assert ("is an absolute path" if how == "absolute" else "has a '..' component") in msg
    assert "load from" in str(err) and "planning" in str(err) and "rank 0: CheckpointFileError" in str(err)
    assert torch.count_nonzero(dst.data) == 0  # untouched
    if how == "files-map":
        with pytest.raises(CheckpointFileError, match=r"metadata.json \('files'\) names the file '../outside"):
            read_metadata(ckpt)
    assert cli.main(["inspect", ckpt]) == 2  # the CLI refuses it too
    assert f"names the file {name!r}" in capsys.readouterr().err
    assert opened_under(outside) == []


def test_a_shard_file_that_is_a_link_out_of_the_checkpoint_fails_and_is_not_read(crafted) -> None:
    ckpt, outside = crafted
    shard = os.path.join(ckpt, "rank_00000.safetensors")
    os.rename(shard, os.path.join(ckpt, "x.safetensors"))
    os.symlink(outside, shard)  # the metadata's name is plain; the file system takes it outside
    dst, err = _load_into_zeros(os.path.dirname(ckpt))
    msg = str(err.__cause__)
    assert isinstance(err.__cause__, CheckpointFileError)
    assert "'rank_00000.safetensors'" in msg and f"resolves to {os.path.realpath(outside)}" in msg
    assert torch.count_nonzero(dst.data) == 0 and opened_under(outside) == []
    os.remove(shard)  # a link that stays inside is followed
    os.symlink("x.safetensors", shard)
    loaded = load_chunks(os.path.dirname(ckpt), None, lambda meta: [dst], lambda meta: None, strict=True)
    assert torch.equal(dst.data, FULL.reshape(-1)) and loaded.stats.bytes_read == FULL.numel() * 4
    assert os.path.join(ckpt, "rank_00000.safetensors") in opened_under(ckpt)  # control: the hook sees the opens


def test_the_tracker_naming_a_link_out_of_the_save_directory_is_refused(tmp_path) -> None:
    save = str(tmp_path / "save")
    _save(save, FULL)
    elsewhere = _save(str(tmp_path / "elsewhere"), -FULL)  # a valid checkpoint outside
    os.symlink(elsewhere, os.path.join(save, "iter_0000007"))
    os.remove(os.path.join(save, "latest_checkpointed_iteration.txt"))
    # scanning ignores the link (not a directory this project made): the real newest is found
    assert find_checkpoint(save) == os.path.join(save, "iter_0000001")
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("7")
    _OPENED.clear()
    with pytest.raises(CheckpointFileError, match=r"latest_checkpointed_iteration.txt names the file 'iter_0000007'"):
        find_checkpoint(save)
    with pytest.raises(CheckpointFileError, match="'iter_0000007'.*outside the checkpoint directory"):
        find_megatron_checkpoint(save)
    assert opened_under(str(tmp_path / "elsewhere")) == []
    dst, err = _load_into_zeros(save)
    assert isinstance(err.__cause__, CheckpointFileError) and torch.count_nonzero(dst.data) == 0
    for text in ("../elsewhere", "/etc", "7\n7", "+7", "٧"):  # not digits: the tracker names nothing; the newest loads
        with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(text)
        assert find_checkpoint(save) == os.path.join(save, "iter_0000001"), text


# ---------------------------------------------------------------------------------------------------------------
# DeepSpeed's own directories: ``latest`` names the tag directory; the model and optimizer files
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture
def ds_dirs(tmp_path) -> tuple[str, str]:
    """A DeepSpeed save directory and, beside it, ``elsewhere/`` holding a file named like a model file."""
    load = tmp_path / "ds"
    (load / "global_step5").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    torch.save({"mp_world_size": 1}, str(elsewhere / "mp_rank_00_model_states.pt"))
    _OPENED.clear()
    return str(load), str(elsewhere)


@pytest.mark.parametrize("latest,why", [("../elsewhere", "has a '..' component"),
                                         ("global_step5/../../elsewhere", "has a '..' component"),
                                         ("ABS", "is an absolute path"), ("", "is empty"),
                                         ("link", "outside the checkpoint directory")])
def test_deepspeed_latest_naming_a_directory_outside_is_refused(ds_dirs, latest: str, why: str) -> None:
    load, elsewhere = ds_dirs
    latest = elsewhere if latest == "ABS" else latest
    os.symlink(elsewhere, os.path.join(load, "link"))
    with open(os.path.join(load, "latest"), "w") as f:
        f.write(latest + "\n")
    with pytest.raises(CheckpointFileError) as e:
        native.step_dir(load, None)
    msg = str(e.value)
    assert msg.startswith(f"{load}: its 'latest' file names the file {latest!r}, which ") and why in msg
    assert opened_under(elsewhere) == []
    with open(os.path.join(load, "latest"), "w") as f:
        f.write("global_step5")
    assert native.step_dir(load, None) == os.path.join(load, "global_step5")
    assert native.step_dir(load, 5) == os.path.join(load, "global_step5")
    with pytest.raises(CheckpointFileError, match="the tag argument names the file '../elsewhere'"):
        native.step_dir(load, "../elsewhere")


def test_deepspeed_model_and_optimizer_files_linked_out_are_refused_before_reading(ds_dirs) -> None:
    load, elsewhere = ds_dirs
    step = os.path.join(load, "global_step5")
    os.symlink(os.path.join(elsewhere, "mp_rank_00_model_states.pt"), os.path.join(step, "mp_rank_00_model_states.pt"))
    with pytest.raises(CheckpointFileError, match="'mp_rank_00_model_states.pt', which resolves to .*elsewhere"):
        native.open_native(step)
    optim = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    os.symlink(os.path.join(elsewhere, "mp_rank_00_model_states.pt"), os.path.join(step, optim))
    with pytest.raises(CheckpointFileError, match=f"'{optim}', which resolves to .*elsewhere"):
        native.NativeSources(step, trust_pickles=False).state_dict(optim)
    assert opened_under(elsewhere) == []
