"""vLLM's runtime LoRA routes: `POST /v1/load_lora_adapter` {"lora_name", "lora_path"} and
`POST /v1/unload_lora_adapter` {"lora_name"}, served only with `lora.runtime_updates` (or vLLM's
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=true`; off by default, as in vLLM).

They use the machinery the gRPC control plane uses for a run's adapter (`Backend.update_adapter`): the folder is read
and checked off the engine thread, then copied into a free adapter slot (or an idle one's, least recently used)
between two decode steps; the queued and running requests of other adapters keep their slots and weights. An
adapter loaded here serves as version 0 (it is no training step: a run's first UpdateWeights for the name replaces
it). Unloading refuses new requests for the name (404, as for a name never served); its queued and running requests
finish on it, and its slot is not reused until they have.

Answers as vLLM's: 200 with the text `Success: LoRA adapter '<name>' added successfully.` (`removed`) on success;
errors in OpenAI's shape naming the field: 400 for a missing or empty field, a name already served (or the model's
own id), an adapter that does not fit (rank over `lora.max_rank`, another base model, not a PEFT adapter); 404 for
a `lora_path` that is no folder and for unloading a name not served; 409 when every adapter slot serves queued or
running requests (`lora.max_loras` reached: retry once some finish).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from gyre.lora import ADAPTER_CONFIG
from gyre.transport import FetchedWeights

from gyre_inference.backend import AdapterSlotsBusyError, WeightsIncompatibleError
from gyre_inference.errors import APIError
from gyre_inference.strict import StrictModel

log = logging.getLogger(__name__)

LOAD_ROUTE, UNLOAD_ROUTE = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
ROUTES = (LOAD_ROUTE, UNLOAD_ROUTE)
ENV_VAR = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updates_from_env(environ=os.environ) -> bool:
    """vLLM's switch: `1`/`true` (any case) on, unset, empty, `0`/`false` off, as vLLM reads it. Anything else is
    refused naming the variable: vLLM reads `yes` as off, and a switch that silently stays off is hard to find."""
    value = environ.get(ENV_VAR, "").strip().lower()
    if value in ("1", "true"):
        return True
    if value in ("", "0", "false"):
        return False
    raise ValueError(f"{ENV_VAR}={environ[ENV_VAR]!r}: use true or 1 (on), false or 0 (off)")


class LoadLoRAAdapterRequest(StrictModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(StrictModel):
    lora_name: str


def _name(name: str) -> str:
    if not name.strip():
        raise APIError(400, "lora_name must be a non-empty model name", param="lora_name")
    return name


def add_lora_routes(app: FastAPI, state) -> None:
    """The two routes on `app` (`state`: api.AppState). One change at a time: a duplicate name is checked and loaded
    under one lock, so two loads of one name cannot both pass the check."""
    lock = asyncio.Lock()
    backend = state.backend

    @app.post(LOAD_ROUTE, summary="vLLM's: serve the PEFT adapter folder lora_path under model name lora_name.",
              response_class=PlainTextResponse)  # fmt: skip
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        name = _name(body.lora_name)
        if not body.lora_path.strip():
            raise APIError(400, "lora_path must be the path of a PEFT adapter folder on the server", param="lora_path")
        path = Path(body.lora_path).expanduser()
        if name == state.model_id:
            raise APIError(400, f"lora_name {name!r} is the served model's id; choose another name", param="lora_name")
        async with lock:
            if name in backend.adapter_names:
                raise APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name",
                               code="adapter_exists")  # fmt: skip
            if not await asyncio.to_thread(path.is_dir):
                raise APIError(404, f"lora_path {body.lora_path!r}: no such folder on the inference server",
                               param="lora_path", code="adapter_not_found")  # fmt: skip
            started = time.perf_counter()
            try:
                await backend.update_adapter(name, FetchedWeights.local(path, 0))
            except AdapterSlotsBusyError as error:
                state.metrics.weight_update_done(False, time.perf_counter() - started, name)
                raise APIError(409, str(error), param="lora_name", code="adapter_slots_busy") from None
            except WeightsIncompatibleError as error:
                state.metrics.weight_update_done(False, time.perf_counter() - started, name)
                message = str(error) + await asyncio.to_thread(_other_base, path, state.model_path)
                raise APIError(400, message, param="lora_path", code="adapter_incompatible") from None
            state.metrics.weight_update_done(True, time.perf_counter() - started, name)
        log.info("loaded LoRA adapter %r from %s (POST %s)", name, path, LOAD_ROUTE)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post(UNLOAD_ROUTE, summary="vLLM's: stop serving the adapter lora_name (its running requests finish).",
              response_class=PlainTextResponse)  # fmt: skip
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        name = _name(body.lora_name)
        if name == state.model_id:
            raise APIError(400, f"lora_name {name!r} is the served model itself, not an adapter", param="lora_name")
        async with lock:
            try:
                await backend.remove_adapter(name)
            except KeyError:
                raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                               code="model_not_found") from None  # fmt: skip
        log.info("unloaded LoRA adapter %r (POST %s)", name, UNLOAD_ROUTE)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def _other_base(path: Path, model_path: str) -> str:
    """When the adapter names a base model other than the one served, a note saying so (the likely cause of a shape
    that does not fit); else nothing. Only a hint: the same model is often named by a hub id here, a folder there."""
    try:
        base = json.loads((path / ADAPTER_CONFIG).read_bytes()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        return ""
    if not isinstance(base, str) or not base or base == model_path:
        return ""
    return f" (the adapter was trained on base model {base!r}; this server serves {model_path!r})"
