"""`gyre.safetensors_io`: the weights path's own safetensors writer and reader agree with the library."""

from __future__ import annotations

import json

import pytest
import torch
from gyre.safetensors_io import SafetensorsError, read_safetensors, safetensors_chunks
from safetensors.torch import load, load_file, save, save_file

TENSORS = {
    "w": torch.randn(3, 5), "b16": torch.randn(7, dtype=torch.bfloat16), "ids": torch.arange(3),
    "flag": torch.tensor([True, False]), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4),
    "half": torch.randn(2, 2, dtype=torch.float16), "i8": torch.tensor([-3, 4], dtype=torch.int8),
}  # fmt: skip


def test_streamed_safetensors_are_the_bytes_safetensors_writes():
    data = b"".join(bytes(c) for c in safetensors_chunks(TENSORS, {"format": "pt"}))
    assert data == save(TENSORS, metadata={"format": "pt"})
    assert all(torch.equal(load(data)[k], t) for k, t in TENSORS.items())
    with pytest.raises(ValueError, match="tensor t: cannot write"):
        safetensors_chunks({"t": torch.randn(4, 4).t()})  # not contiguous


def _same(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and ours[name].shape == tensor.shape, name
        assert torch.equal(ours[name], tensor), name


def test_read_equals_the_library(tmp_path):
    from gyre.model_init import init_model

    save_file(TENSORS, tmp_path / "all.safetensors", metadata={"format": "pt"})
    _same(read_safetensors(tmp_path / "all.safetensors"), load_file(tmp_path / "all.safetensors"))
    weights = init_model(tmp_path / "tiny", preset="tiny", seed=0) / "model.safetensors"
    _same(read_safetensors(weights), load_file(weights))


def _handmade(path, entries: dict, payload: bytes, pad: bool = True) -> None:
    """A safetensors file written by hand (other writers need not align tensors)."""
    header = json.dumps(entries).encode()
    if pad:
        header += b" " * (-len(header) % 8)
    path.write_bytes(len(header).to_bytes(8, "little") + header + payload)


def test_unaligned_tensors_are_read_correctly(tmp_path):
    # a 1-byte tensor first puts the float32 after it at offset 1: valid, but not viewable in place
    value = torch.tensor([1.5, -2.0, 3.25])
    entries = {"u": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
               "f": {"dtype": "F32", "shape": [3], "data_offsets": [1, 13]}}  # fmt: skip
    _handmade(tmp_path / "odd.safetensors", entries, bytes([7]) + value.numpy().tobytes())
    read = read_safetensors(tmp_path / "odd.safetensors")
    _same(read, load_file(tmp_path / "odd.safetensors"))
    assert torch.equal(read["f"], value)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p.write_bytes(b"\x01\x02"), "shorter than a safetensors header"),
        (lambda p: p.write_bytes((1000).to_bytes(8, "little") + b"{}"), "does not fit"),
        (lambda p: p.write_bytes((4).to_bytes(8, "little") + b"[1]  "), "not a JSON object"),
        (lambda p: p.write_bytes((8).to_bytes(8, "little") + b"not json"), "malformed safetensors header"),
        (
            lambda p: _handmade(p, {"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8),
            "data_offsets",
        ),
        (
            lambda p: _handmade(p, {"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, b"\0" * 16),
            "data_offsets",
        ),
        (lambda p: _handmade(p, {"x": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 1]}}, b"\0" * 8), "KeyError"),
        (lambda p: _handmade(p, {"x": {"shape": [1], "data_offsets": [0, 4]}}, b"\0" * 8), "KeyError"),
    ],
    ids=["tiny", "header-too-long", "not-object", "not-json", "truncated-data", "wrong-size", "dtype", "no-dtype"],
)
def test_malformed_files_name_the_file_and_the_defect(tmp_path, make, message):
    path = tmp_path / "bad.safetensors"
    make(path)
    with pytest.raises(SafetensorsError, match=message) as raised:
        read_safetensors(path)
    assert str(path) in str(raised.value)
