"""Environments: a task source, a rollout protocol and a rubric.

    env = load_environment("reverse_text")
    task = env.tasks("train", seed=0)[0]
    rollout = await env.rollout(client, task, SamplingParams(max_tokens=64))
    score = await env.score(task, rollout)

Subclass `SingleTurnEnv` (one model turn), `MultiTurnEnv` (implement `env_response`, the environment's reply
between model turns) or `gyre.envs.tools.ToolEnv` (the model calls Python functions), and implement
`make_task(rng, task_id)`. An environment object holds no per-rollout state (that lives in the `state` dict),
so one instance serves any number of concurrent rollouts.
"""

from __future__ import annotations

import copy
import inspect
import logging
import random
from functools import cached_property
from typing import Any

from gyre.envs.parsers import Parser
from gyre.envs.rows import RowTasks
from gyre.envs.rubric import Rubric
from gyre.envs.sequence import SequenceBuilder
from gyre.envs.splits import MAX_REDRAWS, TaskSource, distinct_tasks, listed_tasks
from gyre.envs.types import (
    ContextLengthExceeded,
    Messages,
    ModelClient,
    Rollout,
    SamplingParams,
    Score,
    Split,
    StopReason,
    Task,
    Turn,
)

log = logging.getLogger(__name__)


class Environment:
    """Base class. Constructor args shared by every environment:

    - `system_prompt`: prepended to every prompt by `format_prompt` (None = no system message).
    - `message_type` ("chat", the only kind) and `sampling_args` (logged as not applied: sampling is the run's
      `[orchestrator.sampling]`): verifiers' arguments, accepted so a ported environment loads.
    - `few_shot`: example messages (`{"role", "content"}` dicts, e.g. a user question and the assistant's reply)
      `format_prompt` puts between the system prompt and the question, as verifiers' `few_shot` does.
    - `num_eval`: size of the held-out eval split; `eval_seed`: which held-out set it is.
    - `max_turns`: model turns per rollout.
    - `dataset` (a `.jsonl`/`.parquet` path or a list of row dicts), `eval_dataset`, `prompt_key`, `answer_key`,
      `split_key`: the tasks are the rows (`gyre.envs.dataset.RowTasks`: every row's fields in `task.info`)
      instead of `make_task` draws.

    Splits: "eval" is a fixed set of `num_eval` distinct tasks (independent of the `seed` argument, so eval scores
    compare across runs); "train" is endless, drawn from `seed`, and never contains an eval task (a draw that
    collides is redrawn), so the splits are disjoint for every pair of seeds.
    """

    name = "environment"

    def __init__(
        self,
        *,
        system_prompt: str | None = None,
        few_shot: list[dict[str, Any]] | None = None,
        parser: Parser | None = None,
        rubric: Rubric | None = None,
        max_turns: int = 1,
        num_eval: int = 256,
        eval_seed: int = 1234,
        tool_schemas: list[dict[str, Any]] | None = None,
        dataset: Any = None,
        eval_dataset: Any = None,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        split_key: str = "split",
        message_type: str = "chat",
        sampling_args: dict[str, Any] | None = None,
    ) -> None:
        if message_type != "chat":  # verifiers' text-completion environments: prompts and replies are plain text
            raise ValueError(
                f"message_type={message_type!r}: Gyre environments are chat (messages in, an assistant "
                "message out); a 'completion' (plain text) environment needs its prompt as a user message"
            )
        if sampling_args:  # a ported environment's own sampling (verifiers applies it per request); here the run's
            log.warning("%s: sampling_args %s are not applied: sampling is the run's [orchestrator.sampling] "
                        "(temperature, top_p, max_tokens, ...)", type(self).__name__, sampling_args)  # fmt: skip
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if num_eval < 1:
            raise ValueError(f"num_eval must be >= 1, got {num_eval}")
        self.system_prompt = system_prompt
        self.few_shot = _checked_few_shot(few_shot)
        self.parser = parser or Parser()
        self.rubric = rubric or Rubric(parser=self.parser)
        self.max_turns = max_turns
        self.num_eval = num_eval
        self.eval_seed = eval_seed
        # OpenAI function schemas sent with every model turn (and needed to render SFT examples).
        self.tool_schemas = tool_schemas
        # The tasks of a dataset (a verifiers user's `ToolEnv(dataset=...)`): a .jsonl/.parquet path or a list of
        # rows, split and checked as the `dataset` environment's (gyre.envs.dataset); make_task is then not needed.
        # Without it, a multi-turn or tool environment over a file had to draw rows in make_task with replacement,
        # and num_eval (256) past the file's size failed as "the task space is too small".
        # An eval_dataset alone (a verifiers benchmark environment: AIME, GPQA) is an eval-only environment: `gyre
        # eval` runs it; training on it is refused when the train split is asked for.
        self.row_tasks = None
        if dataset is not None or eval_dataset is not None:
            self.row_tasks = RowTasks(self, dataset, eval_dataset, prompt_key=prompt_key, answer_key=answer_key,
                                 split_key=split_key)  # fmt: skip

    # --- tasks -----------------------------------------------------------------------------------------------

    def make_task(self, rng: random.Random, task_id: str) -> Task:
        """Draw one task using only `rng` (that is what makes the splits deterministic)."""
        raise NotImplementedError(f"{type(self).__name__} must implement make_task(rng, task_id)")

    def tasks(self, split: Split, seed: int = 0) -> TaskSource:
        if self.row_tasks is not None:
            if split == "train" and not self.row_tasks.train:
                raise ValueError(f"{self.name}: it has an eval_dataset only, no train rows: evaluate it (gyre eval), "
                                 "or give dataset= (the train rows) to train on it")  # fmt: skip
            return listed_tasks(self.row_tasks.train, self.row_tasks.eval, split, seed, self.name)
        if split == "eval":
            eval_tasks = self._eval_tasks
            return TaskSource(eval_tasks.__getitem__, len(eval_tasks))
        if split == "train":
            return TaskSource(lambda index: self._train_task(seed, index), None)
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")

    @cached_property
    def _eval_tasks(self) -> list[Task]:
        def draw(index: int, task_id: str) -> Task:
            return self.make_task(random.Random(f"{self.name}/eval/{self.eval_seed}/{index}"), task_id)

        return distinct_tasks(draw, self.num_eval, self.name, self.task_key)

    def task_key(self, task: Task) -> str:
        """What tells two tasks apart (eval tasks are distinct, train tasks are never eval tasks): the prompt
        (`Task.key`). Override where the prompt is the same for every task, e.g. `task.key + task.answer` for a
        guessing game whose secret is the answer."""
        return task.key

    @cached_property
    def _eval_keys(self) -> frozenset[str]:
        return frozenset(self.task_key(task) for task in self._eval_tasks)

    def _train_task(self, seed: int, index: int) -> Task:
        for attempt in range(MAX_REDRAWS):
            rng = random.Random(f"{self.name}/train/{seed}/{index}/{attempt}")
            task = self.make_task(rng, f"train-{seed}-{index}")
            if self.task_key(task) not in self._eval_keys:
                return task
        raise ValueError(f"{self.name}: train draws keep hitting the eval split ({MAX_REDRAWS} draws of make_task "
                         f"for train task {index} were eval tasks); the task space is too small for num_eval = "
                         f"{self.num_eval}")  # fmt: skip

    def format_prompt(self, user: str) -> Messages:
        """System prompt (if any) + the `few_shot` examples + one user message."""
        messages: Messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return messages + copy.deepcopy(self.few_shot) + [{"role": "user", "content": user}]

    # --- rollouts --------------------------------------------------------------------------------------------

    def initial_state(self, task: Task) -> dict[str, Any]:
        """Per-rollout scratch space handed to `env_response` and reward functions; extend in subclasses."""
        # A copy, so an environment that updates state["info"] never changes the task (tasks are shared).
        return {"task_id": task.id, "answer": task.answer, "info": copy.deepcopy(task.info), "turn": 0}

    async def env_response(self, messages: Messages, state: dict[str, Any]) -> tuple[Messages, bool]:
        """After each model turn: the messages the environment adds, and whether the episode is over. May be
        written as a plain (sync) method too."""
        raise NotImplementedError(f"{type(self).__name__} must implement env_response(messages, state)")

    # --- verifiers' multi-turn protocol (0.1-0.3): a ported environment's hooks run as they did there ---------

    async def setup_state(self, state: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        """verifiers' hook, called with `initial_state(task)` before the first model turn; returns the state."""
        return state

    async def is_completed(self, messages: Messages, state: dict[str, Any], **kwargs: Any) -> bool:
        """verifiers' hook: whether the episode is over, asked after every model turn before `env_response`.
        Called only where a subclass overrides it (Gyre's own environments say so with `env_response`'s `done`);
        this default is for an override's `super()`: the turn budget is spent."""
        return await self.max_turns_reached(state)

    async def max_turns_reached(self, state: dict[str, Any]) -> bool:
        """verifiers' helper: `state["turn"]` (model turns so far) has reached `max_turns`."""
        return state["turn"] >= self.max_turns

    async def _setup(self, state: dict[str, Any]) -> dict[str, Any]:
        if type(self).setup_state is Environment.setup_state:
            return state
        answer = await _maybe_await(self.setup_state(state))
        if not isinstance(answer, dict):
            raise TypeError(f"setup_state must return the state dict, got {type(answer).__name__}")
        return answer

    async def _env_reply(self, messages: Messages, state: dict[str, Any]) -> tuple[Messages, bool]:
        """`is_completed` where overridden (verifiers' protocol), then `env_response`, sync or async, its answer
        checked: a dict or a string was added to the conversation as a list (its keys, its characters). verifiers'
        `(messages, state)` is that protocol's answer: the state returned is the state from then on and the episode
        goes on (it ends by `is_completed` or `max_turns`, as there). As there, `is_completed` is asked again after
        `env_response` (verifiers asks it before every model turn): an `env_response` that ends the game (a win it
        announces, a flag it sets) ends the episode with its reply. Asked only before it, the model was sampled once
        more after the game was over, and that extra reply was trained and scored as the last. A ported
        environment's hooks were never called: every episode ran to max_turns, or ended as an error on its first
        reply."""
        overridden = type(self).is_completed is not Environment.is_completed
        if overridden and await _maybe_await(self.is_completed(messages, state)):
            return [], True
        answer = await _maybe_await(self.env_response(messages, state))  # a plain def was awaited: TypeError
        if not (isinstance(answer, tuple | list) and len(answer) == 2):
            raise TypeError(f"env_response must return (messages, done), got {type(answer).__name__} "
                            f"{str(answer)[:80]!r}")  # fmt: skip
        reply, done = answer
        if isinstance(done, dict):  # verifiers: (messages, state)
            if done is not state:  # the caller's dict is the rollout's state: keep it, with the new contents
                state.clear()
                state.update(done)
            done = False
        if not isinstance(done, bool):
            raise TypeError(f"env_response must return (messages, done) with done True or False (or verifiers' "
                            f"(messages, state)), got done = {type(done).__name__} {str(done)[:80]!r}")  # fmt: skip
        if not isinstance(reply, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in reply
        ):
            raise TypeError(f"env_response must return (messages, done) with messages a list of dicts with a "
                            f"'role', e.g. [{{'role': 'user', 'content': ...}}], got {str(reply)[:80]!r}")  # fmt: skip
        if overridden and not done:
            done = bool(await _maybe_await(self.is_completed(messages + reply, state)))
        return reply, done

    def _say_drift(self, turn: Turn, sequence: SequenceBuilder) -> None:
        """Log the first drift of this environment: outside the log it only counted as `truncated`, and a chat template
        that re-renders earlier turns differently once a user turn follows (Qwen3's drops their <think> block, and
        the empty one its generation prompt adds) silently trained every such sample on its first turn alone."""
        if getattr(self, "_drift_said", False):
            return
        self._drift_said = True
        log.warning(
            "%s: turn %d's prompt does not extend the tokens of the turns before it (they differ at token %d of %d): "
            "the chat template renders earlier turns differently once more follow, or a reply re-tokenises "
            "differently; such a sample is cut after turn %d (stop_reason drift; docs/environments.md, \"The training "
            "sequence\"). Logged once per environment.",
            self.name, sequence.num_turns + 1, sequence.divergence(turn), len(sequence.token_ids), sequence.num_turns,
        )  # fmt: skip

    async def rollout(self, client: ModelClient, task: Task, sampling: SamplingParams) -> Rollout:
        """Run one episode: model turn, environment reply, ... until done, `max_turns`, a length stop or drift.

        A length stop is a turn cut at `max_tokens`, or a later turn that no longer fits the model's context
        (`ContextLengthExceeded`: the environment's unanswered reply is left out).

        On drift (see `gyre.envs.sequence`) the conversation is cut back to the last turn in the training sequence,
        so the rubric scores exactly what the trainer sees.

        Errors raised by `client.chat` propagate (the caller retries or drops the rollout); errors in the
        environment's own hooks end the episode with `stop_reason == "error"` and keep what was done so far.
        """
        state = await self._setup(self.initial_state(task))
        prompt = copy.deepcopy(task.prompt)
        completion: Messages = []
        answered = 0  # completion messages up to the last model turn in the training sequence
        turns: list[Turn] = []
        sequence = SequenceBuilder()
        error: str | None = None
        stop: StopReason
        while True:
            try:
                turn = await client.chat(prompt + completion, tools=self.tool_schemas, sampling=sampling)
            except ContextLengthExceeded as exc:
                if not turns:  # the task's own prompt does not fit: nothing to train on (the orchestrator skips it)
                    raise ContextLengthExceeded(f"task {task.id}: {exc}") from exc
                del completion[answered:]  # the environment's reply is never answered: leave it out
                stop = "length"
                break
            turns.append(turn)
            if not sequence.add(turn):
                # Score what is trained: drop the environment messages the rejected turn answered.
                del completion[answered:]
                stop = "drift"
                self._say_drift(turn, sequence)
                break
            completion.append(turn.assistant_message())
            answered = len(completion)
            state["turn"] = len(turns)
            if turn.finish_reason == "length":
                stop = "length"
                break
            try:
                reply, done = await self._env_reply(prompt + completion, state)
            except Exception as exc:  # environment bug: keep the episode so far, flag it
                error, stop = f"env_response failed: {type(exc).__name__}: {exc}", "error"
                break
            if done:
                completion += reply
                stop = "done"
                break
            if len(turns) >= self.max_turns:
                stop = "max_turns"  # the reply would never be answered: leave it out
                break
            completion += reply
        return Rollout(
            task_id=task.id,
            prompt=prompt,
            completion=completion,
            turns=turns,
            token_ids=sequence.token_ids,
            loss_mask=sequence.loss_mask,
            logprobs=sequence.logprobs,
            prompt_len=sequence.prompt_len,
            sequence_turns=sequence.num_turns,
            policy_version_min=sequence.version_min or 0,
            policy_version_max=sequence.version_max or 0,
            stop_reason=stop,
            error=error,
            state=state,
        )

    async def score(self, task: Task, rollout: Rollout) -> Score:
        return await self.rubric.score(task, rollout)

    # --- supervised data ----------------------------------------------------------------------------------------

    def sft_example(self, task: Task) -> Messages:
        """The prompt plus the reference assistant reply (in exactly the format the rubric rewards).

        Render it with `tools=env.tool_schemas` so tool environments get the same system prompt as in rollouts.
        """
        return copy.deepcopy(task.prompt) + [{"role": "assistant", "content": task.answer}]


class MultiTurnEnv(Environment):
    """Implement `env_response(messages, state) -> (new_messages, done)`, called after every model turn."""

    def __init__(self, *, max_turns: int = 4, **kwargs: Any) -> None:
        super().__init__(max_turns=max_turns, **kwargs)


class SingleTurnEnv(Environment):
    """One model turn, then done."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(max_turns=1, **kwargs)

    async def env_response(self, messages: Messages, state: dict[str, Any]) -> tuple[Messages, bool]:
        return [], True


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _checked_few_shot(few_shot: Any) -> list[dict[str, Any]]:
    """`few_shot` as a list of `{"role", "content"}` messages; anything else is refused naming the setting (a
    verifiers environment passes it as such a list)."""
    if few_shot is None:
        return []
    roles = ("user", "assistant")
    if not isinstance(few_shot, list) or not all(
        isinstance(m, dict) and m.get("role") in roles and isinstance(m.get("content"), str) for m in few_shot
    ):
        raise ValueError(f"few_shot: a list of {{'role', 'content'}} messages with roles {list(roles)}, got "
                         f"{str(few_shot)[:200]}")  # fmt: skip
    return [{"role": m["role"], "content": m["content"]} for m in few_shot]
