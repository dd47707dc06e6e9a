"""verifiers' `StatefulToolEnv` in an environment ported with `import gyre.envs as vf`
(tests/verifiers_envs/vf_hub_stateful_tools.py): `vf.StatefulToolEnv` was refused with a pointer to `ToolEnv`.

The policy's turns come from the scripted model client (envs_doubles.py), which makes the tool call under test
exactly (a tiny real model would not reliably write a given argument, least of all a hidden one).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from envs_doubles import Reply, ScriptedClient
from gyre.envs import ToolCall, load_environment

VF_ENVS = Path(__file__).resolve().parents[2] / "verifiers_envs"


@pytest.fixture(autouse=True)
def vf_envs_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(VF_ENVS))


def vault_call(arguments: dict) -> Reply:
    return Reply("", tool_calls=[ToolCall(id="call_1", name="lookup", arguments=arguments,
                                          raw_arguments=json.dumps(arguments))])  # fmt: skip


@pytest.mark.asyncio
async def test_a_stateful_tool_env_fills_a_hidden_argument_from_the_state(sampling):
    env = load_environment("vf_hub_stateful_tools:load_environment")
    task = env.tasks("eval")[0]
    client = ScriptedClient([vault_call({"key": "door"}), Reply("The code is 4711.")])
    rollout = await env.rollout(client, task, sampling)
    # the model's schema has no vault_id: only the key
    (schema,) = client.calls[0]["tools"]
    assert schema["function"]["name"] == "lookup"
    assert schema["function"]["parameters"]["properties"].keys() == {"key"}
    assert schema["function"]["parameters"]["required"] == ["key"]
    assert "vault_id" not in json.dumps(client.calls[0]["tools"])
    assert rollout.error is None and rollout.completion[1] == {"role": "tool", "tool_call_id": "call_1",
                                                              "content": "4711"}  # fmt: skip
    assert rollout.state["tool_calls"][0]["arguments"] == {"key": "door"}  # as the model made it
    assert (await env.score(task, rollout)).reward == 1.0


@pytest.mark.asyncio
async def test_a_model_written_value_for_a_skipped_argument_cannot_override_the_state(sampling):
    """The environment's update_tool_args keeps a value already in the arguments (setdefault): the model's guess at
    the hidden vault_id is dropped before it, so another vault is never read."""
    env = load_environment("vf_hub_stateful_tools:load_environment")
    task = env.tasks("eval")[0]
    client = ScriptedClient([vault_call({"key": "door", "vault_id": "beta"}), Reply("4711")])
    rollout = await env.rollout(client, task, sampling)
    assert rollout.completion[1]["content"] == "4711"  # vault alpha's (the state's), not beta's 0000


def test_stateful_tool_env_refuses_what_would_expose_or_lose_an_argument():
    import gyre.envs as vf

    class NoUpdate(vf.StatefulToolEnv):
        pass

    with pytest.raises(TypeError, match="NoUpdate: a StatefulToolEnv defines update_tool_args"):
        NoUpdate(tools=[], eval_dataset=[{"question": "q", "answer": "a"}])

    class Old(vf.StatefulToolEnv):  # verifiers 0.1.3-0.1.4: no tool_name
        def update_tool_args(self, tool_args, messages, state, **kwargs):
            return {**tool_args, "vault_id": "alpha"}

    env = Old(tools=[], eval_dataset=[{"question": "q", "answer": "a"}])
    with pytest.raises(ValueError, match=r"args_to_skip \['vault'\] are not parameters of the tool"):
        env.add_tool(_lookup(), args_to_skip=["vault"])
    env.add_tool(_lookup(), args_to_skip="vault_id")
    assert env.tool_schemas[0]["function"]["parameters"]["required"] == ["key"]
    assert not env._with_name


def _lookup():
    from vf_hub_stateful_tools import lookup

    return lookup
