"""Where a run's base model comes from, checked before anything starts.

`model.name` is either a local model folder or a Hugging Face hub id (`org/name`). A hub id is
resolved as transformers resolves it (`AutoConfig.from_pretrained`: the local cache first, then
the hub, honouring `HF_HOME`, `HF_TOKEN`, `HF_HUB_OFFLINE`), so a cluster with network fetches it
once into its cache volume and the services load it from there. A name that is neither an existing
folder nor a fetchable hub id is an error that says how to get a local model; a random model is
never created in its place (that needs `model.init_preset`, see `gyre rl --help`).

`gyre model fetch` downloads a hub model into that cache ahead of the services (the Helm chart's
`model-fetch` init container), checking first that it fits the cache volume.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from pydantic import Field

from gyre.config import Section, parse_or_exit
from gyre.config.command_line import print_startup_error

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")
HOW_TO_CREATE = (
    "to bring a pretrained model, run `gyre model import SOURCE --output-dir DIR` (SOURCE: smollm2 offline, a "
    ".gguf file, a hub cache folder) and set model.name = DIR; to train a small local model instead, set "
    "model.init_preset = 'tiny' (creates {output_dir}/model) or create one with `gyre model init --output-dir DIR` "
    "and set model.name = DIR"
)


SERVICE_HINT = "create one with `gyre model init --output-dir DIR` (or `gyre model import`) and set model.name = DIR"


def check_service_model(name: str, prog: str, hub: bool = False, config: Any = None) -> int | None:
    """A service's start-up check of its model folder: None when it can go on, else 2 after one clear line
    (a missing folder once surfaced as a trainer traceback or a hub client's 'Repo id must be ...').
    `hub`: also fetch a hub id's config now (a local command such as `gyre sft`, which failed with the hub
    client's traceback after preparing its data; in a cluster the chart's init container fetches it). `config`: the
    service's, whose log.format the line follows (a JSON record under the chart's GYRE_LOG__FORMAT=json)."""
    try:
        if check_model_source(name, hub=False, hint=SERVICE_HINT) == "hub id" and hub:
            check_model_source(name, hint=SERVICE_HINT)
    except ModelUnavailable as e:
        print_startup_error(prog, str(e), config)
        return 2
    return None


# The weight files a model folder is loaded from (transformers, vLLM; sharded ones too).
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
# The files a tokenizer's vocabulary is loaded from: fast (tokenizer.json), SentencePiece, BPE, WordPiece, tiktoken.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "*.tiktoken", "tiktoken.model")


class ModelUnavailable(ValueError):
    """`model.name` is neither a model folder nor a hub id that can be fetched; the message says what to do."""


def looks_like_hub_id(name: str) -> bool:
    """`org/name` (or a bare legacy `name`), not a path: no leading `.`, `/` or `~`, at most one `/`, and a repo id
    the hub client takes (huggingface_hub's `validate_repo_id`: at most 96 characters, each part starting and ending
    with a letter, digit or `_`, no `--` or `..`, no `.git` ending). Any other name that is not there locally is a
    missing folder (`run-1/model-` was sent to the hub, which answered "Repo id must use alphanumeric chars ...")."""
    if not _HUB_ID.match(name) or len(name) > 96 or "--" in name or ".." in name or name.endswith(".git"):
        return False
    return all(part[-1] not in "-." for part in name.split("/"))


def check_model_source(name: str, key: str = "model.name", hub: bool = True, hint: str = HOW_TO_CREATE) -> str:
    """Return how `name` will be loaded ("local folder" or "hub id") or raise `ModelUnavailable`.

    A folder, and a hub id loaded from the hub cache alone (`HF_HUB_OFFLINE`, as the chart's services run, or a hub
    that cannot be reached), must hold a config, weights and a tokenizer (`check_model_folder`; for a hub id, its
    cached snapshot). `hub=False` takes a hub id the hub may still supply on trust (the service's own load reports a
    hub failure); `hub=True` fetches its config."""
    path = Path(name).expanduser()
    if path.is_dir() and not hub:  # a service is about to load it: say now what it lacks, naming the key
        check_model_folder(path, name, key, hint)
        return "local folder"
    if path.exists() and not hub:
        # every backend reads the tokenizer and configs from a folder (gyre_inference.text): a .gguf passed to vLLM
        # failed after start with "the config file at ... is not a valid JSON file"
        how = " (`gyre model import FILE --output-dir DIR` makes one of a .gguf file)" if path.suffix == ".gguf" else ""
        raise ModelUnavailable(f"{key} = {name!r} is a file, not a model folder{how}; {hint}")
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelUnavailable(f"{key} = {name!r}: {path} is not a model folder (no config.json); {hint}")
        return "local folder"
    if not looks_like_hub_id(name):
        raise ModelUnavailable(f"{key} = {name!r}: the model folder {path} does not exist; {hint}")
    from huggingface_hub import constants

    if not hub and not constants.HF_HUB_OFFLINE:
        return "hub id"
    unreachable = None if constants.HF_HUB_OFFLINE else hub_unreachable()
    if constants.HF_HUB_OFFLINE or unreachable is not None:
        # loaded from the hub cache alone (the chart's services run offline): its snapshot is the model folder, and
        # gets a plain folder's checks; a hub id passed on the config alone, and a service without a tokenizer
        # failed after start
        snapshot = cached_snapshot(name)
        if snapshot is None:
            reason = unreachable or "HF_HUB_OFFLINE is set"
            raise ModelUnavailable(
                f"{key} = {name!r} is not a local folder, and as a Hugging Face hub id it cannot be fetched "
                f"({reason}, and it is not in the hub cache {constants.HF_HUB_CACHE}); {hint}"
            )
        check_model_folder(snapshot, name, key, hint)
        return "hub id"
    try:
        from transformers import AutoConfig

        AutoConfig.from_pretrained(name)
    except Exception as e:  # OSError/EnvironmentError from the hub client, ValueError for odd ids
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelUnavailable(
            f"{key} = {name!r} is not a local folder, and as a Hugging Face hub id it cannot be fetched "
            f"({reason}); {hint}"
        ) from None
    return "hub id"


def check_model_folder(path: Path, name: str, key: str, hint: str) -> None:
    """Raise `ModelUnavailable` naming `key` when the folder `path` (`name`'s) lacks a config, weights or a tokenizer.
    A hub cache snapshot's files are symlinks into its blobs: one whose blob is missing counts as missing."""
    if not (path / "config.json").is_file() and (path / "snapshots").is_dir():  # the hub cache's models--org--name
        raise ModelUnavailable(f"{key} = {name!r}: {path} is a hub cache folder, not a model folder: give one of its "
                               f"snapshots ({path / 'snapshots'}/<revision>), or its hub id with the cache as HF_HOME, "
                               f"or `gyre model import` it; {hint}")  # fmt: skip
    if not (path / "config.json").is_file():
        raise ModelUnavailable(f"{key} = {name!r}: {path} is not a model folder (no config.json); {hint}")
    if not _holds(path, WEIGHT_FILES):
        raise ModelUnavailable(f"{key} = {name!r}: the model folder {path} holds no weights "
                               f"({', '.join(WEIGHT_FILES)}); {hint}")  # fmt: skip
    # every service tokenizes (the trainer publishes the tokenizer with its weights): without one, inference
    # failed after start with transformers' "install sentencepiece or tiktoken", and a trainer after its first step
    if not _holds(path, TOKENIZER_FILES):
        raise ModelUnavailable(f"{key} = {name!r}: the model folder {path} holds no tokenizer "
                               f"({', '.join(TOKENIZER_FILES)}); {hint}")  # fmt: skip


def _holds(folder: Path, patterns: tuple[str, ...]) -> bool:
    """Whether `folder` has a non-folder entry matching one of `patterns` (a symlink counts only when its target
    exists: a hub snapshot whose blob is gone). Presence only, as before the cache check: a named pipe counts."""
    return any(p.exists() and not p.is_dir() for pattern in patterns for p in folder.glob(pattern))


def cached_snapshot(name: str) -> Path | None:
    """The hub cache's snapshot folder of hub id `name` (its `refs/main`), or None when the cache has no config.json
    of it. Reads only the cache (HF_HOME / HF_HUB_CACHE), never the network."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(name, "config.json")
    return Path(found).parent if isinstance(found, str) else None


def hub_unreachable() -> str | None:
    """Why the hub cannot be reached, or None (it answered, or the client is offline by choice: `HF_HUB_OFFLINE`).

    One request through the hub client's own session (its proxies, certificates and `HF_ENDPOINT`): without a
    network the client retried each file five times, so a hub id that could not be fetched was said after 25 s
    of "Retrying in 8s" lines instead of at once."""
    from huggingface_hub import constants, get_session

    if constants.HF_HUB_OFFLINE:
        return None
    try:
        get_session().head(constants.ENDPOINT, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except Exception as e:  # any answer, even an error status, is a reachable hub; no answer is not
        return f"cannot reach {constants.ENDPOINT} ({str(e).strip() or type(e).__name__})"
    return None


# ---- `gyre model fetch`: download a hub model once, or say at once that it cannot fit -------------------

# Weight formats a repository may carry besides safetensors (the services load safetensors when present).
OTHER_WEIGHT_FORMATS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.msgpack", "*.onnx", "*.gguf", "*.ot")


def human_size(n: int) -> str:
    """1536 -> '1.5 KiB': binary units, as Kubernetes quantities (`20Gi`) are written."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class ModelDoesNotFit(RuntimeError):
    """The files still to download are larger than the room left in the cache; the message has the sizes."""


FETCH_SUMMARY = (
    "Download a hub model into the Hugging Face cache (what the services load it from), after checking that it "
    "fits: a model too big for the cache fails at once, with the sizes, instead of filling the disk."
)


class ModelFetchConfig(Section):
    """`gyre model fetch` options."""

    name: str = Field(..., description="Hub id of the model (`org/name`).")
    cache_dir: Path | None = Field(
        None,
        description="The Hugging Face home the services read (HF_HOME; the hub cache is its `hub` folder); "
        "default: $HF_HOME, else ~/.cache/huggingface.",
    )
    max_size: int | None = Field(
        None,
        ge=1,
        description="Bytes `cache_dir` may hold in all (e.g. an emptyDir's sizeLimit, which the filesystem's "
        "free space does not show); default: the filesystem's free space alone.",
    )
    size_setting: str = Field("--max-size", description="The setting named in the message when the model does not fit.")


def _home(cache_dir: Path | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    from huggingface_hub import constants

    return Path(constants.HF_HOME)


def _used_bytes(folder: Path) -> int:
    """Bytes of the regular files under `folder` (the hub cache's snapshots are symlinks into its blobs)."""
    total = 0
    for root, _dirs, files in os.walk(folder):
        for f in files:
            path = Path(root, f)
            if not path.is_symlink():
                total += path.stat().st_size
    return total


def room_in_cache(home: Path, max_size: int | None) -> tuple[int, int]:
    """(bytes that still fit under `home`, bytes it holds now)."""
    home.mkdir(parents=True, exist_ok=True)
    used = _used_bytes(home)
    room = shutil.disk_usage(home).free
    if max_size is not None:
        room = min(room, max_size - used)
    return max(room, 0), used


def fetch_model(name: str, cache_dir: Path | None = None, max_size: int | None = None,
                size_setting: str = "--max-size") -> Path:  # fmt: skip
    """Download hub model `name` (config, tokenizer, safetensors weights; other weight formats only when
    it has no safetensors) into the hub cache under `cache_dir`, first checking that the files not cached
    yet fit; returns the snapshot folder. Raises `ModelDoesNotFit` before downloading anything."""
    from huggingface_hub import HfApi, snapshot_download

    home = _home(cache_dir)
    hub_cache = home / "hub"
    files = [s.rfilename for s in HfApi().model_info(name).siblings or []]
    ignore = list(OTHER_WEIGHT_FORMATS) if any(f.endswith(".safetensors") for f in files) else []
    plan = snapshot_download(name, cache_dir=hub_cache, ignore_patterns=ignore, dry_run=True)
    needed = sum(info.file_size or 0 for info in plan if info.will_download)
    room, used = room_in_cache(home, max_size)
    if needed > room:
        limit = f"limit {human_size(max_size)}, " if max_size is not None else ""
        total = sum(info.file_size or 0 for info in plan)
        raise ModelDoesNotFit(
            f"{name} needs {human_size(needed)} more in {home} but only {human_size(room)} fit ({limit}"
            f"{human_size(used)} used; the model's {len(plan)} files take {human_size(total)}): "
            f'raise {size_setting} (docs/kubernetes.md, "Model cache"); nothing was downloaded'
        )
    return Path(snapshot_download(name, cache_dir=hub_cache, ignore_patterns=ignore))


def main(argv: list[str] | None = None) -> int:
    """`gyre model fetch --name ORG/NAME [--cache-dir HF_HOME] [--max-size BYTES]`."""
    cfg = parse_or_exit(ModelFetchConfig, argv, prog="gyre model fetch", summary=FETCH_SUMMARY)
    if not looks_like_hub_id(cfg.name) or "/" not in cfg.name:
        print(f"gyre model fetch: error: config key 'name': {cfg.name!r} is not a hub id (org/name)", file=sys.stderr)
        return 2
    try:
        path = fetch_model(cfg.name, cfg.cache_dir, cfg.max_size, cfg.size_setting)
    except ModelDoesNotFit as error:
        print(f"gyre model fetch: error: {error}", file=sys.stderr)
        return 1
    except Exception as error:  # the hub client's errors (unknown repo, gated, network): one line, no traceback
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        print(f"gyre model fetch: error: {cfg.name}: {reason}", file=sys.stderr)
        return 1
    print(f"gyre model fetch: {cfg.name} -> {path}")
    return 0
