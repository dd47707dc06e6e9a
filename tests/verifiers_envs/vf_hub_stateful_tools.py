"""An environment as verifiers 0.1-0.3 writes it, ported to Gyre by one line (`import gyre.envs as vf` where it
had `import verifiers as vf`); everything below it is verifiers code as such an environment writes it: a
`vf.StatefulToolEnv` whose tool takes a `vault_id` the model never sees, set in `setup_state` from the row's info
and filled in by `update_tool_args`.

Load with `env.name = "vf_hub_stateful_tools:load_environment"` with this folder on PYTHONPATH.
"""

import gyre.envs as vf  # the port: `import verifiers as vf` in the hub's copy

VAULTS = {"alpha": {"door": "4711"}, "beta": {"door": "0000"}}


def lookup(key: str, vault_id: str) -> str:
    """Read a key from the vault.

    Args:
        key: the key to read, e.g. "door"
        vault_id: the vault to read it from
    """
    return VAULTS[vault_id][key]


class VaultEnv(vf.StatefulToolEnv):
    def __init__(self, **kwargs):
        super().__init__(tools=[], **kwargs)
        self.add_tool(lookup, args_to_skip=["vault_id"])

    async def setup_state(self, state, **kwargs):
        state["vault_id"] = state["info"]["vault"]
        return state

    def update_tool_args(self, tool_name, tool_args, messages, state, **kwargs) -> dict:
        if tool_name == "lookup":
            tool_args.setdefault("vault_id", state["vault_id"])  # a value already there is kept
        return tool_args


def load_environment(**kwargs) -> vf.Environment:
    rows = [{"question": "What is the door code?", "answer": "4711", "info": {"vault": "alpha"}}]

    def code_reward(completion, answer) -> float:
        return float(answer in (completion[-1].get("content") or ""))

    return VaultEnv(eval_dataset=rows, rubric=vf.Rubric(funcs=[code_reward]), max_turns=3, **kwargs)
