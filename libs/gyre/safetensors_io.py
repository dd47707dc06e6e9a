"""The safetensors format on the weights path, written and read without per-tensor copies.

Format (https://github.com/huggingface/safetensors): 8 bytes little-endian header length N, N bytes of
JSON header ({name: {"dtype", "shape", "data_offsets": [begin, end]}, optional "__metadata__"}, padded
with spaces to a multiple of 8), then the tensors' bytes, offsets relative to the end of the header.

Why not `safetensors.torch.save`/`load_file` here: a weights swap is publish -> every replica serving,
every step. `save` first copies every tensor into one bytes object; `load_file` maps the file and pays
a page fault per 4 KiB page plus a per-tensor cost, 3-7 ms for 4.5 MB on a busy CPU, against 1-2 ms for
one `readinto`. Everything else (checkpoints, adapters, HF saves) keeps using the library. Both
functions here are tested byte for byte / tensor for tensor against it. torch is imported lazily:
`gyre` stays importable without it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# safetensors' dtype names, by torch dtype name, in the order of safetensors' own dtype enum: `save` writes
# tensors by that order (descending), then by name
DTYPES = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "float8_e5m2": "F8_E5M2", "float8_e4m3fn": "F8_E4M3",
    "int16": "I16", "float16": "F16", "bfloat16": "BF16", "int32": "I32", "float32": "F32", "float64": "F64",
    "int64": "I64",
}  # fmt: skip
_RANK = {name: rank for rank, name in enumerate(DTYPES)}


class SafetensorsError(ValueError):
    """A file that is not a well-formed safetensors file."""


def safetensors_chunks(tensors: dict[str, Any], metadata: dict[str, str] | None = None) -> list[Any]:
    """A safetensors file of contiguous CPU `tensors` as buffers: the header, then each tensor's own memory.

    The bytes are exactly what `safetensors.torch.save` produces (tensors ordered by dtype as safetensors
    orders them, then by name; header padded to 8 bytes), without first copying every tensor into one bytes object: the
    publisher writes and hashes the tensors' memory directly (`gyre.fsio.write_hashed`)."""
    import torch

    def rank(name: str) -> int:
        return _RANK.get(str(tensors[name].dtype).removeprefix("torch."), -1)

    order = sorted(tensors, key=lambda name: (-rank(name), name))
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    views, offset = [], 0
    for name in order:
        tensor = tensors[name]
        dtype = DTYPES.get(str(tensor.dtype).removeprefix("torch."))
        if dtype is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(
                f"tensor {name}: cannot write {tensor.dtype} on {tensor.device} (contiguous CPU tensors only)"
            )
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": dtype, "shape": list(tensor.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        if nbytes:
            views.append((tensor if tensor.dim() else tensor.reshape(1)).view(torch.uint8).numpy())  # no copy
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return [len(text).to_bytes(8, "little") + text, *views]


def read_safetensors(path: Path | str) -> dict[str, Any]:
    """Every tensor of the safetensors file `path`, as views of one CPU buffer filled by a single read.

    Raises SafetensorsError (naming the file and what is wrong) for a malformed file; nothing is
    returned half-read."""
    import torch

    by_name = {v: getattr(torch, k) for k, v in DTYPES.items()}
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        buffer = torch.empty(size, dtype=torch.uint8)  # not zero-filled: read over
        if size and f.readinto(memoryview(buffer.numpy())) != size:
            raise SafetensorsError(f"{path}: short read (the file changed while it was read)")
    if size < 8:
        raise SafetensorsError(f"{path}: {size} bytes, shorter than a safetensors header")
    length = int.from_bytes(bytes(buffer[:8].numpy()), "little")
    if length > size - 8:
        raise SafetensorsError(f"{path}: header of {length} bytes does not fit a {size}-byte file")
    try:
        header = json.loads(bytes(buffer[8 : 8 + length].numpy()))
        if not isinstance(header, dict):
            raise TypeError("the header is not a JSON object")
        header.pop("__metadata__", None)
        data = buffer[8 + length :]
        tensors = {}
        for name, meta in header.items():
            dtype = by_name[meta["dtype"]]
            shape = [int(d) for d in meta["shape"]]
            begin, end = (int(x) for x in meta["data_offsets"])
            numel = 1
            for d in shape:
                numel *= d
            if not 0 <= begin <= end <= data.numel() or end - begin != numel * dtype.itemsize:
                raise ValueError(f"tensor {name}: data_offsets {[begin, end]} do not hold {meta['dtype']}{shape}")
            raw = data[begin:end]
            if (8 + length + begin) % dtype.itemsize:  # valid but unaligned (other writers): copy to align
                raw = raw.clone()
            tensors[name] = raw.view(dtype).view(shape)
    except (ValueError, KeyError, TypeError, RuntimeError) as error:
        raise SafetensorsError(f"{path}: malformed safetensors header ({type(error).__name__}: {error})") from None
    return tensors
