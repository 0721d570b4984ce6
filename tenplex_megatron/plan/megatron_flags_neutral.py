"""The flags of Megatron-LM's ``pretrain_gpt.py`` that ``--tenplex`` leaves alone, in groups that share a why, and
the few prefix rules (whole families that belong to other scripts or to debugging).

Neutral: a layout change leaves the flag's meaning alone and the plugin has no stake in it, or it only matters
together with a flag ``--tenplex`` refuses. Every destination is listed by name; a rule covers only the families
below, each with why, so a new flag of another kind is caught by ``tests/unit/test_megatron_flags.py``.
``plan/megatron_flags.py`` reads these groups beside the honoured and refused ones. Pure data.
"""

from __future__ import annotations

from dataclasses import dataclass

NEUTRAL = "neutral"


@dataclass(frozen=True)
class Group:
    """Destinations that share a verdict and why."""

    verdict: str
    why: str
    dests: tuple[str, ...]


@dataclass(frozen=True)
class Rule:
    """Every destination starting with ``prefix`` not listed in a table: one verdict and why for the family."""

    prefix: str
    verdict: str
    why: str


RULES: tuple[Rule, ...] = (
    Rule("inference_", NEUTRAL, "Megatron-LM's inference engine and servers (static and dynamic batching, KV cache, "
         "decode kernels): pretrain_gpt.py's training loop does not run them"),
    Rule("rl_", NEUTRAL, "reinforcement learning (train_rl.py, --perform-rl-step, which --tenplex refuses)"),
    Rule("grpo_", NEUTRAL, "GRPO, reinforcement learning (--perform-rl-step, which --tenplex refuses)"),
    Rule("langrl_", NEUTRAL, "reinforcement learning environments (--perform-rl-step, which --tenplex refuses)"),
    Rule("fault_injector_", NEUTRAL, "Megatron-LM's fault injector for resilience tests: it kills or stalls ranks; "
         "the restart that follows goes through tenplex like any"),
    Rule("flight_recorder_", NEUTRAL, "NCCL's flight recorder: debugging dumps"),
    Rule("dino_", NEUTRAL, "DINO vision pretraining (pretrain_vision_dino.py)"),
    Rule("retro_", NEUTRAL, "Retro (pretrain_retro.py; core_v0.15)"),
    Rule("export_", NEUTRAL, "ModelOpt's export and distillation settings (added where nvidia-modelopt imports): only "
         "with --modelopt-enabled, which --tenplex refuses"),
)

_SHAPE = ("the model's shape: megatron-core's sharded_state_dict describes each tensor it makes (global shape, TP, PP "
          "and EP offsets), which tenplex re-shards whatever the shape (the re-shard matrix runs GPT- and Llama-style "
          "models); a checkpoint of another shape is refused naming the tensor (plan/planner.py)")

NEUTRAL_GROUPS: tuple[Group, ...] = (
    Group(NEUTRAL, "argparse's help", ("help",)),
    Group(NEUTRAL, "deprecated: Megatron-LM ignores it, or refuses it itself naming its successor", (
        "deprecated_use_mcore_models", "model_parallel_size", "batch_size", "async_tensor_model_parallel_allreduce",
        "fp8_interval", "moe_extended_tp", "disable_msc_deprecated")),
    Group(NEUTRAL, "reinforcement learning (--perform-rl-step, which --tenplex refuses)", ("refit_method",)),
    Group(NEUTRAL, _SHAPE, (
        "num_layers", "encoder_num_layers", "decoder_num_layers", "hidden_size", "ffn_hidden_size",
        "num_attention_heads", "kv_channels", "group_query_attention", "num_query_groups", "softmax_type",
        "window_size", "window_attn_skip_freq", "max_position_embeddings", "position_embedding_type",
        "relative_attention_num_buckets", "relative_attention_max_distance", "use_rotary_position_embeddings",
        "rotary_base", "rotary_percent", "rotary_interleaved", "rotary_seq_len_interpolation_factor", "rope_type",
        "use_rope_scaling", "rope_scaling_factor", "no_rope_freq", "add_position_embedding", "mrope_section",
        "yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow",
        "yarn_correction_range_round_to_int", "normalization", "norm_epsilon", "layernorm_epsilon",
        "apply_layernorm_1p", "layernorm_zero_centered_gamma", "apply_residual_connection_post_layernorm",
        "openai_gelu", "squared_relu", "swiglu", "quick_geglu", "activation_func_clamp_value", "glu_linear_offset",
        "onnx_safe", "bert_binary_head", "add_bias_linear", "add_qkv_bias", "qk_layernorm", "qk_l2_norm",
        "attention_output_gate", "fp32_residual_connection", "apply_query_key_layer_scaling",
        "attention_softmax_in_fp32", "fp16_lm_cross_entropy", "use_te_activation_func", "moe_shared_expert_gate",
        "spec", "enable_experimental", "use_mup", "mup_width_mult", "mup_base_hidden_size", "mup_embedding_mult",
        "mup_output_mult", "mup_base_head_dim", "mup_attn_scale_power", "seq_length", "encoder_seq_length",
        "decoder_seq_length", "enable_gpt_oss")),
    Group(NEUTRAL, "training hyper-parameters (dropout, learning rate and its schedule, weight decay, clipping, Adam's "
          "betas): a layout change leaves them alone; the schedule's state comes back through Megatron-LM's own "
          "scheduler, which applies --override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler", (
              "attention_dropout", "hidden_dropout", "weight_decay", "start_weight_decay", "end_weight_decay",
              "weight_decay_incr_style", "clip_grad", "adam_beta1", "adam_beta2", "adam_eps",
              "apply_wd_to_qk_layernorm", "no_weight_decay_cond_type", "lr", "lr_decay_style", "lr_wsd_decay_style",
              "lr_decay_iters", "lr_decay_samples", "lr_wsd_decay_samples", "lr_wsd_decay_iters",
              "lr_warmup_fraction", "lr_warmup_iters", "lr_warmup_samples", "lr_warmup_init", "warmup", "min_lr",
              "override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler", "decoupled_lr",
              "decoupled_min_lr", "head_lr_mult", "freeze_all_layers", "calculate_per_token_loss",
              "init_method_std", "embedding_init_method_std", "init_method_xavier_uniform",
              "data_parallel_random_init", "use_cpu_initialization")),
    Group(NEUTRAL, "only with an optimizer other than Adam (--optimizer sgd, muon, lion), which --tenplex refuses", (
        "sgd_momentum", "muon_momentum", "muon_split_qkv", "muon_use_nesterov", "muon_nesterov", "muon_scale_mode",
        "muon_fp32_matmul_prec", "muon_num_ns_steps", "muon_tp_mode", "muon_extra_scale_factor",
        "muon_coefficient_type", "muon_scalar_optimizer", "lion_beta1", "lion_beta2", "use_layer_wise_param_layout")),
    Group(NEUTRAL, "only with --optimizer-cpu-offload, which --tenplex refuses", (
        "optimizer_offload_fraction", "use_torch_optimizer_for_cpu_offload", "overlap_cpu_optimizer_d2h_h2d",
        "pin_cpu_grads", "pin_cpu_params")),
    Group(NEUTRAL, "only with multi-latent attention, multi-token prediction or an experimental attention variant, "
          "which --tenplex refuses", (
              "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
              "rotary_scaling_factor", "mscale", "mscale_all_dim", "cache_mla_latents", "mla_down_proj_fusion",
              "qk_clip", "qk_clip_alpha", "qk_clip_threshold", "mtp_loss_scaling_factor", "mtp_standalone",
              "mtp_use_repeated_layer", "mtp_hybrid_override_pattern", "mtp_detach_heads", "linear_attention_freq",
              "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
              "linear_num_value_heads", "dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk",
              "dsa_indexer_loss_coeff", "dsa_indexer_use_sparse_loss", "dsa_indexer_topk_freq",
              "dsa_indexer_skip_topk_offset", "dsa_kernel_backend", "dsa_indexer_rope_interleaved",
              "dsa_indexer_rotate_activation", "dsa_indexer_scoring_relu", "dsa_indexer_k_norm_epsilon",
              "dsa_indexer_k_norm_fp32")),
    Group(NEUTRAL, "only with context parallelism, Megatron FSDP, torch FSDP2 or FP8/FP4 parameters, which --tenplex "
          "refuses", (
              "cp_comm_type", "hierarchical_context_parallel_sizes", "hybrid_context_parallel",
              "max_seqlen_per_dp_cp_rank", "init_model_with_meta_device", "data_parallel_sharding_strategy",
              "outer_dp_sharding_strategy", "fsdp_double_buffer", "fsdp_manual_registration",
              "suggested_communication_unit_size", "keep_fp8_transpose_cache", "enable_full_sharding_in_hsdp",
              "torch_fsdp2_reshard_after_forward", "megatron_fsdp_main_params_dtype", "megatron_fsdp_main_grads_dtype",
              "megatron_fsdp_grad_comm_dtype", "megatron_fsdp_enable_fine_grained_param_gather",
              "megatron_fsdp_max_pool_double_buffer", "fsdp_db_use_persist_buf_on_alloc_fail",
              "reuse_grad_buf_for_mxfp8_param_ag", "moe_single_grouped_weight", "moe_single_grouped_bias")),
    Group(NEUTRAL, "mixture-of-experts routing and dispatch settings that keep no state: a layout change leaves their "
          "meaning alone (token dropping by capacity is per rank, as without --tenplex)", (
              "moe_router_dtype", "moe_router_fusion", "moe_router_pre_softmax", "moe_router_num_groups",
              "moe_router_group_topk", "moe_router_topk_scaling_factor", "moe_router_force_load_balancing",
              "moe_router_force_biased", "moe_router_padding_for_fp8", "moe_router_padding_for_quantization",
              "moe_router_quantile_balancing_ema", "moe_z_loss_coeff", "moe_input_jitter_eps",
              "moe_expert_capacity_factor", "moe_expert_rank_capacity_factor", "moe_pad_expert_input_to_capacity",
              "moe_token_drop_policy", "moe_apply_probs_on_input", "moe_enable_routing_replay",
              "moe_shared_expert_overlap", "moe_upcycling_granularity",
              "moe_pad_experts_for_cuda_graph_inference", "moe_enable_deepep", "moe_deepep_num_sms",
              "moe_flex_dispatcher_backend", "moe_flex_dispatcher_num_sms", "moe_hybridep_num_sms",
              "moe_hybridep_num_sms_preprocessing", "moe_hybridep_num_blocks_permute",
              "moe_hybridep_num_blocks_unpermute", "moe_hybridep_pad_uneven_dispatch_inputs",
              "moe_permute_fusion", "moe_permute_fusion_into_hybridep", "moe_ncclep_static_shape",
              "moe_ncclep_zero_copy")),
    Group(NEUTRAL, "kernels, fusions and numerics of the same model (attention backends, fused biases, softmax and "
          "cross entropy, determinism): the tensors and their sharding stay the same", (
              "masked_softmax_fusion", "bias_gelu_fusion", "bias_swiglu_fusion", "use_fused_weighted_squared_relu",
              "bias_dropout_fusion", "apply_rope_fusion", "cross_entropy_loss_fusion", "cross_entropy_fusion_impl",
              "use_flash_attn", "attention_backend", "flash_attention_version", "no_persist_layer_norm",
              "gradient_accumulation_fusion", "disable_jit_fuser", "batch_invariant_mode", "deterministic_mode",
              "disable_bf16_reduced_precision_matmul", "fused_residual_rmsnorm", "use_transformer_engine_op_fuser",
              "use_kitchen_attention", "kitchen_attention_backend", "flash_decode",
              "symmetric_ar_type", "nccl_all_reduce_for_prefill", "mlp_chunks_for_prefill", "mlp_chunks_for_training",
              "max_tokens_to_oom", "output_bert_embeddings", "bert_embedder_type", "use_legacy_static_engine",
              "enable_chunked_prefill", "disable_chunked_prefill", "num_speculative_tokens",
              "offset_sampling_seed_by_dp_rank")),
    Group(NEUTRAL, "communication: backends, overlap, bucketing and reduction of gradients and activations; the "
          "distributed optimizer's ranges follow megatron-core's buckets, described per parameter whatever their "
          "number (shown with --ddp-bucket-size), and Megatron-LM finishes any param all-gather before it saves", (
              "tp_comm_overlap", "tp_comm_overlap_cfg", "tp_comm_overlap_ag", "tp_comm_overlap_rs",
              "tp_comm_overlap_rs_dgrad", "tp_comm_bulk_dgrad", "tp_comm_bulk_wgrad", "tp_comm_bootstrap_backend",
              "tp_comm_split_ag", "tp_comm_split_rs",
              "pipeline_model_parallel_comm_backend", "high_priority_stream_groups", "high_priority_a2a_comm_stream",
              "microbatch_group_size_per_vp_stage", "overlap_p2p_comm", "overlap_p2p_comm_warmup_flush",
              "scatter_gather_tensors_in_pipeline", "use_ring_exchange_p2p", "defer_embedding_wgrad_compute",
              "wgrad_deferral_limit", "align_grad_reduce", "align_param_gather", "ddp_num_buckets",
              "ddp_pad_buckets_for_high_nccl_busbw", "ddp_average_in_collective",
              "ddp_reduce_scatter_with_fp32_accumulation", "ddp_param_name_patterns_for_fp32_local_accumulation",
              "overlap_param_gather_with_optimizer_step", "gradient_reduce_div_fusion",
              "accumulate_allreduce_grads_in_fp32",
              "grad_reduce_in_bf16", "nccl_ub", "disable_symmetric_registration", "use_sharp", "sharp_enabled_group",
              "nccl_communicator_config_path", "create_all_gather_group", "overlap_moe_expert_parallel_comm",
              "delay_wgrad_compute", "ep_overlap_early_attn_memory_release",
              "overlap_dispatch_backward_with_experts_wgrad", "distributed_backend", "distributed_timeout_minutes",
              "distributed_timeout_seconds_after_init", "local_rank", "lazy_mpu_init", "use_gloo_process_groups",
              "enable_gloo_process_groups")),
    Group(NEUTRAL, "activation memory: recomputation, offloading, CUDA graphs, garbage collection and caches; no "
          "state a checkpoint holds", (
              "recompute_activations", "recompute_granularity", "recompute_method", "recompute_num_layers",
              "recompute_modules", "distribute_saved_activations", "checkpoint_activations", "moe_layer_recompute",
              "clone_scatter_output_in_embedding", "cpu_offloading_num_layers",
              "cpu_offloading_retain_pinned_cpu_buffers",
              "fine_grained_activation_offloading", "offload_modules", "min_offloaded_tensor_size",
              "fine_grained_offloading_max_inflight_offloads", "delay_offload_until_cuda_graph",
              "delta_offload_bytes_across_pp_ranks", "activation_offload_fraction", "moe_paged_stash",
              "moe_paged_stash_page_size", "moe_paged_stash_buffer_size_factor_cuda",
              "moe_paged_stash_buffer_size_factor_cpu", "empty_unused_memory_level", "manual_gc", "manual_gc_interval",
              "manual_gc_eval", "enable_cuda_graph", "external_cuda_graph", "cuda_graph_impl",
              "cuda_graph_warmup_steps",
              "cuda_graph_scope", "cuda_graph_scope_deprecated", "cuda_graph_modules", "decode_only_cuda_graphs",
              "optimizer_cuda_graph", "train_sync_interval", "te_rng_tracker")),
    Group(NEUTRAL, "logging, metrics, profiling and straggler detection", (
        "log_interval", "log_params_norm", "log_num_zeros_in_grad", "log_throughput", "log_progress", "log_energy",
        "log_timers_to_tensorboard", "log_loss_scale_to_tensorboard", "log_validation_ppl_to_tensorboard",
        "log_memory_to_tensorboard", "log_world_size_to_tensorboard", "log_memory_interval", "log_device_memory_used",
        "log_max_attention_logit", "log_straggler", "timing_log_level", "timing_log_option", "barrier_with_L1_time",
        "tensorboard_dir", "tensorboard_log_interval", "tensorboard_queue_size", "wandb_project", "wandb_entity",
        "wandb_exp_name", "wandb_save_dir", "logging_level", "disable_straggler_on_startup", "straggler_ctrlr_port",
        "straggler_minmax_count", "run_workload_inspector_server", "enable_one_logger", "one_logger_project",
        "one_logger_run_name", "one_logger_async", "app_tag_run_name", "app_tag_run_version", "config_logger_dir",
        "moe_per_layer_logging", "moe_routing_trace_path", "moe_routing_trace_max_training_iters",
        "moe_routing_trace_capture_logits", "moe_routing_trace_capture_hidden_states", "moe_routing_trace_dump_weights",
        "profile", "profile_step_start", "profile_step_end", "use_pytorch_profiler", "profile_ranks",
        "record_memory_history", "memory_snapshot_path", "pytorch_profiler_collect_shapes",
        "pytorch_profiler_collect_callstack", "pytorch_profiler_collect_chakra", "record_shapes", "nvtx_ranges",
        "gpu_sniff_test_interval", "check_weight_hash_across_dp_replicas_interval", "dump_param_to_param_group_map",
        "logits_save_dir", "logits_save_top_k", "logits_save_top_p", "logits_save_top_p_min_k", "logits_save_dtype")),
    Group(NEUTRAL, "Megatron-LM's re-run engine and its checks (NaN, spiky loss, large gradients): the running job "
          "validates its results; a step awaiting a re-run on another GPU is state Megatron-LM keeps in its own "
          "checkpoint format only, so a tenplex restart goes on without that re-run", (
              "rerun_mode", "error_injection_rate", "error_injection_type", "check_for_nan_in_loss_and_grad",
              "check_for_spiky_loss", "check_for_large_grads", "result_rejected_tracker_filename",
              "iterations_to_skip")),
    Group(NEUTRAL, "how long to train and when to stop, evaluate or exit (the exits save through the hook's "
          "save_checkpoint); NVIDIA's fault-tolerance and autoresume services; the in-process restart's timeouts", (
              "train_iters", "train_samples", "exit_interval", "exit_duration_in_mins", "exit_signal", "exit_signal_handler_for_dataloader", "exit_signal_handler_for_training",
              "eval_iters", "eval_interval", "start_eval_at_iter", "test_mode", "skip_train",
              "multiple_validation_sets", "validation_set_names", "adlr_autoresume", "adlr_autoresume_interval",
              "enable_ft_package", "calc_ft_timeouts", "ft_num_warmup_iters", "inprocess_max_iterations",
              "inprocess_monitor_thread_interval", "inprocess_monitor_process_interval",
              "inprocess_progress_watchdog_interval", "inprocess_heartbeat_interval", "inprocess_soft_timeout",
              "inprocess_hard_timeout", "inprocess_heartbeat_timeout", "inprocess_barrier_timeout",
              "inprocess_completion_timeout", "inprocess_last_call_wait", "inprocess_termination_grace_time",
              "inprocess_granularity", "inprocess_empty_cuda_cache", "yaml_cfg")),
    Group(NEUTRAL, "the datasets: what each sample holds and where it is read from; tenplex's sampler decides which "
          "samples each global batch holds, whatever the dataset", (
              "data_path", "split", "train_data_path", "valid_data_path", "test_data_path", "data_args_path",
              "per_split_data_args_path", "data_cache_path", "mmap_bin_files", "mock_data", "sample_rate",
              "mask_prob", "short_seq_prob", "reset_position_ids", "reset_attention_mask",
              "eod_mask_loss", "create_attention_mask_in_dataloader", "num_dataset_builder_threads",
              "object_storage_cache_path", "mid_level_dataset_surplus", "per_dataset_sequences_path",
              "dataloader_fast_cache_load", "dataloader_defer_npy_index_mmap", "dataloader_inter_document_masking",
              "allow_ambiguous_pad_tokens", "fim_data", "fim_rate", "fim_spm_rate", "fim_split_sample",
              "fim_fragment_rate", "fim_no_prefix", "fim_prefix_token", "fim_middle_token", "fim_suffix_token",
              "fim_pad_token", "fim_eod_token", "sft", "sft_tokenizer_prompt_format")),
    Group(NEUTRAL, "the Multi-Storage Client: object-store paths for Megatron-LM's data (and its own checkpoints); "
          "tenplex's --save and --load are POSIX paths (docs/support.md: object stores are not supported)",
          ("enable_msc",)),
    Group(NEUTRAL, "only with --logits-load-dir, which --tenplex refuses", (
        "logits_load_decode_threads", "logits_load_prefetch_factor", "logits_load_msc_prefetch_depth",
        "logits_load_kd_loss_alpha", "logits_load_ignore_errors")),
    Group(NEUTRAL, "the tokenizer (Megatron-LM's own under pretrain_gpt.py) and a padded vocabulary given as is: "
          "a checkpoint of another padded size loads with the real rows moved (plan/planner.py)", (
              "padded_vocab_size", "pad_vocab_size", "vocab_file", "merge_file", "vocab_extra_ids",
              "tokenizer_type", "tokenizer_model", "tokenizer_metadata", "metadata_path", "tiktoken_pattern",
              "tiktoken_num_special_tokens", "tiktoken_special_tokens", "tokenizer_special_tokens", "special_tokens",
              "legacy_tokenizer", "trust_remote_code", "tokenizer_sentencepiece_legacy",
              "tokenizer_sentencepiece_ignore_extra_whitespaces", "tokenizer_hf_use_fast",
              "tokenizer_hf_include_special_tokens", "tokenizer_hf_no_use_fast",
              "tokenizer_hf_no_include_special_tokens", "null_tokenizer_eod_id", "null_tokenizer_pad_id",
              "chat_template")),
    Group(NEUTRAL, "other models' scripts (BERT's ICT and biencoder, vision, Mamba and hybrid models): "
          "pretrain_gpt.py builds a GPTModel", (
              "ict_head_size", "biencoder_projection_dim", "biencoder_shared_query_context_model", "ict_load",
              "bert_load", "titles_data_path", "query_in_block_prob", "use_one_sent_docs", "evidence_data_path",
              "retriever_report_topk_accuracies", "retriever_score_scaling", "retriever_seq_length",
              "block_data_path", "embedding_path", "indexer_batch_size", "indexer_log_interval", "num_classes",
              "img_h", "img_w", "num_channels", "patch_dim", "classes_fraction", "data_per_class_fraction",
              "data_sharding", "vision_pretraining", "vision_pretraining_type", "vision_backbone_type",
              "swin_backbone_type", "mask_type", "mask_factor", "iter_per_epoch", "hybrid_attention_ratio",
              "hybrid_mlp_ratio", "hybrid_override_pattern", "hybrid_layer_pattern", "is_hybrid_model",
              "mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads", "disable_mamba_mem_eff_path",
              "use_mamba_mem_eff_path", "mamba_inference_conv_states_dtype", "mamba_inference_ssm_states_dtype",
              "mamba_training_ssm_states_dtype")),
    Group(NEUTRAL, "ModelOpt's settings (added where nvidia-modelopt imports): only with --modelopt-enabled, which "
          "--tenplex refuses", (
              "finetune_data_split", "finetune_hf_dataset", "teacher_model_config", "freeze_base_for_mtp",
              "qad_train_target")),
)
