"""A `RewardModel` scores whole conversations (each assistant message after its reasoning, as a judge's {response})
with a sequence-classification model behind vLLM's `/classify`
(`gyre inference --runner pooling`, or `vllm serve --runner pooling`): each conversation is rendered by the
server's own chat template (`/tokenize` with its messages), and concurrent calls are gathered into batches of up
to `max_batch` token lists per `/classify` request (waiting at most `batch_wait_ms` for others to join). A
conversation longer than the model's context (the `max_model_len` its `/tokenize` answers) is cut like a judge's
prompt, its longest texts in the middle with a marker (`cut`), before it is sent: it was refused and scored 0. A
batch the server refuses for what it holds (a conversation no cut fits) is scored again one conversation at a time,
so only the refused one is `Unjudged` (the others are scored).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter
from typing import Any

from gyre.config.endpoint import RewardModelConfig
from gyre.endpoint import Endpoint, EndpointError, RequestRefused
from gyre.envs.judge_prompt import MAX_CUTS, Unjudged, cut_messages, without_reasoning
from gyre.envs.types import Messages, ScoringError

log = logging.getLogger(__name__)


class RewardModel:
    """A reward function scoring the whole conversation with a served reward model, in batches (module docstring)."""

    asks_a_served_model = True  # see Judge

    def __init__(self, config: RewardModelConfig | None = None, **settings: Any):
        self.config = config or RewardModelConfig(**settings)
        self.__name__ = self.config.name
        self.endpoint = Endpoint(self.config, name=f"reward model {self.config.name!r}")
        self.stats: Counter[str] = self.endpoint.stats
        self._queue: list[tuple[list[int], asyncio.Future]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task] = set()

    async def __call__(self, messages: Messages) -> float:
        messages = without_reasoning(messages)
        rendered = await self._tokenize(messages)
        tokens, context = rendered["tokens"], rendered.get("max_model_len")
        # A conversation longer than the model's context (its /tokenize says how long that is: vLLM's and Gyre's) was
        # refused by /classify and scored 0 (Unjudged): its longest texts are cut in the middle, marked, as a judge's
        original = len(tokens)
        for _ in range(MAX_CUTS):
            if not (isinstance(context, int) and context > 0 and len(tokens) > context):
                break
            chars = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
            cut = cut_messages(messages, chars - math.floor(chars * context / len(tokens) * 0.9) + 16)
            if cut is None:
                break  # nothing to cut that would do: /classify refuses it (Unjudged), as before
            messages = cut
            tokens = (await self._tokenize(messages))["tokens"]
        if len(tokens) < original and not (isinstance(context, int) and len(tokens) > context):
            self.stats["cut"] += 1
            if self.stats["cut"] == 1:
                log.warning("reward model %r: a conversation of %d tokens is longer than its context of %s; it is "
                            "scored with its longest texts cut in the middle, marked where: further ones are only "
                            "counted (cut in the signals)", self.config.name, original, context)  # fmt: skip
        future = asyncio.get_running_loop().create_future()
        self._queue.append((tokens, future))
        if len(self._queue) >= self.config.max_batch:
            self._flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.config.batch_wait_ms / 1000, self._flush)
        return await future

    async def _tokenize(self, messages: Messages) -> dict:
        """The server's /tokenize answer for a conversation (its own chat template); one without tokens is a
        ScoringError (the server's fault, not the rollout's: never a silent 0)."""
        try:
            body = {"model": await self.endpoint.model(), "messages": messages, "add_generation_prompt": False}
            rendered = await self.endpoint.post("/tokenize", body)
        except RequestRefused as error:
            raise Unjudged(str(error)) from error
        except EndpointError as error:
            raise ScoringError(str(error)) from error
        tokens = rendered.get("tokens") if isinstance(rendered, dict) else None
        if not (isinstance(tokens, list) and tokens):
            self.stats["unparsed"] += 1
            raise ScoringError(f"reward model {self.config.name!r}: /tokenize answered no token list")
        return rendered

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._queue:
            batch, self._queue = self._queue[: self.config.max_batch], self._queue[self.config.max_batch :]
            task = asyncio.get_running_loop().create_task(self._score(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _score(self, batch: list[tuple[list[int], asyncio.Future]]) -> None:
        try:
            body = {"model": await self.endpoint.model(), "input": [tokens for tokens, _ in batch],
                    "use_activation": self.config.activation}  # fmt: skip
            answer = await self.endpoint.post("/classify", body)
            rows = sorted(answer["data"], key=lambda row: row["index"])
            if any(len(row["probs"]) <= self.config.label for row in rows):  # the setting's fault: name it
                raise ValueError(f"label = {self.config.label}, but the classifier has {len(rows[0]['probs'])} "
                                 f"outputs (label counts from 0)")  # fmt: skip
            scores = [float(row["probs"][self.config.label]) for row in rows]
            if len(scores) != len(batch) or not all(math.isfinite(s) for s in scores):
                raise ValueError(f"{len(scores)} scores for {len(batch)} conversations, or a non-finite one")
        except RequestRefused as error:
            if len(batch) > 1:  # one conversation's fault (e.g. too long): each alone, so only that one fails
                await asyncio.gather(*(self._score([one]) for one in batch))
                return
            _, future = batch[0]
            if not future.done():
                future.set_exception(Unjudged(str(error)))  # it names the reward model
            return
        except Exception as error:  # the server's answer, whatever is wrong with it: an OverflowError (a 400-digit
            # integer score) escaped, ended this task and left every call of the batch waiting for ever
            served = isinstance(error, EndpointError)  # its message names the reward model already
            self.stats["unparsed"] += not served
            failure = ScoringError(str(error) if served else f"reward model {self.config.name!r}: {error}")
            for _, future in batch:
                if not future.done():
                    future.set_exception(failure)
            return
        self.stats["batches"] += 1
        for (_, future), score in zip(batch, scores, strict=True):
            if not future.done():
                future.set_result(score)

    async def aclose(self) -> None:
        await self.endpoint.aclose()
