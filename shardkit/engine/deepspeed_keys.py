"""The DeepSpeed config keys shardkit reads without acting on them: tables, data only.

:data:`IGNORED_KEYS` are accepted whatever their value (logging, profiling, I/O tuning, or choices
shardkit makes itself); :data:`UNSUPPORTED_KEYS` name features shardkit does not implement and are
accepted only at DeepSpeed's default. :func:`~shardkit.engine.config_reader.load_config` consults both,
section by section (``""`` is the top level). They are long lists that change whenever DeepSpeed
adds keys, while the parsing logic does not, so they live apart from it; docs/engine.md's key
table says what each one means here. :data:`IGNORED_REASONS` says why the sections accepted only
while disabled have no effect (printed with the ignored keys); :data:`DATA_EFFICIENCY_SWITCHES`,
:data:`TORCH_AUTOCAST_DTYPES` and :data:`ONE_BIT_OPTIMIZERS` are DeepSpeed's names the reader
checks those sections against.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "DATA_EFFICIENCY_SWITCHES",
    "IGNORED_KEYS",
    "IGNORED_REASONS",
    "ONE_BIT_OPTIMIZERS",
    "TORCH_AUTOCAST_DTYPES",
    "UNSUPPORTED_KEYS",
]

#: DeepSpeed keys accepted without effect here (logging, profiling, I/O tuning, or choices shardkit
#: makes itself); each one present is reported in ``EngineConfig.ignored``.
IGNORED_KEYS: dict[str, tuple[str, ...]] = {
    "": (
        "steps_per_print",
        "wall_clock_breakdown",
        "dump_state",
        "memory_breakdown",
        "tensorboard",
        "wandb",
        "csv_monitor",
        "comet",
        "flops_profiler",
        "comms_logger",
        "activation_checkpointing",
        "aio",
        "checkpoint",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        "prescale_gradients",
        "gradient_predivide_factor",
        "communication_data_type",
        "timers",
        "autotuning",
        "disable_allgather",
    ),  # fmt: skip
    "zero_optimization": (
        "reduce_scatter",
        "allgather_partitions",
        "use_multi_rank_bucket_allreduce",
        "load_from_fp32_weights",
        "elastic_checkpoint",
        "ignore_unused_parameters",
        "legacy_stage1",
        "round_robin_gradients",
        "memory_efficient_linear",
        "log_trace_cache_warnings",
        "compute_grad_norm",
        "parameter_alignment",
        "pipeline_loading_checkpoint",
        "override_module_apply",
        "enable_sanity_checks",
        "leaf_module",
        "save_muon_momentum_buffer_in_memory",
        "model_persistence_threshold",
        "stage3_model_persistence_threshold",
        "module_granularity_threshold",
        "stage3_module_granularity_threshold",
        "use_all_reduce_for_fetch_params",
        "stage3_use_all_reduce_for_fetch_params",
        "allgather_sequential",
        "stage3_allgather_sequential",
    ),  # fmt: skip
    "offload": ("fast_init", "pipeline_read", "pipeline_write", "buffer_size", "max_in_cpu", "cpuadam_cores_perc"),
    "bf16": ("immediate_grad_update", "check_grad_overflow"),
    "adam": ("fp32_optimizer_states", "foreach", "fused"),
    # DeepSpeed's HybridEngineConfig fields (it forbids others): read only with enabled false
    "hybrid_engine": (
        "max_out_tokens",
        "inference_tp_size",
        "release_inference_cache",
        "pin_parameters",
        "tp_gather_partition_size",
        "enable_cuda_graph",
    ),
}

#: DeepSpeed keys shardkit does not implement: accepted (and reported as ignored) only at
#: DeepSpeed's default, a ValueError otherwise.
UNSUPPORTED_KEYS: dict[str, dict[str, Any]] = {
    "": {"sparse_gradients": False},
    "zero_optimization": {
        "zero_quantized_weights": False,
        "zero_quantized_nontrainable_weights": False,
        "zero_quantized_gradients": False,
        "mics_shard_size": -1,
        "mics_hierarchical_params_gather": False,
        "cpu_offload": False,
        "cpu_offload_param": False,
        "cpu_offload_use_pin_memory": False,
    },  # fmt: skip
    "offload_optimizer": {"ratio": 1.0, "super_offload": False},
    "fp16": {"auto_cast": False, "fp16_master_weights_and_grads": False},
    "bf16": {"bf16_master_weights_and_grads": False, "bf16_optimizer_states": False},
    "lamb": {"eps_inside_sqrt": False, "max_grad_norm": 0.0},
}

#: why a section accepted without effect has none (shown next to its name where ignored keys are
#: reported: the log line of ``load_config`` and ``shardkit config check``)
IGNORED_REASONS: dict[str, str] = {
    "hybrid_engine": "disabled; the RLHF generation engine is not offered",
    "data_efficiency": "disabled; curriculum learning, dynamic batching and random-LTD are not offered",
    "torch_autocast": "disabled",
    "torch_autocast.lower_precision_safe_modules": (
        "DeepSpeed's ZeRO reduces those modules' gradients in the autocast dtype; shardkit reduces them in fp32"
    ),
}

#: ``data_efficiency``'s on-switches (dotted below ``data_efficiency``): DeepSpeed acts on each
#: one by itself (its engine reads ``curriculum_learning.enabled`` and ``random_ltd.enabled``
#: whatever their parents say), so the section is accepted only with every one of them false
DATA_EFFICIENCY_SWITCHES: tuple[str, ...] = (
    "enabled",
    "data_sampling.enabled",
    "data_sampling.curriculum_learning.enabled",
    "data_sampling.dynamic_batching.enabled",
    "data_routing.enabled",
    "data_routing.random_ltd.enabled",
)

#: ``torch_autocast.dtype`` spellings, as DeepSpeed's ``DtypeEnum`` accepts them
TORCH_AUTOCAST_DTYPES: dict[str, tuple[str, ...]] = {
    "fp16": ("torch.float16", "fp16", "float16", "half"),
    "fp32": ("torch.float32", "fp32", "float32", "float"),
    "int8": ("torch.int8", "int8"),
    "bf16": ("torch.bfloat16", "bf16", "bfloat16"),
}

#: DeepSpeed's 1-bit optimizers: lower-case type -> (the uncompressed type whose update their
#: warm-up phase runs, the params only the compression reads, how the numbers differ or "").
#: DeepSpeed 0.19.8 no longer ships them.
ONE_BIT_OPTIMIZERS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "onebitadam": (
        "Adam",
        ("freeze_step", "cuda_aware", "comm_backend_name"),
        "1-bit Adam's warm-up has no bias correction and makes no update at its first step",
    ),
    "zerooneadam": (
        "Adam",
        ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper", "cuda_aware", "comm_backend_name"),
        "",
    ),
    "onebitlamb": (
        "Lamb",
        ("freeze_step", "cuda_aware", "comm_backend_name", "coeff_beta", "factor_max", "factor_min", "factor_threshold"),
        "",
    ),
}
