"""SamplingParams: the per-request settings every environment receives (frozen, so usable as a key)."""

import pytest
from gyre.envs import SamplingParams


def test_params_with_template_kwargs_hash_like_equal_params():
    # a frozen dataclass promises a hash; the dict field made hash() raise TypeError (an environment with a cache
    # keyed by its sampling params crashed once chat_template_kwargs was set)
    a = SamplingParams(max_tokens=32, chat_template_kwargs={"enable_thinking": False})
    b = SamplingParams(max_tokens=32, chat_template_kwargs={"enable_thinking": False})
    assert a == b and hash(a) == hash(b)
    assert {a: "cached"}[b] == "cached"
    assert a != SamplingParams(max_tokens=32, chat_template_kwargs={"enable_thinking": True})


def test_editing_one_requests_template_kwargs_leaves_the_source_and_others_alone():
    shared = {"enable_thinking": False}
    params = SamplingParams(seed=7, chat_template_kwargs=shared)
    one, other = params.for_request(0, 1), params.for_request(0, 2)
    one.chat_template_kwargs["enable_thinking"] = True
    assert shared == {"enable_thinking": False}
    assert params.chat_template_kwargs == {"enable_thinking": False}
    assert other.chat_template_kwargs == {"enable_thinking": False}


def test_each_request_gets_its_own_reproducible_seed():
    params = SamplingParams(seed=3)
    assert params.for_request(1, 0).seed == params.for_request(1, 0).seed
    assert params.for_request(1, 0).seed != params.for_request(1, 1).seed
    assert SamplingParams().for_request(1, 0).seed is None


@pytest.mark.parametrize(
    "kwargs, field",
    [({"temperature": -0.1}, "temperature"), ({"top_p": 0}, "top_p"), ({"max_tokens": 0}, "max_tokens")],
)
def test_out_of_range_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
