"""Build and train a megatron-core GPT job at a given parallel layout.

One place that turns a :class:`GPTSpec` and a layout into megatron-core's own
GPTModel, DistributedDataParallel, optimizer (distributed or not) and LR
scheduler, and runs one training step with megatron-core's pipeline schedules.
Used by ``scripts/pretrain_gpt.py``, the demo and the multi-process tests.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tenplex_megatron.errors import TenplexError
from tenplex_megatron.flags import FlagError
from tenplex_megatron.integrations.megatron_core.pipeline import check_chunks
from tenplex_megatron.plan.data_position import num_microbatches
from tenplex_megatron.plan.layout import ModelShape, ParallelLayout, padded_vocab_size
from tenplex_megatron.plan.pipeline_split import megatron_kwargs
from tenplex_megatron.training import cpu_shim


class SkippedStepError(TenplexError, RuntimeError):
    """An optimizer step skipped (inf or NaN gradients) in a run without fp16's loss scaling."""


@dataclass(frozen=True)
class GPTSpec:
    """A GPT model and its optimizer hyper-parameters, independent of the parallel layout."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None
    seq_length: int = 32
    max_position_embeddings: int = 32
    vocab_size: int = 100
    make_vocab_size_divisible_by: int = 16
    swiglu: bool = False
    untie_embeddings_and_output_weights: bool = False
    # Llama-style options, named as Megatron-LM's flags (an old checkpoint's record lacks them: GPT defaults)
    position_embedding_type: str = "learned_absolute"
    rotary_base: int = 10000
    rotary_percent: float = 1.0
    normalization: str = "LayerNorm"
    norm_epsilon: float = 1e-5
    add_bias_linear: bool = True
    group_query_attention: bool = False
    num_query_groups: int = 1
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    bf16: bool = False
    fp16: bool = False
    # fp16's loss scaling, as Megatron-LM's flags: a fixed scale, or dynamic from initial_loss_scale
    loss_scale: float | None = None
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    lr: float = 1e-3
    min_lr: float = 1e-4
    lr_warmup_iters: int = 2
    lr_decay_style: str = "cosine"
    train_iters: int = 20
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    seed: int = 1234
    # mixture of experts, named as Megatron-LM's flags (None experts: a dense model; old records lack them)
    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_router_topk: int = 2
    moe_token_dispatcher_type: str = "allgather"
    moe_aux_loss_coeff: float = 0.0
    moe_router_load_balancing_type: str = "aux_loss"
    moe_router_score_function: str = "softmax"
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_shared_expert_intermediate_size: int | None = None
    moe_z_loss_coeff: float | None = None
    moe_grouped_gemm: bool = False  # megatron-core's GroupedMLP experts (the local spec's grouped GEMM), not SequentialMLP

    @property
    def query_groups(self) -> int | None:
        """Key/value head groups with grouped-query attention; None: one per head (Megatron-LM's rule)."""
        return self.num_query_groups if self.group_query_attention else None

    def shape(self) -> ModelShape:
        """The layout-independent shape used by the pure planner's validation."""
        return ModelShape(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            vocab_size=self.vocab_size,
            make_vocab_size_divisible_by=self.make_vocab_size_divisible_by,
            num_query_groups=self.query_groups,
            num_experts=self.num_experts,
            moe_ffn_hidden_size=self.expert_ffn_hidden_size if self.num_experts else None,
        )

    @property
    def expert_ffn_hidden_size(self) -> int:
        """Each routed expert's FFN width: ``moe_ffn_hidden_size``, else the dense FFN's (megatron-core's default)."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size or 4 * self.hidden_size

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> GPTSpec:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(frozen=True, kw_only=True)
class DDPOptions:
    """megatron-core DDP's communication settings, as Megatron-LM's flags set them: overlapped grad reduction in
    buckets (``bucket_size`` elements; None: megatron-core's default, max(40M, 1M x DP)) and overlapped param
    all-gather (distributed optimizer only). No tensor changes with them, but the distributed optimizer's buffers
    are cut into buckets, which Megatron's own ``dp_reshardable`` checkpoints store one by one."""

    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    bucket_size: int | None = None


@dataclass
class GPTJob:
    """A live megatron-core GPT job on this rank."""

    spec: GPTSpec
    layout: ParallelLayout
    model: list[Any]  # DDP-wrapped model chunks: one, or one per virtual pipeline stage (VPP)
    optimizer: Any
    scheduler: Any
    use_distributed_optimizer: bool
    micro_batch_size: int
    global_batch_size: int
    padded_vocab_size: int
    iteration: int = 0
    consumed_samples: int = 0
    ddp: DDPOptions = DDPOptions()
    skipped_iterations: int = 0  # fp16: steps the loss scaler skipped (inf/NaN gradients), as Megatron-LM counts
    trust_pickles: bool = False  # --tenplex-trust-pickles: Transformer Engine's extra state handed over unchecked

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.layout.dp)


def init_distributed(backend: str | None = None) -> None:
    """Initialise torch.distributed from torchrun's environment (gloo on CPU, NCCL on GPU)."""
    if torch.distributed.is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        cpu_shim.install()
    torch.distributed.init_process_group(backend=backend)


#: the megatron-core modules :func:`build_job` imports where it is first called (the model's, its layer specs')
BUILD_MODULES = ("megatron.core.models.gpt", "megatron.core.models.gpt.gpt_layer_specs")


def warm() -> None:
    """The modules :func:`build_job` would import at its first call, imported now: a process that joins a running
    job does it before it registers, so that the job's ranks, stopped for it at an iteration boundary, do not wait
    on its imports (a third of a second and more on a busy machine)."""
    for name in BUILD_MODULES:
        importlib.import_module(name)


def build_job(
    spec: GPTSpec,
    layout: ParallelLayout,
    *,
    use_distributed_optimizer: bool,
    micro_batch_size: int,
    global_batch_size: int,
    padded_vocab: int | None = None,
    ddp: DDPOptions = DDPOptions(),
) -> GPTJob:
    """Initialise megatron-core's parallel state and build model, optimizer and scheduler.

    ``padded_vocab`` overrides Megatron's padding rule (``make_vocab_size_divisible_by x TP``);
    it must be a multiple of TP.
    """
    padded_vocab = check_job(spec, layout, use_distributed_optimizer=use_distributed_optimizer,
                             micro_batch_size=micro_batch_size, global_batch_size=global_batch_size,
                             padded_vocab=padded_vocab, ddp=ddp)
    init_model_parallel(spec, layout)
    config = transformer_config(spec, layout)
    model = build_model(spec, layout, config, padded_vocab, ddp, use_distributed_optimizer=use_distributed_optimizer)
    _check_chunks(model, layout)
    optimizer = build_optimizer(spec, config, model, use_distributed_optimizer=use_distributed_optimizer)
    return GPTJob(
        spec=spec,
        layout=layout,
        model=model,
        optimizer=optimizer,
        scheduler=build_scheduler(spec, optimizer, global_batch_size),
        use_distributed_optimizer=use_distributed_optimizer,
        micro_batch_size=micro_batch_size,
        global_batch_size=global_batch_size,
        padded_vocab_size=padded_vocab,
        ddp=ddp,
    )


def check_job(
    spec: GPTSpec,
    layout: ParallelLayout,
    *,
    use_distributed_optimizer: bool,
    micro_batch_size: int,
    global_batch_size: int,
    padded_vocab: int | None,
    ddp: DDPOptions,
) -> int:
    """The job's own rules before megatron-core's state is touched (a FlagError naming the flag); the padded
    vocabulary (Megatron's rule when ``padded_vocab`` is None)."""
    layout.check_fits(spec.shape(), world_size=torch.distributed.get_world_size())
    if layout.sp and spec.seq_length % layout.tp:
        raise FlagError(f"--sequence-parallel: TP={layout.tp} does not divide --seq-length {spec.seq_length} "
                        "(each TP rank holds a slice of the sequence)")
    num_microbatches(global_batch_size, micro_batch_size, layout.dp)  # raises naming the valid choices
    if spec.num_experts and spec.add_bias_linear and layout.ep == 1 and layout.expert_tp == 1:
        raise FlagError("--num-experts with biases at --expert-model-parallel-size 1 and expert TP 1: megatron-core's "
                        "expert MLP adds its bias in place to the output of a one-rank all-reduce, which autograd "
                        "refuses; give --disable-bias-linear (as MoE recipes do) or EP > 1")
    if ddp.overlap_param_gather and not use_distributed_optimizer:
        raise FlagError("--overlap-param-gather needs --use-distributed-optimizer (it gathers the optimizer's shards)")
    if spec.bf16 and spec.fp16:
        raise FlagError("--bf16 and --fp16 exclude each other")
    if padded_vocab is None:
        padded_vocab = padded_vocab_size(spec.vocab_size, spec.make_vocab_size_divisible_by, layout.tp)
    if padded_vocab % layout.tp or padded_vocab < spec.vocab_size:
        raise FlagError(f"padded vocabulary {padded_vocab} must be >= {spec.vocab_size} and a multiple of "
                        f"TP={layout.tp}")
    return padded_vocab


def _check_chunks(model: list[Any], layout: ParallelLayout) -> None:
    """Each model chunk holds the layers the layout's pipeline split gives it (megatron-core built it from the
    split's flags: ``plan/pipeline_split.megatron_kwargs``)."""
    from megatron.core import parallel_state

    check_chunks(model, layout, parallel_state.get_pipeline_model_parallel_rank())


def init_model_parallel(spec: GPTSpec, layout: ParallelLayout) -> None:
    """Collective: megatron-core's parallel state for ``layout``, built afresh (one process group can run several
    jobs in turn), and its seeded RNGs."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.expert_tp,
    )
    model_parallel_cuda_manual_seed(spec.seed)
    torch.manual_seed(spec.seed)


def params_dtype(spec: GPTSpec) -> torch.dtype:
    """The weights' dtype: bf16, fp16 (fp32 main weights in the optimizer) or fp32."""
    return torch.bfloat16 if spec.bf16 else torch.float16 if spec.fp16 else torch.float32


def transformer_config(spec: GPTSpec, layout: ParallelLayout) -> Any:
    """megatron-core's ``TransformerConfig`` for ``spec`` at ``layout``, with Megatron-LM's defaults and the fused
    kernels a CPU lacks turned off."""
    from megatron.core.transformer import TransformerConfig

    dtype = params_dtype(spec)
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        ffn_hidden_size=spec.ffn_hidden_size,
        hidden_dropout=spec.hidden_dropout,
        attention_dropout=spec.attention_dropout,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        **megatron_kwargs(layout.split, layout.pp, layout.vpp),  # an uneven pipeline: the same chunks
        # Megatron-LM's defaults: interleaving overlaps its p2p transfers, each direction in its own group (batched,
        # PP=2 would post a send of gradients and one of activations to the same peer, matched in posting order)
        overlap_p2p_comm=layout.vpp > 1,
        batch_p2p_comm=layout.vpp == 1,
        deallocate_pipeline_outputs=True,
        sequence_parallel=layout.sp,
        use_cpu_initialization=not torch.cuda.is_available(),
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=spec.bf16,
        fp16=spec.fp16,
        gated_linear_unit=spec.swiglu,
        activation_func=F.silu if spec.swiglu else F.gelu,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        normalization=spec.normalization,
        layernorm_epsilon=spec.norm_epsilon,
        add_bias_linear=spec.add_bias_linear,
        num_query_groups=spec.query_groups,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
        **moe_config(spec),
    )


def build_model(spec: GPTSpec, layout: ParallelLayout, config: Any, padded_vocab: int, ddp: DDPOptions, *,
                use_distributed_optimizer: bool) -> list[Any]:
    """Collective: the DDP-wrapped GPTModel chunks (one per virtual stage, as Megatron-LM's ``get_model``), with
    megatron-core's DP grad reduction and tied-embedding all-reduce hooked into ``config``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    model = []
    for stage, chunk in enumerate(gpt_chunks(spec, layout, config, padded_vocab)):
        if torch.cuda.is_available():
            chunk.cuda(torch.cuda.current_device())
        if spec.bf16 or spec.fp16:
            from megatron.core.transformer.module import Float16Module

            chunk = Float16Module(config, chunk)  # as Megatron-LM does: casts inputs and outputs
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=ddp.overlap_grad_reduce,
            overlap_param_gather=ddp.overlap_param_gather,
            bucket_size=ddp.bucket_size,
            use_distributed_optimizer=use_distributed_optimizer,
        )
        # As Megatron-LM's get_model: bucketing only in the first chunk (the others overlap with compute anyway)
        model.append(DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                             disable_bucketing=stage > 0))
    # As Megatron-LM's training loop does: DP grad reduction and tied-embedding grad all-reduce.
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    return model


def gpt_chunks(spec: GPTSpec, layout: ParallelLayout, config: Any, padded_vocab: int) -> list[Any]:
    """megatron-core's GPTModel, one chunk per virtual pipeline stage of this rank (unwrapped)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec_layers = get_gpt_layer_local_spec(num_experts=spec.num_experts, moe_grouped_gemm=spec.moe_grouped_gemm,
                                           normalization=spec.normalization)
    vpp = layout.vpp if layout.vpp > 1 else None
    return [
        GPTModel(
            config=config,
            # the local (non-Transformer-Engine) spec; RMSNorm is torch.nn.RMSNorm there (WrappedTorchNorm)
            transformer_layer_spec=spec_layers,
            vocab_size=padded_vocab,
            max_sequence_length=spec.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=vpp is None, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=vpp is None, vp_stage=stage),
            share_embeddings_and_output_weights=not spec.untie_embeddings_and_output_weights,
            position_embedding_type=spec.position_embedding_type,
            rotary_percent=spec.rotary_percent,
            rotary_base=spec.rotary_base,
            vp_stage=stage if vpp else None,
        )
        for stage in range(layout.vpp)
    ]


def build_optimizer(spec: GPTSpec, config: Any, model: list[Any], *, use_distributed_optimizer: bool) -> Any:
    """megatron-core's Adam (distributed or not; fp16 with its loss scaler), its loss scale hooked into ``config``."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=spec.lr,
        min_lr=spec.min_lr,
        weight_decay=spec.weight_decay,
        adam_beta1=spec.adam_beta1,
        adam_beta2=spec.adam_beta2,
        clip_grad=spec.clip_grad,
        bf16=spec.bf16,
        fp16=spec.fp16,
        loss_scale=spec.loss_scale,
        initial_loss_scale=spec.initial_loss_scale,
        min_loss_scale=spec.min_loss_scale,
        loss_scale_window=spec.loss_scale_window,
        hysteresis=spec.hysteresis,
        params_dtype=params_dtype(spec),
        use_distributed_optimizer=use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_config, model)
    config.grad_scale_func = optimizer.scale_loss  # as Megatron-LM's train: fp16's loss scale (1 otherwise)
    return optimizer


def build_scheduler(spec: GPTSpec, optimizer: Any, global_batch_size: int) -> Any:
    """megatron-core's LR and weight-decay schedule, counted in samples as Megatron-LM does."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=spec.lr,
        min_lr=spec.min_lr,
        lr_warmup_steps=spec.lr_warmup_iters * global_batch_size,
        lr_decay_steps=spec.train_iters * global_batch_size,
        lr_decay_style=spec.lr_decay_style,
        start_wd=spec.weight_decay,
        end_wd=spec.weight_decay,
        wd_incr_steps=spec.train_iters * global_batch_size,
        wd_incr_style="constant",
    )


def moe_config(spec: GPTSpec) -> dict[str, Any]:
    """megatron-core's ``TransformerConfig`` fields for a mixture-of-experts spec (none for a dense one). The experts
    are megatron-core's ``SequentialMLP``, or with ``moe_grouped_gemm`` its ``GroupedMLP`` (the local spec's grouped
    GEMM, the ``grouped_gemm`` package's ``gmm``; on a CPU the shim's stand-in)."""
    if not spec.num_experts:
        return {}
    return dict(
        num_moe_experts=spec.num_experts,
        moe_ffn_hidden_size=spec.expert_ffn_hidden_size,
        moe_router_topk=spec.moe_router_topk,
        moe_token_dispatcher_type=spec.moe_token_dispatcher_type,
        moe_aux_loss_coeff=spec.moe_aux_loss_coeff,
        moe_router_load_balancing_type=spec.moe_router_load_balancing_type,
        moe_router_score_function=spec.moe_router_score_function,
        moe_router_enable_expert_bias=spec.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=spec.moe_router_bias_update_rate,
        moe_shared_expert_intermediate_size=spec.moe_shared_expert_intermediate_size,
        moe_z_loss_coeff=spec.moe_z_loss_coeff,
        moe_grouped_gemm=spec.moe_grouped_gemm,
    )


def sync_params(job: GPTJob) -> None:
    """Collective: finish the param all-gather that ``--overlap-param-gather`` defers to the next forward, so every
    DP rank's model weights are the stepped ones before a save reads them (Megatron-LM's ``force_param_sync``)."""
    if job.ddp.overlap_param_gather:
        for chunk in job.model:
            chunk.start_param_sync(force_sync=True)


def _batch_to_device(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if torch.cuda.is_available():
        return {k: v.cuda(non_blocking=True) for k, v in batch.items()}
    return batch


def make_forward_step() -> Callable[..., Any]:
    """megatron-core forward-step function: GPT forward plus a masked mean LM loss."""

    def loss_func(loss_mask: torch.Tensor, output: torch.Tensor):
        losses = output.float().view(-1)
        mask = loss_mask.view(-1).float()
        loss = torch.sum(losses * mask) / mask.sum()
        return loss, {"lm loss": loss.detach().clone()}

    def forward_step(data_iterator: Iterator[dict[str, torch.Tensor]], model: Any):
        batch = _batch_to_device(next(data_iterator))
        output = model(
            batch["tokens"], batch["position_ids"], None, labels=batch["labels"]
        )
        return output, lambda out: loss_func(batch["loss_mask"], out)

    return forward_step


def forward_backward(job: GPTJob, data_iterator: Iterator[dict[str, torch.Tensor]]) -> list[dict[str, Any]]:
    """Forward and backward over one global batch (gradients reduced over DP), no optimizer step: the losses."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in job.model:
        chunk.zero_grad_buffer()
    job.optimizer.zero_grad()
    fwd_bwd = get_forward_backward_func()
    if len(job.model) > 1:  # the interleaved schedule reads each model chunk's micro-batches from its own iterator
        batches = list(data_iterator)
        data_iterator = [iter(batches) for _ in job.model]  # type: ignore[assignment]
    return fwd_bwd(
        forward_step_func=make_forward_step(),
        data_iterator=data_iterator,
        model=job.model,
        num_microbatches=job.num_microbatches,
        seq_length=job.spec.seq_length,
        micro_batch_size=job.micro_batch_size,
        forward_only=False,
    )


def train_step(job: GPTJob, data_iterator: Iterator[dict[str, torch.Tensor]]) -> float:
    """One optimizer step over one global batch; returns the global-batch mean LM loss.

    A step the fp16 loss scaler skips (inf or NaN gradients) still counts as an iteration and consumes its
    samples, but the LR schedule does not advance: Megatron-LM's ``train_step``."""
    losses = forward_backward(job, data_iterator)
    update_successful, _grad_norm, _ = job.optimizer.step()
    if update_successful:
        job.scheduler.step(increment=job.global_batch_size)
    elif not job.spec.fp16:
        raise SkippedStepError(f"optimizer step {job.iteration + 1} was skipped")
    else:
        job.skipped_iterations += 1
    job.iteration += 1
    job.consumed_samples += job.global_batch_size
    return mean_lm_loss(losses)


def mean_lm_loss(losses: list[dict[str, Any]]) -> float:
    """Collective: mean over micro-batches on the last stage, then over DP; broadcast over PP."""
    from megatron.core import parallel_state

    device = "cuda" if torch.cuda.is_available() else "cpu"
    value = torch.zeros(1, dtype=torch.float64, device=device)
    if parallel_state.is_pipeline_last_stage():
        value[0] = sum(float(x["lm loss"]) for x in losses) / len(losses)
        torch.distributed.all_reduce(value, group=parallel_state.get_data_parallel_group())
        value /= parallel_state.get_data_parallel_world_size()
    torch.distributed.all_reduce(value, group=parallel_state.get_pipeline_model_parallel_group())
    return float(value[0])
