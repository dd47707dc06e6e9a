"""Environment API (torch-free): tasks, rollouts against a `ModelClient`, parsers, rubrics, built-ins.

See docs/environments.md. The orchestrator's side of the contract:

    env = load_environment(cfg.env.name, **cfg.env.args)
    source = env.tasks("train", seed=cfg.seed)            # source[i]: deterministic, index-addressable
    rollout = await env.rollout(client, source[i], SamplingParams(**cfg.sampling.model_dump()))
    score = await env.score(source[i], rollout)           # Score(reward, per_function, errors)
    # train on rollout.token_ids / loss_mask / logprobs (see gyre.envs.sequence for the multi-turn rule)
"""

from gyre.envs.base import Environment, MultiTurnEnv, SingleTurnEnv
from gyre.envs.parsers import (
    MaybeThinkParser,
    Parser,
    ThinkParser,
    XMLParser,
    extract_boxed_answer,
    parse_tool_calls,
)
from gyre.envs.registry import BUILTIN_ENVIRONMENTS, EnvironmentLoadError, load_environment
from gyre.envs.rubric import MathRubric, Rubric, RubricGroup
from gyre.envs.sequence import SequenceBuilder
from gyre.envs.splits import TaskSource
from gyre.envs.tools import StatefulToolEnv, Tool, ToolEnv
from gyre.envs.types import (
    ContextLengthExceeded,
    Info,
    Message,
    Messages,
    ModelClient,
    Rollout,
    SamplingParams,
    Score,
    ScoringError,
    Split,
    State,
    StopReason,
    Task,
    ToolCall,
    Turn,
)

__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "ContextLengthExceeded",
    "Environment",
    "EnvironmentLoadError",
    "Info",
    "JudgeRubric",
    "MathRubric",
    "MaybeThinkParser",
    "Message",
    "Messages",
    "ModelClient",
    "MultiTurnEnv",
    "Parser",
    "Rollout",
    "Rubric",
    "RubricGroup",
    "SamplingParams",
    "Score",
    "ScoringError",
    "SequenceBuilder",
    "SingleTurnEnv",
    "Split",
    "State",
    "StatefulToolEnv",
    "StopReason",
    "Task",
    "TaskSource",
    "ThinkParser",
    "Tool",
    "ToolCall",
    "ToolEnv",
    "Turn",
    "XMLParser",
    "extract_boxed_answer",
    "load_environment",
    "parse_tool_calls",
]

#: verifiers (0.1-0.3) names a ported environment (`import gyre.envs as vf`) may use that Gyre does not have, and
#: what plays their part here: `vf.EnvGroup` was a bare "module has no attribute" (docs/environments.md, Porting).
#: `JudgeRubric` and `StatefulToolEnv` are provided (gyre.envs.judge_rubric, gyre.envs.tools).
VERIFIERS_INSTEAD = {
    "EnvGroup": "several [[orchestrator.env]] entries in the run's config (an orchestrator mix, docs/orchestrator.md)",
    "ToolRubric": "a reward function reading state['tool_calls'] (each executed call: name, arguments, ok, result)",
    "load_example_dataset": "the rows themselves: dataset=datasets.load_dataset(...) or a .jsonl/.parquet path",
}


def __getattr__(name: str):
    if name == "JudgeRubric":  # imported when used: it brings the openai client (gyre.endpoint)
        from gyre.envs.judge_rubric import JudgeRubric

        return JudgeRubric
    if name in VERIFIERS_INSTEAD:
        raise AttributeError(f"gyre.envs has no {name} (verifiers'); instead: {VERIFIERS_INSTEAD[name]} "
                             "(docs/environments.md, Porting a verifiers 0.1-0.3 environment)")  # fmt: skip
    raise AttributeError(f"module 'gyre.envs' has no attribute {name!r}")
