"""Response bodies and stream events encoded with orjson (json_body.py): the same JSON values json.dumps gives."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gyre_inference.json_body import FastJSONResponse, dumps


def test_bodies_decode_to_what_was_encoded_with_text_as_utf8():
    payload = {"text": "héllo 世界 \U0001f600", "logprob": -0.25, "ids": [1, 2], "top": [("a", -1.5)], "none": None}
    body = FastJSONResponse(payload).body
    assert json.loads(body) == json.loads(json.dumps(payload))  # tuples as arrays, as json.dumps
    assert "世界".encode() in body  # characters as they are, not \\u escapes (json.dumps(ensure_ascii=False))
    assert json.loads(dumps(payload)) == json.loads(body.decode())


def test_numpy_scalars_encode_as_numbers_and_other_objects_fail_clearly():
    assert json.loads(dumps({"score": np.float32(0.5), "n": np.int64(3)})) == {"score": 0.5, "n": 3}
    with pytest.raises(TypeError, match="not JSON serializable"):
        dumps({"x": object()})
