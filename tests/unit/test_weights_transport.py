"""The weight-transport seam (`gyre.transport`): one WeightsVersion from sink to source, config union,
proto round trip, and the folder source's verification modes (hashed once by default)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from unittest import mock

import pytest
from gyre.config.shared import ServiceConfig
from gyre.transport import FolderSource, FolderStore, open_source, open_store
from gyre.v1 import inference_pb2, orchestrator_pb2
from gyre.weights import WeightsError, WeightsVersion
from pydantic import ValidationError


def write(folder: Path) -> None:
    (folder / "model.safetensors").write_bytes(b"w" * 4096)
    (folder / "config.json").write_text("{}")


def test_sink_version_travels_unchanged_through_both_rpcs_to_the_source(tmp_path):
    sink = open_store(ServiceConfig().weights, tmp_path)
    version = sink.publish(3, write)
    assert version == WeightsVersion(3, version.digest, "folder", str(tmp_path / "weights" / "step_3"))
    assert version == sink.version(3) == sink.resolve(3, version.digest)
    # the same message, once, in both requests
    notify = orchestrator_pb2.NotifyWeightsRequest(version=version.to_proto())
    update = inference_pb2.UpdateWeightsRequest(version=notify.version)
    received = WeightsVersion.from_proto(
        orchestrator_pb2.NotifyWeightsRequest.FromString(notify.SerializeToString()).version
    )
    assert received == version == WeightsVersion.from_proto(update.version)
    fetched = open_source(ServiceConfig().weights).fetch(received)
    assert (fetched.step, fetched.folder, fetched.digest) == (3, tmp_path / "weights" / "step_3", version.digest)


def test_resolve_refuses_missing_or_different_versions(tmp_path):
    sink = FolderStore(tmp_path / "weights")
    with pytest.raises(WeightsError, match="missing"):
        sink.resolve(1)
    sink.publish(1, write)
    with pytest.raises(WeightsError, match="differs"):
        sink.resolve(1, "0" * 64)


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [("version.step", {"step": -1}), ("version.digest", {"step": 1, "digest": "abc"})],
)
def test_malformed_versions_name_the_field(field, kwargs):
    from gyre.v1 import weights_pb2

    with pytest.raises(ValueError, match=field):
        WeightsVersion.from_proto(weights_pb2.WeightsVersion(**kwargs))


def test_source_rejects_a_locator_that_is_not_the_steps_folder(tmp_path):
    sink = FolderStore(tmp_path / "weights")
    v = sink.publish(2, write)
    for locator in ("", str(tmp_path / "weights" / "step_1"), str(tmp_path / "weights")):
        with pytest.raises(ValueError, match="version.locator"):
            FolderSource().fetch(WeightsVersion(2, v.digest, "folder", locator))


def test_default_verification_reads_no_weight_bytes_full_verification_rehashes(tmp_path):
    """A step's weights are hashed once, by the publisher; replicas check sizes + the manifest digest.
    A same-size corruption is therefore caught only with `full_verify` (the trade-off of the default)."""
    sink = FolderStore(tmp_path / "weights")
    v = sink.publish(1, write)
    blob = bytearray((v.path / "model.safetensors").read_bytes())
    blob[-1] ^= 0xFF
    (v.path / "model.safetensors").write_bytes(bytes(blob))
    with mock.patch("gyre.weights._sha256_file", side_effect=AssertionError("hashed again")):
        assert FolderSource().fetch(v).folder == v.path
    with pytest.raises(WeightsError, match="sha256"):
        FolderSource(full_verify=True).fetch(v)
    (v.path / "config.json").write_text("{} ")  # a size change is always caught
    with pytest.raises(WeightsError, match="bytes"):
        FolderSource().fetch(v)


def test_publish_hashes_each_file_exactly_once(tmp_path):
    calls = []
    real = hashlib.sha256

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    with mock.patch("gyre.weights.hashlib.sha256", side_effect=counting):
        v = FolderStore(tmp_path / "weights").publish(1, write)
        FolderSource().fetch(v)
    # one hash per file (2) + the manifest digest at publish + the manifest digest when verified
    assert len(calls) == 4


def test_transport_config_union_names_the_key():
    assert ServiceConfig(weights={"kind": "folder", "full_verify": True}).weights.full_verify is True
    with pytest.raises(ValidationError, match="weights.kind"):
        ServiceConfig(weights={"kind": "nccl"})


def test_the_folder_transport_is_the_declared_seam(tmp_path):
    """Publisher, relay, control and backends are typed against `WeightSink`/`WeightSource` and use nothing else:
    the folder transport provides both, and a step's own files are read through the sink (`read`)."""
    from gyre.transport import WeightSink, WeightSource

    sink, source = open_store(ServiceConfig().weights, tmp_path), open_source(ServiceConfig().weights)
    assert isinstance(sink, WeightSink) and isinstance(source, WeightSource)
    assert not hasattr(sink, "store")  # nobody reaches through the seam to the folder store
    sink.publish(4, write)
    assert sink.read(4, "config.json") == (tmp_path / "weights" / "step_4" / "config.json").read_bytes()
    with pytest.raises(OSError):
        sink.read(4, "missing.json")
