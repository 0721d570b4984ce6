"""Hook a Megatron-LM checkout's training loop: ``--tenplex`` checkpoints and a DP-independent data order.

Use (``patches/megatron-lm-core_v0.16.x.patch`` does this in ``pretrain_gpt.py``)::

    from tenplex_megatron.integrations import megatron_lm as tenplex
    tenplex.install()
    pretrain(..., extra_args_provider=tenplex.extra_args_provider(previous_provider))

``install`` wraps ``save_checkpoint``, ``load_checkpoint`` and
``build_pretraining_data_loader`` where ``megatron.training.training`` looks
them up. With ``--tenplex`` a save goes through tenplex and a load re-shards
the newest tenplex checkpoint to the restarted job's layout; a ``--load``
directory holding only Megatron's own checkpoint (``torch_dist`` with any
distributed-optimizer format, or legacy ``torch``) is adopted by tenplex at
the new layout (``megatron_core/native.py``, ``legacy.py``), and later saves
are tenplex checkpoints. Without ``--tenplex`` nothing changes.
``--tenplex-init-from-hf DIR`` starts a run whose ``--load`` directory holds no
checkpoint yet from a Hugging Face transformers checkpoint (Megatron-LM calls
``load_checkpoint`` only when ``--load`` is given: give it, empty on the first
start). The padded vocabulary follows Megatron's rule
here (``--make-vocab-size-divisible-by x TP``): when it changes, real rows move
exactly and new padding rows start at zero.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from typing import Any

from tenplex_megatron._optional import require
from tenplex_megatron.integrations.hf.load import init_from_hf
from tenplex_megatron.integrations.megatron_core.adapter import (
    LiveJob,
    LiveSpec,
    adopt_megatron_checkpoint,
    load_job,
    save_job,
)
from tenplex_megatron.integrations.megatron_core.legacy import legacy_padded_vocab
from tenplex_megatron.integrations.megatron_core.native import saved_padded_vocab
from tenplex_megatron.plan.data_position import microbatch_sample_indices
from tenplex_megatron.plan.hf_map import ModelFacts
from tenplex_megatron.plan.layout import ParallelLayout, restart_padded_vocab_size
from tenplex_megatron.storage.directory import (
    find_checkpoint,
    find_megatron_checkpoint,
    is_legacy_megatron_checkpoint,
    read_metadata,
)

_ORIGINALS: dict[str, Callable[..., Any]] = {}


def add_tenplex_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("tenplex")
    g.add_argument("--tenplex", action="store_true", help="save and load through tenplex (re-shard on restart)")
    g.add_argument("--tenplex-keep", type=int, default=None, help="keep only the newest N tenplex checkpoints")
    g.add_argument("--tenplex-no-verify", action="store_true", help="skip checksum verification at load")
    g.add_argument("--tenplex-init-from-hf", default=None, metavar="DIR",
                   help="when --load holds no checkpoint yet, start from this Hugging Face transformers checkpoint "
                   "(GPT-2 or Llama) at this run's layout; its config must match the model flags")
    g.add_argument("--tenplex-trust-pickles", action="store_true",
                   help="adopting Megatron's own checkpoint: unpickle its files fully (default: only plain classes)")
    g.add_argument("--tenplex-vocab-padding", choices=["keep", "megatron"], default="keep",
                   help="keep: on restart keep the checkpoint's padded vocabulary when the new TP divides it (exact "
                   "loss continuation); megatron: always pad to make-vocab-size-divisible-by x TP (new padding "
                   "rows are zero)")
    return parser


def extra_args_provider(previous: Callable | None = None) -> Callable[[argparse.ArgumentParser], argparse.ArgumentParser]:
    """Chain tenplex's flags after an existing ``extra_args_provider``."""

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if previous is not None:
            parser = previous(parser)
        return add_tenplex_args(parser)

    return provider


_RECORDED_ARGS = (
    "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length", "max_position_embeddings",
    "make_vocab_size_divisible_by", "swiglu", "untie_embeddings_and_output_weights", "bf16", "global_batch_size",
    "micro_batch_size", "train_iters", "lr", "min_lr", "seed", "position_embedding_type", "rotary_base",
    "rotary_percent", "normalization", "norm_epsilon", "add_bias_linear", "group_query_attention", "num_query_groups",
)


def _job(model: list[Any], optimizer: Any, scheduler: Any) -> LiveJob:
    from megatron.core import mpu
    from megatron.training import get_args

    args = get_args()
    if len(model) != 1:
        raise NotImplementedError("tenplex: virtual (interleaved) pipeline stages are not supported yet")
    layout = ParallelLayout(
        mpu.get_tensor_model_parallel_world_size(),
        mpu.get_pipeline_model_parallel_world_size(),
        mpu.get_data_parallel_world_size(),
    )
    # The rows Megatron pads are the tokenizer's (``_vocab_size_with_padding(tokenizer.vocab_size)``), not
    # ``--vocab-size``: NullTokenizer adds an EOD token after ``--vocab-size`` tokens.
    from megatron.training import get_tokenizer

    try:
        vocab = get_tokenizer().vocab_size
    except AssertionError:  # no global tokenizer was built
        vocab = args.vocab_size
    spec = LiveSpec(int(vocab), int(args.seed), {k: getattr(args, k, None) for k in _RECORDED_ARGS})
    return LiveJob(model, optimizer, scheduler, layout, spec, int(args.padded_vocab_size),
                         bool(args.use_distributed_optimizer))


def save_checkpoint(iteration: int, model: list[Any], optimizer: Any, opt_param_scheduler: Any,
                    num_floating_point_operations_so_far: float, *a: Any, **kw: Any) -> None:
    """Megatron-LM's ``save_checkpoint`` signature; tenplex format when ``--tenplex``."""
    from megatron.training import get_args, print_rank_0

    args = get_args()
    if not getattr(args, "tenplex", False) or kw.get("non_persistent_ckpt"):
        return _ORIGINALS["save_checkpoint"](iteration, model, optimizer, opt_param_scheduler,
                                             num_floating_point_operations_so_far, *a, **kw)
    job = _job(model, optimizer, opt_param_scheduler)
    job.iteration = iteration
    job.consumed_samples = int(args.consumed_train_samples)
    res = save_job(job, args.save, extra={"num_floating_point_operations_so_far": num_floating_point_operations_so_far},
                       keep=args.tenplex_keep)
    print_rank_0(f"> tenplex: saved iteration {iteration} to {res.path} in {res.seconds:.2f} s")


def load_checkpoint(ddp_model: list[Any], optimizer: Any, opt_param_scheduler: Any, load_arg: str = "load",
                    strict: bool = True, *a: Any, **kw: Any) -> tuple[int, float]:
    """Megatron-LM's ``load_checkpoint`` signature; re-sharding tenplex load when ``--tenplex``."""
    from megatron.training import get_args, print_rank_0

    args = get_args()
    load_dir = getattr(args, load_arg, None)
    tenplex = getattr(args, "tenplex", False) and load_dir
    ckpt = find_checkpoint(load_dir) if tenplex else None
    mck = find_megatron_checkpoint(load_dir) if (tenplex and ckpt is None) else None
    no_megatron = not (load_dir and find_megatron_checkpoint(load_dir))
    if ckpt is None and getattr(args, "tenplex_init_from_hf", None) and no_megatron:
        job = _job(ddp_model, optimizer, opt_param_scheduler)
        run = ModelFacts.from_model_json(job.spec.to_json())
        hf = init_from_hf(job, args.tenplex_init_from_hf, run)
        print_rank_0(f"> tenplex: initialised from Hugging Face checkpoint {args.tenplex_init_from_hf} at layout "
                     f"{job.layout}: {hf.tensors} tensors, {hf.stats.bytes_read / 1e6:.2f} MB read on rank 0")
        return 0, 0.0
    if ckpt is None and mck is None:
        return _ORIGINALS["load_checkpoint"](ddp_model, optimizer, opt_param_scheduler, load_arg, strict, *a, **kw)
    job = _job(ddp_model, optimizer, opt_param_scheduler)
    if ckpt is not None:
        res = load_job(job, ckpt, verify=not args.tenplex_no_verify)
    else:  # Megatron's own checkpoint at any saving layout: adopted, later saves are tenplex checkpoints
        res = adopt_megatron_checkpoint(job, mck, args.tenplex_trust_pickles)
    args.consumed_train_samples = job.consumed_samples
    args.skipped_train_samples = 0
    flops = float((res.metadata or {}).get("extra", {}).get("num_floating_point_operations_so_far", 0.0))
    print_rank_0(
        f"> tenplex: loaded iteration {res.iteration} from {res.path}: layout {ParallelLayout.from_json(res.source_layout)} -> {job.layout}, "
        f"{res.tensors} tensors, {res.bytes_read / 1e6:.2f} MB read on rank 0 in {res.seconds:.2f} s"
    )
    return res.iteration, flops


class TenplexBatchSampler:
    """Micro-batches of global indices: global batch i is samples [i*G, (i+1)*G), DP rank r reads share r."""

    def __init__(self, total_samples: int, consumed_samples: int, global_batch_size: int, micro_batch_size: int,
                 dp_size: int, dp_rank: int):
        self.total, self.consumed = total_samples, consumed_samples
        self.gbs, self.mbs, self.dp, self.rank = global_batch_size, micro_batch_size, dp_size, dp_rank

    def __iter__(self) -> Iterator[list[int]]:
        start = self.consumed - self.consumed % self.gbs
        while start + self.gbs <= self.total:
            yield from microbatch_sample_indices(start, self.gbs, self.mbs, self.dp, self.rank)
            start += self.gbs

    def __len__(self) -> int:
        return (self.total - self.consumed) // (self.mbs * self.dp)


def build_pretraining_data_loader(dataset: Any, consumed_samples: int) -> Any:
    """Megatron-LM's data-loader builder; with ``--tenplex``, the DP-independent sampler for training data."""
    import torch
    from megatron.core import mpu
    from megatron.training import get_args

    args = get_args()
    if dataset is None or not getattr(args, "tenplex", False) or consumed_samples is None:
        return _ORIGINALS["build_pretraining_data_loader"](dataset, consumed_samples)
    sampler = TenplexBatchSampler(len(dataset), consumed_samples, args.global_batch_size, args.micro_batch_size,
                                  mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank())
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=args.num_workers,
                                       pin_memory=torch.cuda.is_available(),
                                       persistent_workers=args.num_workers > 0)


def _vocab_size_with_padding(orig_vocab_size: int, args: Any, *a: Any, **kw: Any) -> int:
    """Megatron-LM's padded vocabulary; with ``--tenplex`` (``keep``) a restart keeps the checkpoint's when TP divides it.

    Megatron's softmax covers the padding rows, so a different padded size is a
    slightly different model: keeping it makes the resumed losses continue exactly.
    """
    padded = _ORIGINALS["_vocab_size_with_padding"](orig_vocab_size, args, *a, **kw)
    if not getattr(args, "tenplex", False) or getattr(args, "tenplex_vocab_padding", "keep") != "keep" \
            or not getattr(args, "load", None):
        return padded
    ckpt = find_checkpoint(args.load)
    mck = find_megatron_checkpoint(args.load) if ckpt is None else None
    if ckpt is not None:
        saved = read_metadata(ckpt).get("padded_vocab_size")
    elif mck is not None:
        read = legacy_padded_vocab if is_legacy_megatron_checkpoint(mck) else saved_padded_vocab
        saved = read(mck, getattr(args, "tenplex_trust_pickles", False))
    else:
        return padded
    kept = restart_padded_vocab_size(orig_vocab_size, args.make_vocab_size_divisible_by,
                                     args.tensor_model_parallel_size, saved)
    if kept != padded and getattr(args, "rank", 0) == 0:
        print(f" > tenplex: keeping the checkpoint's padded vocab {kept} (Megatron's rule at this TP: {padded})",
              flush=True)
    return kept


def install() -> None:
    """Wrap Megatron-LM's checkpoint, data-loader and vocabulary-padding functions (idempotent)."""
    train_mod = require("megatron.training.training", "megatron-lm", needed_by=__name__,
                        note="megatron.training is Megatron-LM's, from a core_v0.16.x checkout on PYTHONPATH")
    import megatron.training.checkpointing as ckpt_mod
    import megatron.training.tokenizer.tokenizer as tok_mod

    if _ORIGINALS:
        return
    _ORIGINALS["_vocab_size_with_padding"] = tok_mod._vocab_size_with_padding
    tok_mod._vocab_size_with_padding = _vocab_size_with_padding
    _ORIGINALS["save_checkpoint"] = ckpt_mod.save_checkpoint
    _ORIGINALS["load_checkpoint"] = ckpt_mod.load_checkpoint
    _ORIGINALS["build_pretraining_data_loader"] = train_mod.build_pretraining_data_loader
    for mod in (ckpt_mod, train_mod):
        mod.save_checkpoint = save_checkpoint
        mod.load_checkpoint = load_checkpoint
    train_mod.build_pretraining_data_loader = build_pretraining_data_loader
