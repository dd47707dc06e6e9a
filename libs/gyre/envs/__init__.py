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
from gyre.envs.tools import Tool, ToolEnv
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
