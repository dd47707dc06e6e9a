"""An environment as verifiers 0.1-0.3 writes it, ported to Gyre by one line (`import gyre.envs as vf` where it
had `import verifiers as vf`); everything below it is verifiers code as such an environment writes it: a
question-answering environment graded by an LLM judge (`vf.JudgeRubric` with an `AsyncOpenAI` judge client, a judge
prompt, sampling args), two reward functions reading the judge's verdict.

Load with `env.name = "vf_hub_judge:load_environment"` with this folder on PYTHONPATH.
"""

import gyre.envs as vf  # the port: `import verifiers as vf` in the hub's copy
from openai import AsyncOpenAI

JUDGE_PROMPT = """Question: {question}
Reference answer: {answer}
Response: {response}

Is the response correct? Answer "yes" or "no"."""


def load_environment(judge_base_url: str, judge_model: str = "judge-model", judge_api_key: str = "EMPTY",
                     judge_timeout: float | None = None, judge_retries: int = 0,
                     **kwargs) -> vf.Environment:  # fmt: skip
    rows = [{"question": "What is the capital of France?", "answer": "Paris"},
            {"question": "What is the largest planet?", "answer": "Jupiter"}]  # fmt: skip
    client_args = {"timeout": judge_timeout} if judge_timeout else {}
    judge_client = AsyncOpenAI(base_url=judge_base_url, api_key=judge_api_key, max_retries=judge_retries,
                               **client_args)  # fmt: skip
    parser = vf.XMLParser(["answer"], answer_field="answer")
    rubric = vf.JudgeRubric(judge_client=judge_client, judge_model=judge_model, judge_prompt=JUDGE_PROMPT,
                            judge_sampling_args={"temperature": 0, "max_tokens": 16}, parser=parser)  # fmt: skip

    async def correct_answer_reward_func(judge, prompt, completion, answer, state, **kwargs) -> float:
        judge_response = await judge(prompt, completion, answer, state)
        return 1.0 if "yes" in judge_response.lower() else 0.0

    async def decisive_judge(judge, prompt, completion, answer, state) -> float:  # a metric on the same verdict
        judge_response = await judge(prompt, completion, answer, state)
        return 1.0 if judge_response.strip().lower().rstrip(".") in ("yes", "no") else 0.0

    rubric.add_reward_func(correct_answer_reward_func)
    rubric.add_reward_func(decisive_judge, weight=0.2)
    return vf.SingleTurnEnv(eval_dataset=rows, system_prompt="Answer inside <answer></answer> tags.",
                            parser=parser, rubric=rubric, **kwargs)  # fmt: skip
