"""Configuration: YAML and dotted command-line overrides -> frozen dataclasses, validated before any work.

    schema.py     the top-level sections (`data`, `algorithm`, `trainer`) and the root `Config`
    workers.py    the `worker.*` sections (actor, rollout, ref, reward)
    checks.py     `ConfigError`, the value-rule helpers and the checks of files, hub ids and reward files
    loader.py     `load_config`: YAML (strict: repeated keys refused), overrides, types, unknown keys
    validate.py   `validate(cfg, world_size)`: every section's rules, then the rules across sections
    versions.py   the stack versions this code is written for, enforced at start-up

Everything here is plain Python: no process group, model or engine is needed to load and check a config.

The names below are imported on first use, so importing one module of the package stays light.
"""

from spmd_grpo import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "checks": (
            "ConfigError",
            "require",
            "require_positive",
            "require_at_least",
            "require_off_or_positive",
            "require_nonempty",
            "require_top_k",
            "BUILTIN_REWARDS",
            "BUILTIN_DATASETS",
            "HUB_ID",
            "check_model_path",
            "check_tokenizer_dir",
            "check_hub_reachable",
            "TOKENIZER_FILES",
            "OutOfRange",
            "C_INT_MIN",
            "C_INT_MAX",
            "FLOAT32_MAX",
            "MAX_SECONDS",
            "require_seconds",
            "check_data_source",
            "count_rows",
            "check_reward_file",
        ),
        "loader": (
            "load_config",
            "last_wins",
            "to_dict",
            "dump_yaml",
        ),
        "schema": (
            "DataConfig",
            "FilterGroupsConfig",
            "OverlongBufferConfig",
            "RolloutCorrectionConfig",
            "AlgorithmConfig",
            "LoggerName",
            "LOGGER_PACKAGES",
            "TrainerConfig",
            "Config",
        ),
        "validate": (
            "env_world_size",
            "validate",
            "BUILTIN_REWARD_KEYS",
        ),
        "versions": (
            "SUPPORTED",
            "VLLM_DISTRIBUTIONS",
            "VersionError",
            "installed_versions",
            "check_versions",
            "version_line",
        ),
        "workers": (
            "LORA_ALL_LINEAR",
            "LoRAConfig",
            "ModelConfig",
            "OptimConfig",
            "FSDPConfig",
            "ActorConfig",
            "ValOverrideConfig",
            "RolloutConfig",
            "RefConfig",
            "RewardConfig",
            "WorkerConfig",
        ),
    },
)
