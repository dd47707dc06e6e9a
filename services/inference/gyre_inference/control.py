"""gRPC control plane: `gyre.v1.InferenceControl` + `grpc.health.v1` + reflection, on `control.port`.

- UpdateWeights(version): the replica's weights source (`gyre.transport`, `weights` config) fetches
  the version and verifies it BEFORE anything is loaded — for the folder transport, `locator` must be
  a `.../step_{step}` folder whose MANIFEST.json matches `digest` (when given) and whose files have the
  recorded sizes (every file re-hashed with `weights.full_verify`) — then the backend swaps the
  weights in between two decode steps. Any refusal
  (corrupt, half-written or missing folder, wrong digest, every adapter slot busy) is
  FAILED_PRECONDITION with the reason, and the old weights keep serving. So is a step older than the
  version served (a late retry must not roll the policy back silently) unless `rollback` is set.
  Weights that do not fit the served model (tensors it lacks, another shape or dtype, an adapter rank
  over `lora.max_rank`: `WeightsIncompatibleError`) are INVALID_ARGUMENT: no retry can load them, and
  the relay stops the run when any replica refuses a version so. A load that failed for a reason that may pass (an
  I/O error on the volume, a timeout, out of memory: `WeightsLoadError`, or any OSError) is FAILED_PRECONDITION.
  The version served (same step and digest) is answered at once, not loaded again (a retry of a call that timed out).
  Bad arguments are INVALID_ARGUMENT; calls before the model is loaded, or overtaken by the service's stop, are
  UNAVAILABLE. Updates are serialised.
- `model` names which served model an UpdateWeights/GetStatus is about: empty or the replica's model
  id = the model itself (above); another name = the named LoRA adapter served under that model name
  (multi-run: one per run; the version must be a PEFT adapter folder, a new name takes a free slot,
  and the older-step rule applies per name).
- ReloadWeights(): back to the base model, version 0. GetStatus(): model, version, load, readiness.
- Health is NOT_SERVING until the model is loaded and again once shutdown starts.
- With a control token configured, every InferenceControl call must carry metadata
  `authorization: Bearer <token>` (else UNAUTHENTICATED); a token read from `auth.control_token_file` is taken up
  again when the file is rotated, the previous one accepted for a grace (`gyre_inference.api_key`). Health and
  reflection stay open, because Kubernetes' native gRPC probes cannot send metadata and reflection only describes
  the API.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from gyre.grpc_server import AioGrpcServer
from gyre.transport import FolderSource, WeightSource
from gyre.v1 import inference_pb2, inference_pb2_grpc
from gyre.weights import WeightsError, WeightsVersion

from gyre_inference.api_key import ServerKey
from gyre_inference.backend import (
    AdapterSlotsBusyError,
    Backend,
    BackendStoppedError,
    WeightsIncompatibleError,
    WeightsLoadError,
    run_to_end,
)
from gyre_inference.metrics import InferenceMetrics

log = logging.getLogger(__name__)

SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["InferenceControl"].full_name


class OlderVersionError(Exception):
    """UpdateWeights for a step older than the one served, without `rollback`."""


class InferenceControl(inference_pb2_grpc.InferenceControlServicer):
    def __init__(self, backend: Backend, metrics: InferenceMetrics, model_id: str, source: WeightSource):
        self.backend, self.metrics, self.model_id, self.source = backend, metrics, model_id, source
        self._lock = asyncio.Lock()
        self._last_seconds = 0.0
        # the digest of the version each served model (None: the model itself, else an adapter name) was updated to:
        # an UpdateWeights of that very version is answered at once (the relay's retry of a call that timed out
        # while the backend loaded it; the backends finish a load they began, so it was loaded all the same)
        self._digests: dict[str | None, str] = {}

    async def UpdateWeights(self, request, context):  # noqa: N802 (gRPC method name)
        if not self.backend.ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is not loaded yet")
        try:
            version = WeightsVersion.from_proto(request.version)
            if version.transport != self.source.transport:
                raise ValueError(
                    f"version.transport is {version.transport!r}; this replica fetches by {self.source.transport!r}"
                )
            self.source.check(version)
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        adapter = self._adapter(request.model)
        what = f"weights step {version.step} from {version.locator}" + (f" for {adapter!r}" if adapter else "")
        # run to its end when the caller gives up (`run_to_end`): its retry then finds the version served
        load = run_to_end(self._load(version, request.rollback, adapter), version.step)
        refusal = await self._swap(what, load, adapter)
        if refusal is not None:
            await context.abort(*refusal)
        return inference_pb2.UpdateWeightsResponse(step=self._served(adapter), load_seconds=self._last_seconds)

    async def ReloadWeights(self, request, context):  # noqa: N802
        if not self.backend.ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is not loaded yet")
        self._digests.pop(None, None)
        refusal = await self._swap("the base weights", self.backend.reload_base())
        if refusal is not None:
            await context.abort(*refusal)
        return inference_pb2.ReloadWeightsResponse(step=self.backend.version)

    async def GetStatus(self, request, context):  # noqa: N802
        running, waiting = self.backend.load_stats() if self.backend.ready else (0, 0)
        adapter = self._adapter(request.model)
        # an adapter name not served yet reports version 0: its first UpdateWeights adds it
        return inference_pb2.GetInferenceStatusResponse(
            model=adapter or self.model_id, step=self._served(adapter), backend=self.backend.name,
            running=running, waiting=waiting, ready=self.backend.ready,
        )  # fmt: skip

    def _adapter(self, model: str) -> str | None:
        """The named adapter a request's `model` field means (None: the replica's model itself)."""
        return None if model in ("", self.model_id) else model

    async def _load(self, version: WeightsVersion, rollback: bool, adapter: str | None = None) -> None:
        # Checked under the update lock: of two calls racing, the older step is refused after the newer one.
        before = self._served(adapter)
        if version.step < before and not rollback:
            raise OlderVersionError(f"step {version.step} is older than the version served; set rollback to go back")
        if version.step == before and version.digest and self._digests.get(adapter) == version.digest:
            return  # served already: loading it again cost a full load (and, on vLLM, a pause of generation)
        applied = False
        try:
            weights = await asyncio.to_thread(self.source.fetch, version)
            if adapter is None:
                await self.backend.update_weights(weights)
            else:
                await self.backend.update_adapter(adapter, weights)
            applied = True
        finally:
            # a caller that gave up (its deadline) is told after the backend finished a load it began: the version is
            # served if the step moved to it; a load of the step served (a republish) may have applied or not
            if version.digest and (applied or before != version.step == self._served(adapter)):
                self._digests[adapter] = version.digest
            elif version.step == before:
                self._digests.pop(adapter, None)

    async def _swap(self, what: str, load, adapter: str | None = None) -> tuple[grpc.StatusCode, str] | None:
        """Run one load under the lock; None on success, else the (code, message) to refuse the call with."""
        async with self._lock:
            started = time.perf_counter()
            try:
                await load
            except BackendStoppedError as error:  # the service's stop overtook the load: a replica going down
                self.metrics.weight_update_done(False, time.perf_counter() - started, adapter)
                log.warning("refused %s: %s", what, error)
                # UNAVAILABLE, as before the model loaded: the relay updates it once a probe finds it ready again
                return (
                    grpc.StatusCode.UNAVAILABLE,
                    f"refused {what}: {error}; still serving version {self._served(adapter)}",
                )
            except Exception as error:
                self.metrics.weight_update_done(False, time.perf_counter() - started, adapter)
                expected = isinstance(
                    error, WeightsError | WeightsIncompatibleError | WeightsLoadError | OSError | OlderVersionError
                )
                log.log(
                    logging.WARNING if expected else logging.ERROR, "refused %s: %s", what, error, exc_info=not expected
                )
                # weights that do not fit the model served (another architecture, tensors it lacks) are refused for
                # good: INVALID_ARGUMENT, and a relay any replica tells so stops the run. Busy adapter slots, a
                # folder the volume shows late, a load that may pass (I/O, a timeout, memory: WeightsLoadError), an
                # older step: FAILED_PRECONDITION, worth sending again
                permanent = isinstance(error, WeightsIncompatibleError) and not isinstance(error, AdapterSlotsBusyError)
                code = (grpc.StatusCode.INVALID_ARGUMENT if permanent
                        else grpc.StatusCode.FAILED_PRECONDITION if expected else grpc.StatusCode.INTERNAL)  # fmt: skip
                return code, f"refused {what}: {error}; still serving version {self._served(adapter)}"
            self._last_seconds = time.perf_counter() - started
            self.metrics.weight_update_done(True, self._last_seconds, adapter)
            log.info("now serving version %d (%s, %.2fs)", self._served(adapter), what, self._last_seconds)
            return None

    def _served(self, adapter: str | None) -> int:
        if adapter is not None:
            return self.backend.adapter_version(adapter) if adapter in self.backend.adapter_names else 0
        return self.backend.version


class ControlServer(AioGrpcServer):
    """The grpc.aio server (`gyre.grpc_server`): control servicer, health, reflection, optional token auth."""

    def __init__(
        self,
        backend: Backend,
        metrics: InferenceMetrics,
        model_id: str,
        token: ServerKey | str | None = None,
        source: WeightSource | None = None,
    ):
        super().__init__(SERVICE_NAME, token=token, what="gRPC control server")
        control = InferenceControl(backend, metrics, model_id, source or FolderSource())
        inference_pb2_grpc.add_InferenceControlServicer_to_server(control, self.server)
