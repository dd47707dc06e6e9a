"""safetensors files without copies: the trainer streams tensors' own memory into one, a replica maps one.

The format (https://huggingface.co/docs/safetensors): 8 bytes of little-endian header length, a JSON
header {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}} padded with
spaces to 8 bytes, then the tensors' bytes. The `safetensors` library reads and writes it through one
more full copy of every byte (`save` builds one bytes object, `load_file` copies out of its mapping):
per weight version, on the path from an optimizer step to every replica serving it, these two helpers
skip that copy. Both are checked against the library byte for byte (tests). Torch is imported lazily
(the orchestrator imports `gyre` without torch).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
from pathlib import Path
from typing import Any

# safetensors' dtype names, by torch dtype name, in the order of safetensors' own dtype enum: `save` writes
# tensors by that order (descending), then by name
_DTYPES = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "float8_e5m2": "F8_E5M2", "float8_e4m3fn": "F8_E4M3",
    "int16": "I16", "float16": "F16", "bfloat16": "BF16", "int32": "I32", "float32": "F32", "float64": "F64",
    "int64": "I64",
}  # fmt: skip
_RANK = {name: rank for rank, name in enumerate(_DTYPES)}


def safetensors_chunks(tensors: dict[str, Any], metadata: dict[str, str] | None = None) -> list[Any]:
    """A safetensors file of contiguous CPU `tensors` as buffers: the header, then each tensor's own memory.

    The bytes are exactly what `safetensors.torch.save` produces (tensors ordered by dtype as safetensors
    orders them, then by name; header padded to 8 bytes), without first copying every tensor into one
    bytes object: the publisher writes and hashes the tensors' memory directly (`gyre.fsio.write_hashed`)."""
    import torch

    def rank(name: str) -> int:
        return _RANK.get(str(tensors[name].dtype).removeprefix("torch."), -1)

    order = sorted(tensors, key=lambda name: (-rank(name), name))
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    views, offset = [], 0
    for name in order:
        tensor = tensors[name]
        dtype = _DTYPES.get(str(tensor.dtype).removeprefix("torch."))
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


_MADV_POPULATE_READ = 22  # linux/mman.h; Python 3.11's mmap module does not name it


class SafetensorsError(ValueError):
    """A file that is not a well-formed safetensors file."""


def _parse_header(path: Path, size: int, read) -> tuple[int, dict[str, Any]]:
    """(where the data starts, {tensor name: entry}) of a safetensors file of `size` bytes; `read(a, b)`
    returns its bytes a..b. SafetensorsError names what is malformed."""
    if size < 8:
        raise SafetensorsError(f"{path}: {size} bytes, shorter than a safetensors header")
    header_len = int.from_bytes(read(0, 8), "little")
    data_start = 8 + header_len
    if data_start > size:
        raise SafetensorsError(f"{path}: header of {header_len} bytes in a file of {size}")
    try:
        header = json.loads(read(8, data_start))
    except (UnicodeDecodeError, ValueError) as error:
        raise SafetensorsError(f"{path}: header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header is not a JSON object")
    header.pop("__metadata__", None)
    return data_start, header


def read_header(path: Path | str) -> dict[str, Any]:
    """{tensor name: {"dtype", "shape", "data_offsets"}} of a safetensors file, from its header alone
    (no torch, nothing else read). SafetensorsError names what is malformed; OSError as `open`."""
    path = Path(path)
    with path.open("rb") as f:

        def read(begin: int, end: int) -> bytes:
            f.seek(begin)
            return f.read(end - begin)

        return _parse_header(path, os.fstat(f.fileno()).st_size, read)[1]


def map_safetensors(path: Path | str) -> dict[str, Any]:
    """The tensors of a safetensors file as CPU tensors over one private mapping of it, pages faulted in at
    once (`MADV_POPULATE_READ`): no copy of the bytes, where `safetensors.torch.load_file` copies every tensor
    out of its own mapping. The tensors are copy-on-write (writing one never reaches the file) and keep
    the mapping alive. For files nobody rewrites in place (weight versions are new files each step).
    SafetensorsError names what is malformed."""
    import torch

    path = Path(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size < 8:  # an empty file cannot be mapped: the header check says why it is refused
            _parse_header(path, size, None)
        mapped = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    # fault every page in now, for reading (MAP_POPULATE would fault a writable mapping for writing: a copy);
    # before Linux 5.14, or elsewhere, pages fault in as they are read
    with contextlib.suppress(OSError, ValueError):
        mapped.madvise(_MADV_POPULATE_READ)
    data_start, header = _parse_header(path, size, lambda begin, end: mapped[begin:end])
    dtypes = {name: getattr(torch, dtype) for dtype, name in _DTYPES.items()}
    tensors = {}
    for name, info in header.items():
        try:
            dtype = dtypes[info["dtype"]]
            shape = [int(n) for n in info["shape"]]
            begin, end = (int(n) for n in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"{path}: tensor {name!r} has a malformed entry {info!r}") from None
        numel = 1
        for n in shape:
            numel *= n
        if min(shape, default=0) < 0 or not 0 <= begin <= end <= size - data_start or \
                end - begin != numel * dtype.itemsize:  # fmt: skip
            raise SafetensorsError(f"{path}: tensor {name!r} has offsets {[begin, end]} that do not fit {info}")
        if numel == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
        else:
            tensors[name] = torch.frombuffer(mapped, dtype=dtype, count=numel, offset=data_start + begin).view(shape)
    return tensors
