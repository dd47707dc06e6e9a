"""Wire codec of `TrainBatch`: msgpack with raw numpy buffers (no pickle, no JSON for arrays).

Layout (a msgpack map, schema version `SCHEMA_VERSION`):

    {"schema": 1, "step": int, "created": float, "temperature": float, "num_loss_tokens": int, "num_samples": int,
     "max_tokens": int (optional, 0 when absent),
     "samples": [ {json-able metadata}, ... ],
     "micro_batches": [ [ {field: {"dtype": "<i4", "shape": [T], "data": bytes}, ...}, ... ], ... ]}

A micro batch's map holds every `ARRAY_FIELDS` entry plus the optional per-token arrays it carries
(`OPTIONAL_TOKEN_FIELDS`, e.g. `teacher_logprobs`); batches written before those existed decode unchanged.

Arrays are stored as little-endian dtype strings plus raw bytes, so decoding is a zero-parse
`np.frombuffer` (copied once so the result is writable and independent of the input buffer).
Decoding never trusts the input: anything malformed raises `CodecError`, never a bare
KeyError/TypeError, and a decoded batch has passed `TrainBatch.validate()`.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from gyre.batch import ARRAY_FIELDS, OPTIONAL_TOKEN_FIELDS, BatchError, MicroBatch, TrainBatch

SCHEMA_VERSION = 1

_TOP_KEYS = {
    "schema", "step", "created", "temperature", "num_loss_tokens", "num_samples", "samples", "micro_batches"
}  # fmt: skip
_OPTIONAL_KEYS = {"max_tokens"}  # added after schema 1 shipped: batches without it still decode


class CodecError(ValueError):
    """The bytes are not a valid encoded `TrainBatch`; `reason` says why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _encode_array(arr: np.ndarray, dtype: np.dtype) -> dict[str, Any]:
    arr = np.ascontiguousarray(arr, dtype=dtype.newbyteorder("<"))
    return {"dtype": arr.dtype.str, "shape": list(arr.shape), "data": arr.tobytes()}


def _encode_micro_batch(mb: MicroBatch) -> dict[str, Any]:
    fields = {name: _encode_array(getattr(mb, name), dtype) for name, dtype in ARRAY_FIELDS.items()}
    for name in mb.optional_fields:
        fields[name] = _encode_array(getattr(mb, name), OPTIONAL_TOKEN_FIELDS[name])
    return fields


def encode_batch(batch: TrainBatch) -> bytes:
    """Validate `batch` and encode it; raises `CodecError` if it violates the schema."""
    try:
        batch.validate()
    except BatchError as e:
        raise CodecError(f"cannot encode invalid batch: {e}") from None
    doc = {
        "schema": SCHEMA_VERSION,
        "step": batch.step,
        "created": float(batch.created),
        "temperature": float(batch.temperature),
        "num_loss_tokens": batch.num_loss_tokens,
        "num_samples": batch.num_samples,
        "max_tokens": batch.max_tokens,
        "samples": batch.samples,
        "micro_batches": [[_encode_micro_batch(mb) for mb in rank] for rank in batch.micro_batches],
    }
    try:
        return msgpack.packb(doc, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        # e.g. sample metadata holding a non-serialisable object
        raise CodecError(f"cannot encode batch: {e}") from None


def _decode_array(name: str, obj: Any, dtype: np.dtype) -> np.ndarray:
    if not isinstance(obj, dict) or set(obj) != {"dtype", "shape", "data"}:
        raise CodecError(f"{name}: expected a map with dtype, shape and data")
    expected = dtype.newbyteorder("<").str
    if obj["dtype"] != expected:
        raise CodecError(f"{name}: dtype {obj['dtype']!r}, expected {expected!r}")
    shape, data = obj["shape"], obj["data"]
    if not (isinstance(shape, list) and len(shape) == 1 and isinstance(shape[0], int) and shape[0] >= 0):
        raise CodecError(f"{name}: shape {shape!r}, expected a 1-D shape")
    if not isinstance(data, bytes):
        raise CodecError(f"{name}: data must be bytes, got {type(data).__name__}")
    if len(data) != shape[0] * dtype.itemsize:
        raise CodecError(f"{name}: {len(data)} bytes do not hold shape {shape} of {expected}")
    return np.frombuffer(data, dtype=expected).astype(dtype, copy=True)


def _require_int(doc: dict, key: str) -> int:
    value = doc[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise CodecError(f"{key}: expected int, got {type(value).__name__}")
    return value


def decode_batch(data: bytes) -> TrainBatch:
    """Decode and validate; raises `CodecError` on anything malformed (never returns a bad batch)."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise CodecError(f"expected bytes, got {type(data).__name__}")
    try:
        doc = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises a zoo of types (ExtraData, FormatError, ValueError, ...)
        raise CodecError(f"not a msgpack document: {type(e).__name__}: {e}") from None
    if not isinstance(doc, dict):
        raise CodecError(f"expected a map at top level, got {type(doc).__name__}")
    if "schema" not in doc:
        raise CodecError("missing key 'schema'")
    if doc["schema"] != SCHEMA_VERSION:
        raise CodecError(f"schema version {doc['schema']!r} is not supported (expected {SCHEMA_VERSION})")
    missing = _TOP_KEYS - set(doc)
    if missing:
        raise CodecError(f"missing keys {sorted(missing)}")
    unknown = set(doc) - _TOP_KEYS - _OPTIONAL_KEYS
    if unknown:
        raise CodecError(f"unknown keys {sorted(unknown)}")
    created, temperature = doc["created"], doc["temperature"]
    for key, value in (("created", created), ("temperature", temperature)):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise CodecError(f"{key}: expected a number, got {type(value).__name__}")
    if not isinstance(doc["samples"], list):
        raise CodecError("samples: expected a list")
    ranks = doc["micro_batches"]
    if not isinstance(ranks, list) or not all(isinstance(rank, list) for rank in ranks):
        raise CodecError("micro_batches: expected a list of lists")
    micro_batches = []
    for r, rank in enumerate(ranks):
        decoded = []
        for i, mb in enumerate(rank):
            where = f"micro_batches[{r}][{i}]"
            if not isinstance(mb, dict):
                raise CodecError(f"{where}: expected a map")
            if not set(ARRAY_FIELDS) <= set(mb) <= set(ARRAY_FIELDS) | set(OPTIONAL_TOKEN_FIELDS):
                raise CodecError(f"{where}: fields {sorted(mb)}, expected {sorted(ARRAY_FIELDS)} and optionally "
                                 f"{sorted(OPTIONAL_TOKEN_FIELDS)}")  # fmt: skip
            optional = {name: dtype for name, dtype in OPTIONAL_TOKEN_FIELDS.items() if name in mb}
            wanted = {**ARRAY_FIELDS, **optional}
            arrays = {name: _decode_array(f"{where}.{name}", mb[name], dtype) for name, dtype in wanted.items()}
            decoded.append(MicroBatch(**arrays))
        micro_batches.append(decoded)
    batch = TrainBatch(
        step=_require_int(doc, "step"),
        micro_batches=micro_batches,
        samples=doc["samples"],
        num_loss_tokens=_require_int(doc, "num_loss_tokens"),
        num_samples=_require_int(doc, "num_samples"),
        max_tokens=_require_int(doc, "max_tokens") if "max_tokens" in doc else 0,
        created=float(created),
        temperature=float(temperature),
    )
    try:
        return batch.validate()
    except BatchError as e:
        raise CodecError(str(e)) from None
