"""A judge whose context a rollout outgrows, against a real `gyre inference` judge (the tiny model, a short context).

The judge's server refuses a prompt longer than its context (400 `context_length_exceeded`, "This model's maximum
context length is L tokens. However, you requested N tokens (P in the messages, M in the completion)", as vLLM and
OpenAI word it). A long completion was refused every time it was asked, so the judge scored it 0 (`Unjudged`):
whatever the rollout was worth, a long one never got a grade. Now the prompt is rendered again with its longest
fields cut in the middle (a marker in their place says so to the judge), sized from the counts the refusal gives,
and the cut prompt is judged. A reward model's conversation longer than its context (its /tokenize says the
context) is cut alike before /classify, which refused it (0).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from gyre.envs.judge import Judge
from gyre.envs.judge_prompt import CUT_MARKER, Unjudged
from gyre.envs.reward_model import RewardModel
from support.models import reward_model_path

CONTEXT = 256  # the judge's context, in tokens
# json + structured: the tiny model's random weights still answer a readable score
JUDGE = {"name": "judge", "score": "json", "structured": True, "max_score": 10, "max_tokens": 24}
PROMPT = [{"role": "user", "content": "Write a long essay, then the answer."}]
LONG = "BEGINNING " + "".join(f"sentence {i} of the essay goes on. " for i in range(300)) + "So the answer is 42. END"


@pytest.fixture(scope="module")
def short_judge(start_inference):
    return start_inference("--engine.max-model-len", str(CONTEXT))


def posted(endpoint, *paths: str) -> dict[str, list[dict]]:
    """The bodies a judge's or reward model's own client posts to `paths` from now on (spied on, still sent)."""
    bodies: dict[str, list[dict]] = {path: [] for path in paths}
    post = endpoint.post

    async def spy(path, body, **kwargs):
        if path in bodies:
            bodies[path].append(body)
        return await post(path, body, **kwargs)

    endpoint.post = spy
    return bodies


def judged(judge: Judge, completion: str) -> tuple[float, list[dict]]:
    """The judge's score of one rollout, and the message lists it sent."""
    chats = posted(judge.endpoint, "/v1/chat/completions")["/v1/chat/completions"]

    async def scenario():
        try:
            return await judge(PROMPT, [{"role": "assistant", "content": completion}], "42")
        finally:
            await judge.aclose()

    return asyncio.run(scenario()), [body["messages"] for body in chats]


def test_a_completion_longer_than_the_judges_context_is_judged_with_its_middle_cut(short_judge, caplog):
    judge = Judge(url=short_judge.url, prompt="Question: {question}\nAnswer: {response}\nGrade it 0-10.", **JUDGE)
    with caplog.at_level("WARNING"):
        score, sent = judged(judge, LONG)
    assert 0.0 <= score <= 1.0
    assert judge.stats["cut"] == 1 and judge.stats["refused"] == 1
    # the whole prompt first (refused), then the cut one, which fits at once (sized from the refusal's counts; a
    # reply without a score would ask it again): the question whole, the completion's start and end kept
    assert LONG in sent[0][-1]["content"] and len(sent) >= 2 and all(m == sent[1] for m in sent[1:])
    content = sent[-1][-1]["content"]
    assert content.startswith(f"Question: {PROMPT[0]['content']}\nAnswer: BEGINNING sentence 0")
    assert content.endswith("So the answer is 42. END\nGrade it 0-10.")
    assert "characters cut here to fit the judge's context" in content and LONG not in content
    fits = httpx.post(f"{short_judge.url}/tokenize", json={"messages": sent[-1], "add_generation_prompt": True})
    assert fits.json()["count"] + JUDGE["max_tokens"] <= CONTEXT
    warnings = [r.getMessage() for r in caplog.records if "longer than the judge's context" in r.getMessage()]
    assert len(warnings) == 1 and "maximum context length is 256" in warnings[0]


def test_a_short_completion_is_sent_whole_and_never_cut(short_judge):
    judge = Judge(url=short_judge.url, prompt="Question: {question}\nAnswer: {response}", **JUDGE)
    score, sent = judged(judge, "So the answer is 42.")
    assert 0.0 <= score <= 1.0 and len(sent) == 1 and judge.stats["cut"] == 0 and judge.stats["refused"] == 0
    assert CUT_MARKER.split("{")[0] not in sent[0][-1]["content"]


@pytest.mark.parametrize(
    ("settings", "why"),
    [
        # the template alone outgrows the context, or leaves less than MIN_KEPT characters of the rollout to judge
        ({"prompt": "Grade this. " * 200 + "{response}"}, "too little of the rollout fits"),
        ({"prompt": "Grade this. " * 40 + "{response}"}, "too little of the rollout fits"),
        # the judge's reply alone would fill its context
        ({"prompt": "{response}", "max_tokens": CONTEXT}, "leaves no room for its max_tokens"),
    ],
)
def test_a_prompt_no_cut_can_fit_is_unjudged_saying_why(short_judge, settings, why):
    judge = Judge(url=short_judge.url, **{**JUDGE, **settings})
    with pytest.raises(Unjudged, match=why) as raised:
        judged(judge, LONG)
    assert "maximum context length is 256" in str(raised.value) and judge.stats["cut"] == 0


@pytest.fixture(scope="module")
def short_reward_model(start_inference, tmp_path_factory):
    return start_inference("--runner", "pooling", "--engine.max-model-len", str(CONTEXT),
                           model=reward_model_path(tmp_path_factory))  # fmt: skip


def test_a_conversation_longer_than_the_reward_models_context_is_scored_with_its_middle_cut(short_reward_model):
    model = RewardModel(url=short_reward_model.url, name="rm", batch_wait_ms=1)
    long = [{"role": "user", "content": PROMPT[0]["content"]}, {"role": "assistant", "content": LONG}]
    short = [{"role": "user", "content": PROMPT[0]["content"]}, {"role": "assistant", "content": "42"}]
    bodies = posted(model.endpoint, "/classify", "/tokenize")

    async def scenario():
        try:
            return await model(long), await model(short)
        finally:
            await model.aclose()

    scores = asyncio.run(scenario())
    assert all(isinstance(score, float) for score in scores) and model.stats["cut"] == 1
    classified = [tokens for body in bodies["/classify"] for tokens in body["input"]]
    assert model.stats["refused"] == 0 and all(len(tokens) <= CONTEXT for tokens in classified)
    tokenized = [body["messages"][-1]["content"] for body in bodies["/tokenize"]]
    cut = next(text for text in tokenized if "characters cut here" in text)
    assert cut.startswith("BEGINNING sentence 0") and cut.endswith("So the answer is 42. END")
