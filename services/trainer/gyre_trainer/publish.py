"""Weights out: servable HF folders on the shared volume, and NotifyWeights to the orchestrator.

`write_hf_folder` writes what `AutoModelForCausalLM.from_pretrained` and vLLM load:
`model.safetensors`, `config.json`, plus the tokenizer / chat template / generation config files
copied from the base model folder. `WeightPublisher`, the trainer's sink of the folder transport
(`gyre.transport`), puts such a folder under `weights/step_{s}` through `gyre.weights.WeightStore`
(atomic, with MANIFEST.json and its digest) together with
`gyre_step.json`, the step's event record, so that the record is committed atomically with the
weights (a trainer killed between publishing and logging can log the step after restart).

`WeightsNotifier` tells the orchestrator about each published version from a background thread:
every call has a deadline, failures are retried with capped exponential backoff, and an older
version whose notification keeps failing is dropped once a newer one is waiting (the orchestrator
only needs the newest, and it discovers published versions on its own start). Nothing here ever
raises into, or blocks, the training loop.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import json
import logging
import os
import random
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from gyre.fsio import free_space, write_file, write_hashed
from gyre.safetensors_io import safetensors_chunks
from gyre.transport import WeightSink
from gyre.weights import WeightsError, WeightsVersion

from gyre_trainer.checkpoint import one_line
from gyre_trainer.process import crash_point

log = logging.getLogger(__name__)

STEP_RECORD = "gyre_step.json"
WEIGHTS_FILE = "model.safetensors"
# a LoRA run's adapter next to its merged weights: what a restarted trainer resumes from (in a subfolder,
# which loaders of the folder's `*.safetensors` do not read)
RESUME_ADAPTER = "lora/adapter_model.safetensors"
# Files of a model folder that describe how to tokenize/generate, not the weights: copied verbatim.
_COPIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def servable_tensors(state_dict: dict[str, Any], config) -> dict[str, Any]:
    """Contiguous CPU tensors HF would save: a tied `lm_head.weight` is left out (it is the embedding)."""
    tensors = {}
    for name, tensor in state_dict.items():
        if name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
            continue
        tensors[name] = tensor.detach().to("cpu").contiguous()
    return tensors


def write_hf_folder(
    folder: Path, state_dict: dict[str, Any], config, base_model: Path | str, *, config_json: bytes | None = None
) -> dict[str, str]:
    """Write a complete HF model folder (weights, config, tokenizer files of `base_model`) into `folder`;
    returns {file name: sha256} for the store's manifest, so that nothing is read back to be hashed: the
    weights hashed while written, the config from memory, a base folder's files once per process.
    `config_json`: `config` already serialised (`config_bytes`), for a caller that writes it every step."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    chunks = safetensors_chunks(servable_tensors(state_dict, config), {"format": "pt"})
    # inference pods may run as another user of the volume's group: never leave 0600 files behind
    hashed = {WEIGHTS_FILE: write_hashed(folder / WEIGHTS_FILE, chunks, mode=0o644)}
    config_json = config_json or config_bytes(config)
    write_file(folder / "config.json", config_json)
    hashed["config.json"] = hashlib.sha256(config_json).hexdigest()
    copied = copy_tokenizer_files(base_model, folder)
    if (base := base_folder(base_model)) is not None:  # the base model's files never change: hashed once
        hashed.update({name: _base_file_sha256(base / name) for name in copied})
    return hashed


def _base_file_sha256(path: Path) -> str:
    stat = path.stat()
    return _sha256_once(str(path), (stat.st_ino, stat.st_size, stat.st_mtime_ns))


@functools.lru_cache(maxsize=64)
def _sha256_once(path: str, identity: tuple[int, int, int]) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def config_bytes(config) -> bytes:
    """`config.json` as `config.to_json_file` writes it."""
    return config.to_json_string(use_diff=True).encode()


def copy_tokenizer_files(base_model: Path | str, folder: Path) -> list[str]:
    """Put tokenizer/generation files of `base_model` (a folder, or a hub id: its snapshot in the hub cache,
    `base_folder`) into `folder`.

    Files are hard-linked when they can be (same filesystem, readable by group and others): they never
    change, and a link is durable with its folder's fsync, so a step publishes only its new bytes."""
    base = base_folder(base_model)
    if base is not None:
        copied = [name for name in _COPIED_FILES if (base / name).is_file()]
        for name in copied:
            _link_or_copy(base / name, folder / name)
        if "tokenizer_config.json" not in copied and "tokenizer.json" not in copied:
            raise FileNotFoundError(f"{base} has no tokenizer files; published weights would not be servable")
        return copied
    from transformers import AutoTokenizer, GenerationConfig

    AutoTokenizer.from_pretrained(str(base_model)).save_pretrained(folder)
    with contextlib.suppress(OSError):  # the model has none
        GenerationConfig.from_pretrained(str(base_model)).save_pretrained(folder)
    return sorted(p.name for p in folder.iterdir())


def base_folder(base_model: Path | str) -> Path | None:
    """The folder `base_model`'s files are read from: itself, or a hub id's snapshot in the hub cache (where the
    trainer loaded it from; no request to the hub), or None when the cache holds no snapshot of it with its
    tokenizer (transformers then fetches it). A hub id's tokenizer once went through `AutoTokenizer.save_pretrained`,
    which leaves `generation_config.json` out: the published and exported models lost the end-of-turn ids it lists
    (Gemma's `<end_of_turn>`), so a server of them never stopped at the end of a turn."""
    if Path(base_model).is_dir():
        return Path(base_model)
    from huggingface_hub import snapshot_download

    try:
        snapshot = Path(snapshot_download(str(base_model), local_files_only=True))
    except Exception:  # not in the cache (or not a hub id): transformers resolves it
        return None
    has_tokenizer = any((snapshot / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))
    return snapshot if has_tokenizer else None


def _link_or_copy(source: Path, target: Path) -> None:
    """Hard-link (or copy) the file `source` names. A symlink is read through: a hub cache snapshot's files are
    relative links into `blobs/`, and `os.link` would link the link itself, dangling in `target`'s folder."""
    source = source.resolve(strict=True)
    if source.stat().st_mode & 0o044 == 0o044:
        try:
            os.link(source, target)
            return
        except OSError:  # another filesystem, or links not allowed: copy
            pass
    shutil.copyfile(source, target)
    target.chmod(0o644)


class PublishError(OSError):
    """A weights version could not be written (a full or read-only volume); nothing of it became visible.

    An OSError, as the error it explains was: a caller that treats volume errors as such keeps doing so (a multi-run
    trainer adding a `runs_dir` run logs the run's failure and goes on with the others)."""


@contextlib.contextmanager
def _writing(step: int, folder: Path):
    """Turn a write error into one that says which version, where, and how full the volume is: a full volume
    read `OSError: [Errno 28] No space left on device` (safetensors: "I/O error"), naming no path and no step.
    The store then removes the partial folder, so no reader ever sees, or is told about, that version."""
    try:
        yield
    except Exception as e:  # not only OSError: safetensors' save_file raises its I/O errors as a SafetensorError
        raise PublishError(
            f"writing weights step {step} into {folder.parent} failed: {one_line(e)} ({free_space(folder.parent)}); "
            "the version was not published"
        ) from e


@contextlib.contextmanager
def _publishing(step: int):
    """The store's own I/O after the files are written (fsync, rename) in the same terms: on a network volume a
    full disk shows first at the fsync, as a bare `OSError: [Errno 28] No space left on device`."""
    try:
        yield
    except PublishError:
        raise
    except OSError as e:
        where = f" ({free_space(Path(e.filename).parent)})" if e.filename else ""
        raise PublishError(f"publishing weights step {step} failed: {one_line(e)}{where}; the version was not "
                           "published") from e  # fmt: skip


class WeightPublisher:
    """Publish `weights/step_{s}` (rank 0 only) and prune versions nobody needs any more."""

    def __init__(self, sink: WeightSink, base_model: Path | str, keep_last: int):
        self.sink = sink
        self.base_model = base_model
        self.keep_last = keep_last
        self._config, self._config_json = None, b""

    def publish(
        self,
        step: int,
        state_dict: dict[str, Any],
        config,
        record: dict[str, Any],
        *,
        adapter: dict | None = None,
        lora_cfg=None,
    ) -> WeightsVersion:
        """Publish full weights; `adapter` (a LoRA run's adapter under PEFT's file names, merged into
        `state_dict`) is kept with them as `RESUME_ADAPTER`, for a restart without a checkpoint of `step`, with
        its `adapter_config.json` (from `lora_cfg`): `lora/` is then a PEFT adapter folder that peft and vLLM's
        `--lora-modules` load. Without the config a user who wanted the trained adapter of a merged run found
        tensors no loader took ("Can't find 'adapter_config.json'")."""
        if self._config is not config:  # serialised once: it takes as long as writing a small model's weights
            self._config, self._config_json = config, config_bytes(config)

        def write(folder: Path) -> dict[str, str]:
            with _writing(step, folder):
                hashed = write_hf_folder(folder, state_dict, config, self.base_model, config_json=self._config_json)
                crash_point("mid_publish", step, None)
                data = json.dumps(record, sort_keys=True).encode()
                write_file(folder / STEP_RECORD, data)
                hashed[STEP_RECORD] = hashlib.sha256(data).hexdigest()
                if adapter is not None:
                    (folder / RESUME_ADAPTER).parent.mkdir()
                    chunks = safetensors_chunks(adapter, {"format": "pt"})
                    hashed[RESUME_ADAPTER] = write_hashed(folder / RESUME_ADAPTER, chunks, mode=0o644)
                    if lora_cfg is not None:
                        from gyre_trainer.lora import ADAPTER_CONFIG, adapter_config

                        name = f"{Path(RESUME_ADAPTER).parent}/{ADAPTER_CONFIG}"
                        data = json.dumps(adapter_config(lora_cfg, str(self.base_model)), indent=1, sort_keys=True)
                        write_file(folder / name, data.encode())
                        hashed[name] = hashlib.sha256(data.encode()).hexdigest()
                return hashed

        with _publishing(step):
            return self.sink.publish(step, write)

    def publish_adapter(
        self, step: int, state_dict: dict[str, Any], lora_cfg, record: dict[str, Any]
    ) -> WeightsVersion:
        """Publish the LoRA adapter alone (PEFT's `adapter_model.safetensors` + `adapter_config.json`) of a
        peft model's state dict (its adapter entries are enough); the torch backend applies it to its base."""
        from safetensors.torch import save_file

        from gyre_trainer.lora import ADAPTER_CONFIG, ADAPTER_FILE, adapter_config, adapter_state_dict

        def write(folder: Path) -> None:
            with _writing(step, folder):
                save_file(adapter_state_dict(state_dict), folder / ADAPTER_FILE, metadata={"format": "pt"})
                crash_point("mid_publish", step, None)
                config = adapter_config(lora_cfg, str(self.base_model))
                (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=1, sort_keys=True))
                (folder / STEP_RECORD).write_text(json.dumps(record, sort_keys=True))
                for file in folder.iterdir():
                    file.chmod(0o644)

        with _publishing(step):
            return self.sink.publish(step, write)

    def read_record(self, step: int) -> dict[str, Any] | None:
        """The event record published with version `step` (None when missing)."""
        try:
            return json.loads(self.sink.read(step, STEP_RECORD))
        except (OSError, ValueError, WeightsError):
            return None

    def prune(self) -> list[int]:
        """Keep the newest `keep_last` versions and every version a holder declared in use."""
        try:
            return self.sink.prune(self.keep_last)
        except OSError as e:  # retention is housekeeping: a volume hiccup must not stop training
            log.warning("pruning weights failed (will retry next step): %s", e)
            return []

    def discard_after(self, step: int) -> list[int]:
        """Delete versions newer than `step` (a rewound run abandons them)."""
        return self.sink.discard_after(step)


class WeightsNotifier:
    """Calls `gyre.v1.Orchestrator/NotifyWeights` for published versions from a daemon thread.

    Invariants: `notify()` never blocks or raises; versions are sent in publish order; a version is
    retried until the orchestrator accepts it or a newer version is queued; `delivered` lists the
    steps the orchestrator acknowledged (for tests and metrics).
    """

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 10.0,
        control_token: str | None = None,
        retry_initial_s: float = 0.5,
        retry_max_s: float = 30.0,
        quiet_unavailable_s: float = 30.0,
    ):
        import grpc
        from gyre.v1 import orchestrator_pb2_grpc

        self.address = address
        # An orchestrator not listening yet is normal for a while (`gyre rl` starts it once the replicas are ready,
        # after the resumed trainer re-notifies its step; a pod restarts): INFO, then WARNING once it lasts.
        self.quiet_unavailable_s = quiet_unavailable_s
        self.timeout_s = timeout_s
        self.metadata = (("authorization", f"Bearer {control_token}"),) if control_token else ()
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        self.delivered: list[int] = []
        self.failures = 0
        self._queue: collections.deque[WeightsVersion] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._busy = False
        self._channel = grpc.insecure_channel(address)
        self._stub = orchestrator_pb2_grpc.OrchestratorStub(self._channel)
        self._thread = threading.Thread(target=self._run, name="notify-weights", daemon=True)
        self._thread.start()

    def notify(self, published: WeightsVersion) -> None:
        with self._cond:
            self._queue.append(published)
            self._cond.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait up to `timeout` s until everything queued was delivered or dropped; True if so."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float = 2.0) -> None:
        """Give queued notifications `timeout` seconds, then stop the thread and the channel."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=1.0)
        self._channel.close()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                item = self._queue.popleft()
                self._busy = True
            try:
                self._deliver(item)
            except Exception:  # a bug here must not kill the thread silently nor reach the trainer
                log.exception("NotifyWeights step %d: unexpected error; dropping it", item.step)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _deliver(self, item: WeightsVersion) -> None:
        import grpc
        from gyre.v1 import orchestrator_pb2

        request = orchestrator_pb2.NotifyWeightsRequest(version=item.to_proto())
        delay = self.retry_initial_s
        attempt = 0
        since = time.monotonic()
        while True:
            attempt += 1
            try:
                reply = self._stub.NotifyWeights(request, timeout=self.timeout_s, metadata=self.metadata)
                self.delivered.append(item.step)
                log.info(
                    "orchestrator %s notified of weights step %d (accepted=%s, its latest %d)",
                    self.address, item.step, reply.accepted, reply.latest_step,
                )  # fmt: skip
                return
            except grpc.RpcError as e:
                self.failures += 1
                code = e.code() if hasattr(e, "code") else None
                waiting = code == grpc.StatusCode.UNAVAILABLE and time.monotonic() - since < self.quiet_unavailable_s
                log.log(
                    logging.INFO if waiting else logging.WARNING,
                    "NotifyWeights step %d to %s failed (attempt %d, %s); retrying in %.1fs",
                    item.step, self.address, attempt, code, delay,
                )  # fmt: skip
            with self._cond:
                if self._queue:
                    # only the newest version matters to the orchestrator: the normal course after a wait, not trouble
                    log.info("dropping notification of step %d: step %d is newer", item.step, self._queue[-1].step)
                    return
                # jitter: many trainers (or restarts) must not hammer a recovering orchestrator in phase
                self._cond.wait_for(lambda: self._closed or bool(self._queue), timeout=delay * random.uniform(0.8, 1.2))
                if self._closed:
                    return
            delay = min(delay * 2, self.retry_max_s)
