"""WeightStore: atomic publish (even under SIGKILL), verification, in-use tracking and pruning."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gyre.weights import MANIFEST, WeightsError, WeightStore


def writer(content: bytes = b"weights", n_files: int = 2):
    def write(folder: Path) -> None:
        for i in range(n_files):
            (folder / f"model-{i}.safetensors").write_bytes(content * (i + 1))
        (folder / "tokenizer").mkdir()
        (folder / "tokenizer" / "tokenizer.json").write_text('{"v": 1}')

    return write


@pytest.fixture
def store(tmp_path) -> WeightStore:
    return WeightStore(tmp_path / "weights")


def test_publish_writes_manifest_and_digest(store):
    published = store.publish(1, writer())
    assert published.path == store.path(1) and published.path.name == "step_1"
    manifest_bytes = (published.path / MANIFEST).read_bytes()
    assert published.digest == hashlib.sha256(manifest_bytes).hexdigest() == store.digest(1)
    doc = json.loads(manifest_bytes)
    assert doc["step"] == 1 and set(doc) == {"step", "files", "created"}
    assert doc["files"]["model-1.safetensors"] == {
        "sha256": hashlib.sha256(b"weights" * 2).hexdigest(),
        "bytes": len(b"weights" * 2),
    }
    assert set(doc["files"]) == {"model-0.safetensors", "model-1.safetensors", "tokenizer/tokenizer.json"}
    manifest = store.verify(1, published.digest)
    assert manifest.step == 1 and manifest.files == doc["files"]
    assert [p.name for p in store.root.iterdir()] == ["step_1"]  # no temp folders left


def test_steps_and_latest(store):
    assert store.steps() == [] and store.latest() is None
    for step in (3, 1, 10):
        store.publish(step, writer(bytes([step])))
    assert store.steps() == [1, 3, 10] and store.latest() == 10
    (store.root / "step_11").mkdir()  # no manifest: incomplete, invisible
    (store.root / ".tmp-step_12-abc").mkdir()
    (store.root / "step_x").mkdir()
    assert store.steps() == [1, 3, 10] and store.latest() == 10
    with pytest.raises(WeightsError, match="incomplete"):
        store.verify(11)
    with pytest.raises(WeightsError, match="missing"):
        store.digest(12)


def test_republish_same_content_is_idempotent_and_different_content_replaces(store):
    first = store.publish(2, writer(b"a"))
    created = store.verify(2).created
    again = store.publish(2, writer(b"a"))
    assert again.digest == first.digest and store.verify(2).created == created
    replaced = store.publish(2, writer(b"b"))
    assert replaced.digest != first.digest
    store.verify(2, replaced.digest)
    with pytest.raises(WeightsError, match="digest"):
        store.verify(2, first.digest)
    assert sorted(p.name for p in store.root.iterdir()) == ["step_2"]


def test_failed_write_fn_leaves_nothing(store):
    def explode(folder: Path) -> None:
        (folder / "half.bin").write_bytes(b"x")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        store.publish(1, explode)
    with pytest.raises(WeightsError, match="no files"):
        store.publish(1, lambda folder: None)
    with pytest.raises(WeightsError, match="MANIFEST"):
        store.publish(1, lambda folder: (folder / MANIFEST).write_text("{}"))
    assert store.steps() == [] and list(store.root.iterdir()) == []


def test_files_hashed_while_written_are_not_hashed_again(store, monkeypatch):
    from gyre import fsio, weights
    from gyre.fsio import write_hashed

    chunks = [b"head", memoryview(b"x" * 5000), bytearray(b"tail")]
    monkeypatch.setattr(fsio, "_FLUSH_BYTES", 1000)  # written in slices, flushed while writing
    reread = []
    monkeypatch.setattr(weights, "_sha256_file", lambda path: reread.append(path.name) or "0" * 64)

    def write(folder: Path) -> dict[str, str]:
        (folder / "config.json").write_text("{}")
        return {"model.safetensors": write_hashed(folder / "model.safetensors", chunks)}

    published = store.publish(1, write)
    data = (published.path / "model.safetensors").read_bytes()
    assert (
        data == b"head" + b"x" * 5000 + b"tail"
        and oct(os.stat(published.path / "model.safetensors").st_mode)[-3:] == "644"
    )
    manifest = store.verify(1, published.digest, full=False)
    assert manifest.files["model.safetensors"] == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    assert reread == ["config.json"]  # only the file nobody hashed was read back
    with pytest.raises(WeightsError, match="did not write"):
        store.publish(2, lambda folder: writer()(folder) or {"ghost.bin": "0" * 64})
    assert store.steps() == [1]


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda d: (d / "model-0.safetensors").write_bytes(b"wEights"), "sha256"),
        (lambda d: (d / "model-1.safetensors").write_bytes(b"short"), "bytes"),
        (lambda d: (d / "tokenizer" / "tokenizer.json").unlink(), "missing"),
        (lambda d: (d / MANIFEST).write_text("{not json"), "malformed"),
        (lambda d: (d / MANIFEST).write_text(json.dumps({"step": 1, "files": {"a": {}}, "created": 0})), "malformed"),
        (lambda d: (d / MANIFEST).write_text(json.dumps({"step": 9, "files": {}, "created": 0})), "manifest says"),
    ],
)
def test_verify_detects_corruption(store, corrupt, message):
    store.publish(1, writer())
    store.verify(1)
    corrupt(store.path(1))
    with pytest.raises(WeightsError, match=message):
        store.verify(1)


def test_prune_keeps_newest_in_use_and_latest(store):
    for step in range(1, 8):
        store.publish(step, writer(bytes([step])))
    store.set_in_use("orchestrator", [2, 3])
    store.set_in_use("orchestrator", [2])  # replaces the previous declaration
    store.set_in_use("eval", [4])
    assert store.in_use() == {2, 4}
    assert store.prune(keep_last=2) == [1, 3, 5]
    assert store.steps() == [2, 4, 6, 7]
    store.set_in_use("orchestrator", [])
    store.set_in_use("eval", [])
    assert store.prune(keep_last=1) == [2, 4, 6]
    assert store.steps() == [7]  # the latest always survives
    with pytest.raises(ValueError):
        store.prune(keep_last=0)
    with pytest.raises(ValueError, match="holder"):
        store.set_in_use("../escape", [1])


def test_prune_removes_only_stale_unlocked_temp_folders(store):
    store.publish(1, writer())
    old = time.time() - 3600
    abandoned = store.root / ".tmp-step_2-dead"
    abandoned.mkdir()
    (abandoned / "model.safetensors").write_bytes(b"half")
    fresh = store.root / ".tmp-step_3-fresh"
    fresh.mkdir()
    locked = store.root / ".tmp-step_4-alive"
    locked.mkdir()
    for folder in (abandoned, locked):
        for path in (*folder.iterdir(), folder):
            os.utime(path, (old, old))
    fd = os.open(locked, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a publisher that is alive but slow
        store.prune(keep_last=1)
    finally:
        os.close(fd)
    assert not abandoned.exists()
    assert fresh.exists() and locked.exists()
    assert store.steps() == [1]


SLOW_PUBLISHER = """
import sys, time
from pathlib import Path
from gyre.weights import WeightStore

store = WeightStore(sys.argv[1])
first = int(sys.argv[2])
chunk = bytes(range(256)) * 256  # 64 KiB

def write(folder: Path) -> None:
    for i in range(4):
        with open(folder / f"model-{i:05d}-of-00004.safetensors", "wb") as f:
            for _ in range(6):
                f.write(chunk)
                f.flush()
                time.sleep(0.004)
    (folder / "config.json").write_text('{"step": %d}' % step)

step = first
print("ready", flush=True)
while True:
    store.publish(step, write)
    print(step, flush=True)
    step += 1
"""


def test_publish_killed_at_random_moments_never_exposes_a_partial_version(tmp_path):
    store = WeightStore(tmp_path / "weights", stale_tmp_s=0)
    rng = random.Random(1234)
    leftovers = 0
    for _round in range(8):
        first = (store.latest() or 0) + rng.choice([0, 1])  # sometimes replace the latest version
        child = subprocess.Popen(
            [sys.executable, "-c", SLOW_PUBLISHER, str(store.root), str(first)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert child.stdout.readline() == b"ready\n"  # random kill times count from here, not from a loaded start
        time.sleep(rng.uniform(0.1, 0.9))
        child.send_signal(signal.SIGKILL)
        _, err = child.communicate(timeout=30)
        assert child.returncode == -signal.SIGKILL, err.decode()
        leftovers += sum(p.name.startswith(".tmp-") for p in store.root.iterdir()) if store.root.exists() else 0
        for step in store.steps():
            manifest = store.verify(step)  # every listed version is complete and intact
            assert len(manifest.files) == 5
        latest = store.latest()
        if latest is not None:
            assert latest in store.steps()
            store.verify(latest, store.digest(latest))
    assert store.steps(), "no publish finished at all: the test did not exercise anything"
    assert leftovers > 0, "no kill landed mid-publish: the test did not exercise anything"
    store.prune(keep_last=100)  # the dead publishers' temp folders are stale and unlocked
    assert not [p for p in store.root.iterdir() if p.name.startswith(".tmp-")]


def test_commit_dir_replaces_a_folder_atomically_and_leaves_no_temp(tmp_path):
    from gyre.fsio import commit_dir

    final = tmp_path / "model"
    for content in (b"old", b"new"):
        tmp = tmp_path / f".tmp-model-{content.decode()}"
        (tmp / "sub").mkdir(parents=True)
        (tmp / "sub" / "weights.bin").write_bytes(content)
        assert commit_dir(tmp, final) == final
        assert (final / "sub" / "weights.bin").read_bytes() == content
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
