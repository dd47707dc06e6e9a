"""Environments as the Prime Intellect environments hub has them (verifiers 0.1-0.3: a module whose
`load_environment(**kwargs)` builds a `vf.SingleTurnEnv` over a dataset of `question` / `answer` rows), ported to
Gyre by one line: `import gyre.envs as vf` where they had `import verifiers as vf`. Everything below that line is
verifiers code as such an environment writes it (the datasets are rows in code: no hub download in the tests).

- `load_environment`: reverse_text (an XMLParser with think / answer fields, its format string in the system prompt,
  an LCS reward and the parser's format reward, weighted; `few_shot`; an `eval_dataset`).
- `load_math_environment`: a math environment (`MathRubric` with a `ThinkParser` reading `\\boxed{}`, grouped with
  a rubric of its own in a `RubricGroup`; a reward that branches on the `task` column).
- `load_guess_environment`: a multi-turn game in verifiers' protocol (`setup_state`, `is_completed` asked after
  every model turn, `env_response` returning `(messages, state)`, `max_turns_reached`).

Load with `env.name = "vf_hub_ports:load_environment"` with this folder on PYTHONPATH.
"""

from difflib import SequenceMatcher

import gyre.envs as vf  # the port: `import verifiers as vf` in the hub's copy

WORDS = ["gyre", "tensor", "replica", "rollout", "verifier", "policy", "reward", "stream", "kernel", "batch"]


def load_environment(num_eval: int = 2, **kwargs) -> vf.Environment:
    train_dataset = [{"question": w, "answer": w[::-1], "info": {"length": len(w)}} for w in WORDS[2:]]
    eval_dataset = [{"question": w, "answer": w[::-1], "info": {"length": len(w)}} for w in WORDS[:2]]
    parser = vf.XMLParser(["think", "answer"], answer_field="answer")
    system_prompt = f"Reverse the given text.\n\nRespond in the following format:\n{parser.get_format_str()}"
    few_shot = [
        {"role": "user", "content": "abc"},
        {"role": "assistant", "content": parser.format(think="Backwards.", answer="cba")},
    ]

    def lcs_reward_func(completion, answer, **kwargs) -> float:
        response = parser.parse_answer(completion) or ""
        return SequenceMatcher(None, response, answer).ratio()

    def length_known(parser, info, completion) -> float:  # a verifiers reward reading the info column
        return float(len(parser.parse(completion[-1]["content"]).answer or "") == info["length"])

    rubric = vf.Rubric(funcs=[lcs_reward_func, parser.get_format_reward_func(), length_known],
                       weights=[1.0, 0.2, 0.1], parser=parser)  # fmt: skip
    return vf.SingleTurnEnv(dataset=train_dataset, eval_dataset=eval_dataset, system_prompt=system_prompt,
                            few_shot=few_shot, parser=parser, rubric=rubric, num_eval=num_eval, **kwargs)  # fmt: skip


def load_math_environment(**kwargs) -> vf.Environment:
    rows = [{"question": f"What is {a} / {b}?", "answer": f"\\frac{{{a}}}{{{b}}}", "task": "fractions"}
            for a, b in [(1, 2), (3, 4), (2, 3), (5, 8)]]  # fmt: skip
    rows += [{"question": f"What is {a} + {b}?", "answer": str(a + b), "task": "sums"} for a, b in [(2, 3), (7, 9)]]
    parser = vf.ThinkParser(extract_fn=vf.extract_boxed_answer)
    math_rubric = vf.MathRubric(parser=parser)

    def brief_sums(completion, task, **kwargs) -> float:  # only the sums must be brief
        if task != "sums":
            return 1.0
        return float(len(completion[-1]["content"]) <= 80)

    style = vf.Rubric(funcs=[brief_sums, parser.get_format_reward_func()], weights=[0.1, 0.2], parser=parser)
    return vf.SingleTurnEnv(dataset=rows, system_prompt="Think, then put the answer in \\boxed{}.", parser=parser,
                            rubric=vf.RubricGroup(rubrics=[math_rubric, style]), **kwargs)  # fmt: skip


class GuessEnv(vf.MultiTurnEnv):
    async def setup_state(self, state: vf.State, **kwargs) -> vf.State:
        state["guesses"] = []
        return state

    async def is_completed(self, messages: vf.Messages, state: vf.State, **kwargs) -> bool:
        if await self.max_turns_reached(state):
            return True
        return self.parser.parse_answer(messages) == state["answer"]

    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs) -> tuple[vf.Messages, vf.State]:
        guess = self.parser.parse_answer(messages) or ""
        state["guesses"].append(guess)
        hint = "higher" if guess.isdigit() and int(guess) < int(state["answer"]) else "lower"
        return [{"role": "user", "content": f"No, {hint}."}], state


def load_guess_environment(max_turns: int = 4, **kwargs) -> vf.Environment:
    rows = [{"question": f"Guess my number, 1 to {top}. Reply with the number only.", "answer": str(top * 7 % 10 or 1)}
            for top in range(10, 16)]  # fmt: skip

    def solved(completion, answer, parser) -> float:
        return float(parser.parse_answer(completion) == answer)

    def few_guesses(state) -> float:
        return 1.0 / (1 + len(state["guesses"]))

    return GuessEnv(dataset=rows, rubric=vf.Rubric(funcs=[solved, few_guesses], weights=[1.0, 0.5]),
                    max_turns=max_turns, **kwargs)  # fmt: skip
