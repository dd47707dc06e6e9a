"""Where a run's base model comes from, checked before anything starts.

`model.name` is either a local model folder or a Hugging Face hub id (`org/name`). A hub id is
resolved as transformers resolves it (`AutoConfig.from_pretrained`: the local cache first, then
the hub, honouring `HF_HOME`, `HF_TOKEN`, `HF_HUB_OFFLINE`), so a cluster with network fetches it
once into its cache volume and the services load it from there. A name that is neither an existing
folder nor a fetchable hub id is an error that says how to get a local model; a random model is
never created in its place (that needs `model.init_preset`, see `gyre rl --help`).
"""

from __future__ import annotations

import re
from pathlib import Path

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")
HOW_TO_CREATE = (
    "to train a small local model instead, set model.init_preset = 'tiny' (creates {output_dir}/model) "
    "or create one with `gyre model init --output-dir DIR` and set model.name = DIR"
)


class ModelUnavailable(ValueError):
    """`model.name` is neither a model folder nor a hub id that can be fetched; the message says what to do."""


def looks_like_hub_id(name: str) -> bool:
    """`org/name` (or a bare legacy `name`), not a path: no leading `.`, `/` or `~`, at most one `/`."""
    return bool(_HUB_ID.match(name)) and not name.startswith(".")


def check_model_source(name: str, key: str = "model.name") -> str:
    """Return how `name` will be loaded ("local folder" or "hub id") or raise `ModelUnavailable`."""
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelUnavailable(f"{key} = {name!r}: {path} is not a model folder (no config.json); {HOW_TO_CREATE}")
        return "local folder"
    if not looks_like_hub_id(name):
        raise ModelUnavailable(f"{key} = {name!r}: the model folder {path} does not exist; {HOW_TO_CREATE}")
    try:
        from transformers import AutoConfig

        AutoConfig.from_pretrained(name)
    except Exception as e:  # OSError/EnvironmentError from the hub client, ValueError for odd ids
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelUnavailable(
            f"{key} = {name!r} is not a local folder, and as a Hugging Face hub id it cannot be fetched "
            f"({reason}); {HOW_TO_CREATE}"
        ) from None
    return "hub id"
