"""Property: for random JSON schemas from a bounded family, every constrained completion of the torch engine
(the tiny model, several temperatures, batched together) ends on its own and parses into a valid instance.

The family is bounded so every instance is finite: integers in ranges, booleans, nulls, string enums,
strings of at most 6 characters, arrays of at most 3 items, objects of 1-3 properties without additional
ones, and anyOf of two of these, nested at most two levels.
"""

from __future__ import annotations

import asyncio
import json
import threading

import jsonschema
import pytest
from gyre_inference.backend import SamplingParams
from gyre_inference.structured import Guide
from gyre_inference.torch_backend import TorchBackend
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

TEMPERATURES = (0.0, 0.7, 1.3)
NAMES = st.sampled_from(["a", "b", "id", "name", "x_1", "value"])

leaves = st.one_of(
    st.builds(
        lambda low, span: {"type": "integer", "minimum": low, "maximum": low + span},
        st.integers(-50, 50),
        st.integers(0, 100),
    ),  # fmt: skip
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(st.sampled_from(["red", "green", "blue", "x y", "é"]), min_size=1, max_size=3, unique=True).map(
        lambda values: {"enum": values}
    ),
    st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
)


def _objects(children):
    def build(properties, required_mask):
        names = list(properties)
        required = [n for n, keep in zip(names, required_mask, strict=False) if keep] or names[:1]
        return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}

    return st.builds(build, st.dictionaries(NAMES, children, min_size=1, max_size=3),
                     st.lists(st.booleans(), min_size=3, max_size=3))  # fmt: skip


def _extend(children):
    return st.one_of(
        _objects(children),
        st.builds(
            lambda items, most: {"type": "array", "items": items, "maxItems": most}, children, st.integers(0, 3)
        ),  # fmt: skip
        st.lists(children, min_size=2, max_size=2).map(lambda options: {"anyOf": options}),
    )


schemas = _objects(st.recursive(leaves, _extend, max_leaves=4))


@pytest.fixture(scope="module")
def engine(tiny_model, model_text):
    """The torch backend on its own event loop in a thread (hypothesis drives a plain function)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    backend = TorchBackend(tiny_model, threads=1, max_batch_size=8)
    asyncio.run_coroutine_threadsafe(backend.start(), loop).result()
    yield backend, loop
    asyncio.run_coroutine_threadsafe(backend.shutdown(), loop).result()
    loop.call_soon_threadsafe(loop.stop)
    thread.join()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=schemas, seed=st.integers(0, 2**31))
def test_every_constrained_completion_parses_and_validates(engine, model_text, schema, seed):
    backend, loop = engine
    grammars = model_text.grammars
    guide = Guide("json", schema)
    grammars.check(guide)
    prompt = model_text.encode("Reply in JSON:")

    async def sample(temperature):
        matcher = grammars.matcher(guide)
        params = SamplingParams(max_tokens=400, temperature=temperature, seed=seed, guide=guide,
                                stop_token_ids=model_text.eos_token_ids, constraint=matcher)  # fmt: skip
        return [e async for e in backend.generate(prompt, params)]

    async def all_temperatures():
        return await asyncio.gather(*(sample(t) for t in TEMPERATURES))

    for temperature, events in zip(TEMPERATURES, asyncio.run_coroutine_threadsafe(all_temperatures(), loop).result(),
                                   strict=True):  # fmt: skip
        tokens = [e.token_id for e in events]
        assert events[-1].finish_reason == "stop" and tokens[-1] in model_text.eos_token_ids, (temperature, schema)
        text = model_text.decode(tokens[:-1])
        jsonschema.validate(json.loads(text), schema)
