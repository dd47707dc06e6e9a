"""`gyre.safetensors_io`: the copy-free writer and reader agree with the `safetensors` library byte for byte."""

from __future__ import annotations

import json

import pytest
import torch
from gyre.safetensors_io import SafetensorsError, map_safetensors, read_header, safetensors_chunks
from safetensors.torch import load, load_file, save, save_file


def _every_dtype() -> dict[str, torch.Tensor]:
    # every dtype family, several of one size (safetensors orders them by its dtype enum, then name), a scalar
    # and an empty tensor
    return {
        "w": torch.randn(3, 5), "b16": torch.randn(7, dtype=torch.bfloat16), "ids": torch.arange(3),
        "flag": torch.tensor([True, False]), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4),
        "half": torch.randn(2, 2, dtype=torch.float16), "i8": torch.tensor([-3, 4], dtype=torch.int8),
        "f64": torch.randn(2, dtype=torch.float64),
    }  # fmt: skip


def test_streamed_safetensors_are_the_bytes_safetensors_writes():
    tensors = _every_dtype()
    data = b"".join(bytes(c) for c in safetensors_chunks(tensors, {"format": "pt"}))
    assert data == save(tensors, metadata={"format": "pt"})
    assert all(torch.equal(load(data)[k], t) for k, t in tensors.items())
    with pytest.raises(ValueError, match="tensor t: cannot write"):
        safetensors_chunks({"t": torch.randn(4, 4).t()})  # not contiguous


def test_a_mapped_file_reads_as_the_library_reads_it_and_stays_private(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(_every_dtype(), str(path), metadata={"format": "pt"})
    before = path.read_bytes()
    expected = load_file(path)
    mapped = map_safetensors(path)
    header = read_header(path)  # the header alone: every tensor's dtype and shape, no metadata
    assert {name: tuple(entry["shape"]) for name, entry in header.items()} == {
        name: tuple(t.shape) for name, t in expected.items()
    }
    assert mapped.keys() == expected.keys()
    for name, tensor in expected.items():
        assert mapped[name].dtype == tensor.dtype and mapped[name].shape == tensor.shape
        assert torch.equal(mapped[name], tensor), name
    # copy-on-write: the tensors can be written (no read-only warnings downstream), the file never changes
    mapped["w"].add_(1.0)
    assert torch.equal(mapped["w"], expected["w"] + 1.0) and path.read_bytes() == before
    # the tensors keep the mapping alive on their own
    w = mapped["ids"]
    del mapped
    assert torch.equal(w, torch.arange(3))


def _header_file(path, header: dict, data: bytes = b"") -> None:
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("short", "shorter than a safetensors header"),
        ("long-header", "header of"),
        ("not-json", "not JSON"),
        ("list", "not a JSON object"),
        ("dtype", "malformed entry"),
        ("outside", "do not fit"),
        ("size", "do not fit"),
    ],
)
def test_a_malformed_file_is_refused_with_the_reason(tmp_path, case, reason):
    path = tmp_path / "bad.safetensors"
    four_floats = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
    if case == "short":
        path.write_bytes(b"\x01")
    elif case == "long-header":
        path.write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    elif case == "not-json":
        path.write_bytes((4).to_bytes(8, "little") + b"{{{{")
    elif case == "list":
        _header_file(path, [1, 2])  # type: ignore[arg-type]
    elif case == "dtype":
        _header_file(path, {"t": {**four_floats, "dtype": "F7"}}, bytes(16))
    elif case == "outside":
        _header_file(path, {"t": four_floats}, bytes(8))  # the data stops half way
    else:
        _header_file(path, {"t": {**four_floats, "shape": [5]}}, bytes(16))  # 16 bytes for 5 floats
    with pytest.raises(SafetensorsError, match=reason):
        map_safetensors(path)
    if case in ("short", "long-header", "not-json", "list"):  # what the header alone can tell
        with pytest.raises(SafetensorsError, match=reason):
            read_header(path)
