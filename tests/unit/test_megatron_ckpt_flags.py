"""The table of Megatron-LM's checkpoint settings under --tenplex (plan/megatron_ckpt_flags.py): every setting of
core_v0.15-0.19 classified, each refusal naming its flag, and the scopes and retention the flags turn into."""

from __future__ import annotations

import argparse
import json
import random

import pytest

from tenplex_megatron.plan import megatron_ckpt_flags as table
from tenplex_megatron.plan.unsupported import unsupported_job_flags

#: The checkpoint settings (args attributes) of Megatron-LM core_v0.15.3, 0.16.1, 0.17.1, 0.18.2 and 0.19.0 together:
#: CheckpointConfig's fields and the checkpointing argument group's destinations, as
#: tests/megatron_lm/test_megatron_lm_ckpt_settings.py reads them from a checkout (which also checks the installed
#: one, so a newer release line is caught there); with --dataloader-type.
RELEASED = (
    "async_ckpt_cpu_priority async_ckpt_io_priority async_ckpt_use_cpu_shm async_save async_strategy "
    "auto_detect_ckpt_format ckpt_assume_constant_structure ckpt_convert_format ckpt_convert_save "
    "ckpt_convert_update_legacy_dist_opt_format ckpt_format ckpt_fully_parallel_load "
    "ckpt_fully_parallel_load_exchange_algo ckpt_fully_parallel_load_process_group ckpt_fully_parallel_save "
    "ckpt_fully_parallel_save_deprecated ckpt_fully_parallel_save_process_group ckpt_load_validate_sharding_integrity "
    "ckpt_step dist_ckpt_format_deprecated dist_ckpt_optim_fully_reshardable dist_ckpt_save_pre_mcore_014 "
    "dist_ckpt_strictness dist_ckpt_workers distrib_optim_fully_reshardable_mem_efficient exit_on_missing_checkpoint "
    "finetune load load_main_params_from_ckpt load_optim load_rng most_recent_k no_load_optim no_load_rng "
    "no_save_optim no_save_rng non_persistent_ckpt_type non_persistent_global_ckpt_dir non_persistent_local_ckpt_algo "
    "non_persistent_local_ckpt_dir non_persistent_save_interval override_ckpt_iteration perform_initialization "
    "pretrained_checkpoint replication replication_factor replication_jump save save_activations_interval "
    "save_dgrads_interval save_interval save_optim save_params_interval save_retain_interval save_rng "
    "save_tokenizer_assets save_tokens_per_expert_interval save_wgrads_interval stream_ckpt_dequant "
    "strict_fsdp_dtensor_load use_checkpoint_args use_dist_ckpt_deprecated use_mp_args_from_checkpoint_args "
    "use_persistent_ckpt_worker use_tokenizer_model_from_checkpoint_args verify_integrity dataloader_type"
).split()


def test_every_released_setting_is_classified() -> None:
    assert table.unclassified(RELEASED) == []
    assert table.unclassified([*RELEASED, "a_new_setting"]) == ["a_new_setting"]


def test_every_row_has_a_verdict_a_flag_and_a_reason() -> None:
    names = [n for s in table.SETTINGS for n in s.names]
    assert len(names) == len(set(names)), "a setting in two rows"
    for s in table.SETTINGS:
        assert s.verdict in table.VERDICTS, s
        assert s.flag.startswith("--") and " " not in s.flag, s
        assert len(s.why) > 20, s
        if s.verdict == table.REFUSED and s.accepted is None:  # refused elsewhere: plan/unsupported.py
            assert unsupported_job_flags(argparse.Namespace(**{s.names[0]: True})), s


def test_defaults_are_accepted() -> None:
    defaults = argparse.Namespace(**{s.names[0]: s.accepted[0] for s in table.SETTINGS if s.accepted})
    assert table.refusals(defaults) == []
    assert table.refusals(argparse.Namespace()) == []


@pytest.mark.parametrize("setting", [s for s in table.SETTINGS if s.accepted], ids=lambda s: s.flag)
def test_each_refusal_names_its_flag_and_why(setting: table.Setting) -> None:
    value = "cyclic" if setting.names[0] == "dataloader_type" else (True if False in setting.accepted else 7)
    lines = table.refusals(argparse.Namespace(**{setting.names[0]: value}))
    assert len(lines) == 1 and lines[0].startswith(setting.flag), lines
    assert setting.why in lines[0]


def test_dataloader_types() -> None:
    for kind in ("single", "external", None):
        assert table.refusals(argparse.Namespace(dataloader_type=kind)) == []
    assert table.refusals(argparse.Namespace(dataloader_type="cyclic"))[0].startswith("--dataloader-type cyclic")


def test_load_scope_follows_megatron() -> None:
    ns = argparse.Namespace
    assert table.load_scope(ns()) == table.LoadScope()
    assert table.load_scope(ns(ckpt_step=6)).iteration == 6
    ft = table.load_scope(ns(finetune=True))
    assert ft.finetune and not ft.optimizer and not ft.rng
    assert not table.load_scope(ns(no_load_optim=True)).optimizer and table.load_scope(ns(no_load_optim=True)).rng
    assert not table.load_scope(ns(load_rng=False)).rng
    assert table.load_scope(ns(), finetune=True).finetune  # --pretrained-checkpoint's load
    assert table.save_scope(ns(no_save_optim=True)) == table.SaveScope(optimizer=False)
    assert table.save_scope(ns(save_rng=False)) == table.SaveScope(rng=False)


def test_retention_keeps_the_newest_and_the_multiples() -> None:
    rng = random.Random(3)
    for _ in range(200):
        its = sorted(rng.sample(range(1, 60), rng.randint(1, 12)))
        keep = rng.choice([None, 1, 2, 3])
        every = rng.choice([None, 2, 5])
        kept = table.Retention(keep, every).kept(its)
        newest = len(its) if keep is None and every is None else (keep or 1)
        assert set(its[-newest:]) <= set(kept)
        assert {i for i in its if every and i % every == 0} <= set(kept)
        assert set(kept) <= set(its[-newest:]) | {i for i in its if every and i % every == 0}


def test_retention_from_flags_combines_keep_and_most_recent_k() -> None:
    ns = argparse.Namespace
    assert table.retention(ns(tenplex_keep=None, most_recent_k=-1)) is None
    assert table.retention(ns(tenplex_keep=3, most_recent_k=2)).keep == 2
    assert table.retention(ns(tenplex_keep=3, most_recent_k=-1)).keep == 3
    assert table.retention(ns(save_retain_interval=4)) == table.Retention(None, 4)
    assert "--most-recent-k 0" in table.retention_problem(ns(most_recent_k=0))
    assert "--save-retain-interval" in table.retention_problem(ns(save_retain_interval=0))
    assert table.retention_problem(ns(tenplex_keep=2, most_recent_k=-1)) is None


def _committed(root, iterations: list[int]) -> None:
    """Directories the storage layer counts as complete tenplex checkpoints (their metadata alone)."""
    from tenplex_megatron.storage import directory

    for it in iterations:
        d = root / directory.iter_dir_name(it)
        d.mkdir()
        (d / directory.METADATA_FILE).write_text(json.dumps(
            {"format": directory.FORMAT_NAME, "format_version": directory.FORMAT_VERSION, "iteration": it}))


def test_apply_retention_deletes_what_the_rule_does_not_keep(tmp_path) -> None:
    from tenplex_megatron.storage import directory

    its = list(range(1, 11))
    _committed(tmp_path, its)
    rule = table.Retention(keep=2, retain_interval=4)
    removed = directory.apply_retention(str(tmp_path), rule)
    assert directory.committed_iterations(str(tmp_path)) == rule.kept(its)
    assert len(removed) == len(its) - len(rule.kept(its))


def test_ckpt_step_not_there_lists_the_steps_there(tmp_path) -> None:
    from tenplex_megatron.storage.files import CheckpointFileError
    from tenplex_megatron.storage.steps import checkpoint_at

    _committed(tmp_path, [3, 6])
    assert checkpoint_at(str(tmp_path), 3).endswith("iter_0000003")
    with pytest.raises(CheckpointFileError, match=r"--ckpt-step 5: .*the iterations there: 3, 6"):
        checkpoint_at(str(tmp_path), 5)


@pytest.mark.parametrize("flags,named", [({"dataloader_type": "cyclic"}, "--dataloader-type cyclic"),
                                         ({"non_persistent_ckpt_type": "global"}, "--non-persistent-ckpt-type global"),
                                         ({"use_mp_args_from_checkpoint_args": True}, "--use-mp-args-from-checkpoint-args"),
                                         ({"most_recent_k": 0}, "--most-recent-k 0")])
def test_the_hook_refuses_at_start_naming_the_flag(flags: dict, named: str, caplog) -> None:
    """The Megatron-LM hook's validate_args (before any process group): a refused setting stops the job, exit 2."""
    from tenplex_megatron.frontdoor import megatron_lm

    args = argparse.Namespace(tenplex=True, load=None, **flags)
    with caplog.at_level("ERROR", logger="tenplex_megatron"), pytest.raises(SystemExit) as e:
        megatron_lm._validate_args(args)
    assert e.value.code == 2
    assert any(named in r.getMessage() and "with --tenplex" in r.getMessage() for r in caplog.records), caplog.text


def test_the_hook_refuses_a_ckpt_step_not_under_load(tmp_path, caplog) -> None:
    from tenplex_megatron.frontdoor import megatron_lm

    _committed(tmp_path, [2, 4])
    args = argparse.Namespace(tenplex=True, load=str(tmp_path), ckpt_step=3)
    with caplog.at_level("ERROR", logger="tenplex_megatron"), pytest.raises(SystemExit):
        megatron_lm._validate_args(args)
    assert "the iterations there: 2, 4" in caplog.text


def test_a_load_asking_for_what_the_checkpoint_lacks_is_refused() -> None:
    """Before anything is copied: the optimizer of a weights-only checkpoint; a fine-tune of one without weights."""
    from tenplex_megatron.engine.load import check_scope
    from tenplex_megatron.storage.checkpoint_metadata import CheckpointMetadata
    from tenplex_megatron.storage.source import ForeignMetadata

    def tenplex(key: str, **fields: object) -> CheckpointMetadata:
        ptc = {"ptc_version": 1, "tensors": [{"key": key, "shape": [4], "dtype": "float32"}], "chunks": [], "layout": {}}
        return CheckpointMetadata.from_json({"format_version": 2, "iteration": 4, "ptc": ptc, **fields},
                                            "ckpt/metadata.json")

    weights_only = tenplex("embedding.weight", weights_only=True)
    with pytest.raises(ValueError, match="holds the weights only .*--no-load-optim"):
        check_scope(weights_only, table.LoadScope(), "ckpt")
    check_scope(weights_only, table.LoadScope(optimizer=False), "ckpt")
    no_weights = tenplex("optimizer.state.exp_avg.embedding.weight")
    with pytest.raises(ValueError, match="--finetune: .* holds no model weights"):
        check_scope(no_weights, table.LoadScope(optimizer=False, rng=False, finetune=True), "ckpt")
    megatron = ForeignMetadata.of("megatron torch_dist", {"iteration": 4, "layout": {"tp": 1}})  # Megatron's own
    check_scope(megatron, table.LoadScope(optimizer=False, rng=False, finetune=True), "ckpt")


def test_a_host_memory_snapshot_takes_the_jobs_save_scope() -> None:
    """--no-save-optim on the memory path: the adapter the Checkpointer snapshots through records no optimizer and
    no LR schedule, marked weights-only (the optimizer is never read: the job here has none)."""
    from tenplex_megatron.frontdoor.engines import MegatronCoreEngine
    from tenplex_megatron.integrations.megatron_core.adapter import LiveJob, LiveSpec
    from tenplex_megatron.plan.layout import ParallelLayout

    job = LiveJob([], None, None, ParallelLayout(tp=2), LiveSpec(95, 1234), 96, True, iteration=4)
    adapter = MegatronCoreEngine(job).adapter(table.SaveScope(optimizer=False, rng=False))
    assert adapter.save_scope == table.SaveScope(optimizer=False, rng=False)
    record = adapter.metadata().to_json()
    assert record["weights_only"] is True and record["optimizer"] is None and record["scheduler"] is None
    assert MegatronCoreEngine(job).adapter().save_scope == table.SaveScope()
