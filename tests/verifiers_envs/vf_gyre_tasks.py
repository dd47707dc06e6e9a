"""A small verifiers 0.4 environment built for Gyre's tests: no hub, no network, no `uv`, no sandbox.

The taskset serves the tasks of one of Gyre's built-in environments (`source`, e.g. "calculator", "reverse_text"),
so a model taught those conversations behaves predictably. The harness is an in-process chat loop (verifiers allows a
harness to run its loop in-process as long as every model call goes through the rollout's interception endpoint):
it talks to the model with the official `openai` client for up to `turns` model turns, runs the calculator when the
model calls it (a tool turn), and otherwise answers a reply with a user message asking for another try (a user turn).
Reward: 1.0 when the last reply contains the reference answer. `fail_first = [i, ...]`: the first episode of task
`i` raises in the harness (an environment bug the trainer must survive). `reward_fails = true`: the reward raises
(a reward bug, which must score 0 and be named, not fail the sample). `judge_url = "http://host:port/v1"`: the
reward asks that judge first (a verifiers judge's call, with the official `openai` client and no retries of its
own). `list_models = true` (harness): the harness lists the models first, through the interception's /v1/models
relay (into `MODELS_SEEN`). `sampling = {"temperature": 0.0, ...}` (harness): the harness's own sampling on every
model call. `sdk_retries = n` (harness): the harness's `openai` client retries a failed call n times (its default is 2;
0 here). `stream = true` (harness): every model call is streamed (server-sent events, read with the `openai` client).

Load it with `env.name = "verifiers:vf_gyre_tasks"` with this folder on PYTHONPATH.
"""

from __future__ import annotations

import json

import verifiers.v1 as vf
from gyre.envs import load_environment as load_gyre_environment
from gyre.envs.calculator import calculator
from openai import AsyncOpenAI
from verifiers.v1.runtimes import ProgramResult

__all__ = ["GyreTaskset", "ChatLoop"]

RETRY_PROMPT = "Try again."
_FAILED: set[int] = set()  # tasks whose one failing episode already happened (per process)
MODELS_SEEN: list[list[str]] = []  # what each `list_models` episode's GET /v1/models listed


class GyreTaskData(vf.TaskData):
    answer: str = ""
    fail: bool = False
    reward_fails: bool = False
    judge_url: str = ""


class GyreTask(vf.Task[GyreTaskData]):
    @vf.reward
    async def correct(self, task, trace) -> float:
        if task.reward_fails:
            raise ZeroDivisionError("the reward fails on purpose")
        if task.judge_url:
            async with AsyncOpenAI(base_url=task.judge_url, api_key="unused", max_retries=0, timeout=5) as judge:
                await judge.chat.completions.create(model="judge", messages=[{"role": "user", "content": "grade"}])
        return float(bool(task.answer) and task.answer in trace.last_reply)


class GyreTasksetConfig(vf.TasksetConfig):
    source: str = "calculator"
    num_tasks: int = 24
    fail_first: list[int] = []
    reward_fails: bool = False
    judge_url: str = ""


class GyreTaskset(vf.Taskset[GyreTask, GyreTasksetConfig]):
    def load(self):
        source = load_gyre_environment(self.config.source).tasks("train", seed=0)
        for i in range(self.config.num_tasks):
            task = source[i]
            system = [m["content"] for m in task.prompt if m["role"] == "system"]
            user = [m for m in task.prompt if m["role"] != "system"]
            data = GyreTaskData(
                prompt=[vf.UserMessage(content=m["content"]) for m in user],
                system_prompt=system[0] if system else None,
                answer=task.answer,
                fail=i in self.config.fail_first,
                reward_fails=self.config.reward_fails,
                judge_url=self.config.judge_url,
            )
            yield GyreTask(data, self.config.task)


class ChatLoopConfig(vf.HarnessConfig):
    turns: int = 2
    tools: bool = True
    list_models: bool = False  # first GET /v1/models, as an agent reading the context window does
    sdk_retries: int = 0  # the openai client's max_retries (a 5xx answer is asked again)
    stream: bool = False  # stream every model call, as agents that print as they go do
    sampling: dict = {}  # the harness's own sampling arguments on every model call (temperature, max_tokens, ...)


class ChatLoop(vf.Harness[ChatLoopConfig]):
    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kwargs) -> ProgramResult:
        if data.fail and data.idx not in _FAILED:
            _FAILED.add(data.idx)
            raise RuntimeError(f"task {data.idx}: this harness fails the first episode on purpose")
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        messages += [{"role": "user", "content": m.content} for m in prompt]
        tools = load_gyre_environment("calculator").tool_schemas if self.config.tools else None
        reply = ""
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=self.config.sdk_retries) as client:
            if self.config.list_models:
                MODELS_SEEN.append([model.id async for model in client.models.list()])
            for turn in range(self.config.turns):
                kwargs = {"tools": tools, **self.config.sampling} if tools else dict(self.config.sampling)
                if self.config.stream:
                    message, finish_reason = await _streamed(client, ctx.model, messages, kwargs)
                else:
                    response = await client.chat.completions.create(model=ctx.model, messages=messages, **kwargs)
                    message, finish_reason = response.choices[0].message, response.choices[0].finish_reason
                assistant = {"role": "assistant", "content": message.content or ""}
                if reasoning := (message.model_extra or {}).get("reasoning_content"):  # sent back, as vLLM clients do
                    assistant["reasoning_content"] = reasoning
                if message.tool_calls:
                    assistant["tool_calls"] = [call.model_dump() for call in message.tool_calls]
                messages.append(assistant)
                reply = message.content or ""
                if message.tool_calls:
                    for call in message.tool_calls:
                        arguments = json.loads(call.function.arguments or "{}")
                        messages.append({"role": "tool", "tool_call_id": call.id, "content": calculator(**arguments)})
                elif finish_reason == "length" or turn + 1 == self.config.turns:
                    break
                else:
                    messages.append({"role": "user", "content": RETRY_PROMPT})
        return ProgramResult(exit_code=0, stdout=reply, stderr="")


async def _streamed(client: AsyncOpenAI, model: str, messages: list, kwargs: dict):
    """One streamed model call, its deltas put together: (the assistant message, the finish reason)."""
    from openai.types.chat import ChatCompletionMessage

    text, reasoning, calls, finish_reason = "", "", {}, None
    async for chunk in await client.chat.completions.create(model=model, messages=messages, stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": delta.id, "type": "function",
                                                      "function": {"name": "", "arguments": ""}})  # fmt: skip
                call["function"]["name"] += (delta.function and delta.function.name) or ""
                call["function"]["arguments"] += (delta.function and delta.function.arguments) or ""
            finish_reason = choice.finish_reason or finish_reason
    message = ChatCompletionMessage(
        role="assistant", content=text, tool_calls=list(calls.values()) or None, reasoning_content=reasoning or None
    )
    return message, finish_reason
