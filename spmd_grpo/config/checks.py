"""`ConfigError` and the checks the config sections share: value-rule helpers (`require_*`, each naming the
dotted key), and checks of what a value points to before anything is loaded: a local model directory or a
hub id, a data source (file, directory, `builtin:` task or hub data set) and its row count, a reward file.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration problem the user can fix; the message is one line naming the key."""


class OutOfRange(ConfigError):
    """A value of the right type that no setting may take (NaN, a number beyond what its destination holds)."""


# Where numbers go decides how large they may be. Every integer key is a C int (vLLM's and torch's sizes and
# token counts; seeds: numpy takes < 2**32 and the engine adds the rank to trainer.seed); every float key
# meets float32 tensors. Durations in seconds stop at 2**31 - 1 too: `datetime.timedelta` (the process
# group's timeout; gloo keeps it as int64 milliseconds) and `time.sleep` (int64 nanoseconds: ~292 years)
# both take that, and 10**20 s raised OverflowError only when the process group was built.
C_INT_MIN = -(2**31)
C_INT_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38
MAX_SECONDS = C_INT_MAX


# ------------------------------------------------------------------------------------------ section rules
def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def require_positive(section: Any, prefix: str, *names: str) -> None:
    """`<prefix><name> must be positive` for the first of the section's fields `names` that is not > 0."""
    for name in names:
        value = getattr(section, name)
        require(value > 0, f"{prefix}{name} must be positive, got {value}")


def require_at_least(section: Any, prefix: str, minimum: float, *names: str) -> None:
    """`<prefix><name> must be >= minimum` for the first of the section's fields `names` below it."""
    for name in names:
        value = getattr(section, name)
        require(value >= minimum, f"{prefix}{name} must be >= {minimum}, got {value}")


def require_off_or_positive(section: Any, prefix: str, *names: str) -> None:
    """Fields where -1 means "off / all" and any other value must be >= 1 (0 and -5 are mistakes)."""
    for name in names:
        value = getattr(section, name)
        require(value == -1 or value >= 1, f"{prefix}{name} must be -1 (off) or >= 1, got {value}")


def require_nonempty(section: Any, prefix: str, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        require(bool(value and value.strip()), f"{prefix}{name} must be a non-empty string, got {value!r}")


def require_seconds(section: Any, prefix: str, *names: str) -> None:
    """Durations: > 0 and at most `MAX_SECONDS`."""
    for name in names:
        value = getattr(section, name)
        require(
            0 < value <= MAX_SECONDS, f"{prefix}{name} must be in (0, {MAX_SECONDS}] seconds, got {value}"
        )


def require_top_k(prefix: str, top_k: int) -> None:
    require(top_k >= -1, f"{prefix}top_k must be -1 or 0 (off) or >= 1 (as vLLM), got {top_k}")


# ------------------------------------------------------------------------ what must exist on this machine
BUILTIN_REWARDS = ("math", "color")
"""The reward names `spmd_grpo.algorithm.reward` resolves itself (the rest must be `path/file.py:function`)."""


BUILTIN_DATASETS = ("color", "geo3k", "video_color")
"""The `builtin:<task>` data sets `spmd_grpo.data.synthetic` generates."""


HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+(@[\w.\[\]:%+-]+)?$")
"""`owner/name`, for data sets optionally `@split`."""


def _looks_like_hub_id(value: str) -> bool:
    """`owner/name[@split]` that cannot be a local path: no leading `/`, `.` or `~`, and `owner` is not a
    directory here (`models/qwen` with a `models/` directory is a missing local path, not a hub id)."""
    if not HUB_ID.match(value) or value[0] in "/.~":
        return False
    return not Path(value.split("/")[0]).is_dir()


def _hub_cache_has(repo_id: str) -> bool:
    """Whether the Hugging Face cache holds a snapshot of model `repo_id` with its config.json."""
    home = os.environ.get("HF_HOME", str(Path("~/.cache/huggingface").expanduser()))
    cache = Path(os.environ.get("HF_HUB_CACHE", os.path.join(home, "hub")))
    return any((cache / f"models--{repo_id.replace('/', '--')}" / "snapshots").glob("*/config.json"))


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
        _looks_like_hub_id(value),
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


def check_hub_reachable(key: str, value: str, timeout_s: float = 5.0) -> None:
    """A hub id missing from the local cache is downloaded at start-up, and without network huggingface_hub
    retried for 2.5 minutes before failing. So first one TCP connection to the hub (`HF_ENDPOINT`, or the
    HTTPS proxy that reaches it) within `timeout_s`; refused or timed out is a ConfigError naming the key.
    Local paths, cached ids and `HF_HUB_OFFLINE=1` (checked by `check_model_path`) need no network."""
    if not _looks_like_hub_id(value) or _hub_offline() or _hub_cache_has(value):
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
        raise ConfigError(
            f"{key}: {value!r} is not in the local Hugging Face cache and the hub is unreachable "
            f"({url.hostname}:{port}: {e.strerror or type(e).__name__}): download it where the hub is reachable "
            "(huggingface-cli download), or give a local directory"
        ) from None


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False")


def check_tokenizer_dir(key: str, value: str) -> None:
    """A local directory the processor is read from holds tokenizer files (a hub id is left to the hub)."""
    path = Path(value).expanduser()
    if not path.is_dir():
        return
    require(
        any(all((path / name).is_file() for name in group) for group in TOKENIZER_FILES),
        f"{key}: {value!r} holds no tokenizer files (tokenizer.json, or vocab.json and merges.txt)",
    )


def check_data_source(key: str, source: str) -> None:
    """A parquet file, a directory holding *.parquet, `builtin:<task>` (checked by the section), a hub id."""
    if source.startswith("builtin:"):
        return
    path = Path(source).expanduser()
    if path.is_file():
        return
    if path.is_dir():
        require(any(path.glob("*.parquet")), f"{key}: directory {source!r} holds no *.parquet file")
        return
    require(
        _looks_like_hub_id(source),
        f"{key} must be a parquet file or directory, builtin:<task> or a hub id owner/name[@split], "
        f"got {source!r}: no such file or directory",
    )


def count_rows(source: str, num_builtin_examples: int) -> int | None:
    """Rows of a data source before any is read (parquet footers only); None for a hub data set."""
    if source.startswith("builtin:"):
        return num_builtin_examples
    path = Path(source).expanduser()
    if not (path.is_file() or path.is_dir()):
        return None
    import pyarrow.parquet as pq

    files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
    rows, unreadable = 0, []
    for file in files:
        try:
            rows += pq.read_metadata(file).num_rows
        except Exception as e:  # pyarrow raises several types for a file that is not parquet
            unreadable.append(f"{file} is not a readable parquet file: {type(e).__name__}: {e}")
    # A bad file among good ones in a directory is skipped by the loader (named in its log), not fatal here.
    if unreadable and (path.is_file() or len(unreadable) == len(files)):
        raise ConfigError(unreadable[0])
    return rows


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
