"""The distillation teacher: its log-prob of every token of a student's rollout (docs/algorithms.md).

One request per sample: the whole training sequence (prompt and every turn, as the student saw and sampled it)
as the prompt of the teacher's tokens-in route (`/inference/v1/generate`, or `/v1/completions` with a token-id
prompt) with `prompt_logprobs: 0` and one generated token; entry t of the answer's `prompt_logprobs` is the
teacher's log_softmax(logits)[token t] given tokens < t (temperature 1, vLLM's rule).

A sample that fills the teacher's context (prompt + completion = its max_model_len, e.g. a teacher of the policy's
context scoring a sample cut at the context) leaves no room for the generated token, and the server refuses it
(400). Such a refused sample is asked again as a prompt alone: `/v1/completions` with `echo` and `max_tokens: 0`,
which Gyre's server (and OpenAI) score up to the whole context. vLLM requires max_tokens >= 1 and refuses that
too: then all but the last token are scored (the usual request, one token shorter: it fits), and the sample's last
token is trained without a distillation term (`logprobs` returns one value fewer; counted as `cut`). A sample the
teacher still refuses (too long for it, a token it does not know: `RequestRefused`) is skipped: `logprobs` returns
None, and the sample trains on its reward's term alone (the batch's `teacher_mask` is False on its tokens:
`teacher_arrays`); the first skip is logged with the server's reason and every one is counted (`skipped` in the step
events' `signals.teacher`, `gyre_orchestrator_signal_calls_total{outcome="skipped"}`).
An outage (connection errors, timeouts, 5xx after the retries) or a configuration error (401, 404, or
`MAX_REFUSED_IN_A_ROW` refusals in a row) still raises `EndpointError`, which stops the run with the reason.

The teacher must share the student's tokenizer (the token ids are sent as they are): `check_tokenizer` compares
the two servers' tokenization of a probe text, and their reading of the policy's chat-template ids (special tokens),
before the run starts.
"""

from __future__ import annotations

import asyncio
import logging
import math

import httpx
import numpy as np
from gyre.batch import LOGPROB_MAX, valid_logprobs
from gyre.config.endpoint import TeacherConfig
from gyre.endpoint import Endpoint, EndpointError, RequestRefused

log = logging.getLogger(__name__)

#: text whose tokenization tells tokenizers apart: words, digits, code, whitespace runs, accents, CJK, emoji
PROBE = "Gyre probe: The 12,345 quick foxes — naïve café 東京 🦊\n\tdef f(x):  return x**2  # 0x1F ⟨ok⟩"


class TeacherError(EndpointError):
    """The teacher's answer cannot be used (missing or misaligned prompt log-probs, impossible values)."""


def teacher_logprobs_from(entries, token_ids: list[int]) -> list[float]:
    """[0.0] + the teacher's log-prob of token_ids[t] for t >= 1, from vLLM's `prompt_logprobs` shape."""
    if not isinstance(entries, list) or len(entries) != len(token_ids):
        got = len(entries) if isinstance(entries, list) else type(entries).__name__
        raise TeacherError(f"teacher: {got} prompt log-probs for {len(token_ids)} tokens")
    values = [0.0]
    for t in range(1, len(token_ids)):
        try:
            value = float(entries[t][str(token_ids[t])]["logprob"])
        except (KeyError, TypeError, ValueError):
            raise TeacherError(f"teacher: no prompt log-prob for token {token_ids[t]} at position {t}") from None
        if not (math.isfinite(value) and value <= LOGPROB_MAX):
            raise TeacherError(f"teacher: log-prob {value} at position {t} is not a log-probability")
        values.append(value)
    return values


def teacher_arrays(values: list[float] | None, length: int) -> tuple[np.ndarray, np.ndarray | None]:
    """A sample's batch fields `teacher_logprobs` and `teacher_mask` (None: the teacher scored every token) over its
    `length` trained tokens, from what `Teacher.logprobs` returned: None (refused: no token is scored, the sample keeps
    its reward's term and loses only the teacher's), all but the last token (that one has no distillation term), or
    every token."""
    if values is None:
        return np.zeros(length, dtype=np.float32), np.zeros(length, dtype=np.bool_)
    scored = np.asarray(values[:length], dtype=np.float32)
    if len(scored) == length:
        return scored, None
    padded = np.concatenate([scored, np.zeros(length - len(scored), dtype=np.float32)])
    return padded, np.arange(length) < len(scored)


def sampler_teacher_kl(samples) -> float:
    """The sampler-side reverse KL of a batch, the mean of lp_inference − lp_teacher over the loss tokens the teacher
    scored (`teacher_mask`) whose inference log-prob is possible (`gyre.batch.valid_logprobs`, the trainer's rule):
    an impossible one (a -1e9 sentinel of a server) made the step's mean huge; 0 when no token counts."""
    gaps = [
        (s.inference_logprobs - s.teacher_logprobs)[
            valid_logprobs(s.inference_logprobs, s.loss_mask) & (True if s.teacher_mask is None else s.teacher_mask)
        ]
        for s in samples
    ]
    gaps = np.concatenate(gaps) if gaps else np.zeros(0)
    return float(gaps.astype(np.float64).mean()) if gaps.size else 0.0


class Teacher:
    """The teacher endpoint; `stats` counts its calls and skipped samples (orchestrator step events and metrics)."""

    def __init__(self, config: TeacherConfig):
        self.config = config
        self.endpoint = Endpoint(config, name="teacher")
        self.stats = self.endpoint.stats
        self._checked: asyncio.Future | None = None

    async def check_tokenizer_once(self, policy_url: str, api_key: str | None = None) -> None:
        """`check_tokenizer` the first time (at start, or at the first sample where no replica was known then);
        its outcome, a refusal included, every time after."""
        if self._checked is None:
            self._checked = asyncio.ensure_future(self.check_tokenizer(policy_url, api_key))
        await asyncio.shield(self._checked)

    async def logprobs(self, token_ids: list[int]) -> list[float] | None:
        """The teacher's log-prob of each token of `token_ids` given the ones before (0.0 for the first), or of all
        but the last where only that prefix could be scored; None when the teacher refuses this sample (skipped,
        counted; the module docstring)."""
        try:
            entries = await self._scored(token_ids)
        except RequestRefused as refused:
            try:  # no room for the generated token: the sequence alone, as a prompt scored by echo (Gyre, OpenAI)
                entries = await self._echoed(token_ids)
            except RequestRefused:
                prefix = token_ids[:-1]  # vLLM (max_tokens >= 1): all but the last token fit with the generated one
                if len(prefix) < 2:
                    self._skip(token_ids, refused)
                    return None
                try:
                    entries = await self._scored(prefix, again=True)
                except RequestRefused:
                    self._skip(token_ids, refused)
                    return None
                self.stats["cut"] += 1
                return teacher_logprobs_from(entries, prefix)
        return teacher_logprobs_from(entries, token_ids)

    async def _scored(self, token_ids: list[int], again: bool = False):
        model = await self.endpoint.model()
        if self.config.route == "generate":
            params = {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
            request = {"model": model, "token_ids": token_ids, "sampling_params": params}
            body = await self.endpoint.post("/inference/v1/generate", request, again=again)
            return body.get("prompt_logprobs") if isinstance(body, dict) else None
        body = await self.endpoint.post("/v1/completions", {"model": model, "prompt": token_ids, "max_tokens": 1,
                                                            "temperature": 0.0, "prompt_logprobs": 0},
                                        again=again)  # fmt: skip
        return _choice_entries(body)

    async def _echoed(self, token_ids: list[int]):
        body = await self.endpoint.post("/v1/completions", {"model": await self.endpoint.model(), "prompt": token_ids,
                                                            "max_tokens": 0, "echo": True, "temperature": 0.0,
                                                            "prompt_logprobs": 0}, again=True)  # fmt: skip
        return _choice_entries(body)

    def _skip(self, token_ids: list[int], refused: RequestRefused) -> None:
        self.stats["skipped"] += 1
        if self.stats["skipped"] == 1:
            log.warning(
                "the teacher refused a sample of %d tokens, also as a prompt alone (echo, max_tokens 0): %s. The "
                "sample trains on its reward alone (no distillation term for it); further skips are only counted: "
                "signals.teacher.skipped in orchestrator_steps.jsonl, gyre_orchestrator_signal_calls_total"
                '{signal="teacher",outcome="skipped"}. A teacher whose max_model_len is below the policy\'s '
                "skips every longer sample (docs/orchestrator.md, distillation teacher)",
                len(token_ids),
                refused,
            )

    async def check_tokenizer(self, policy_url: str, api_key: str | None = None) -> None:
        """Refuse (ValueError) a teacher whose tokenizer is not the policy's: both servers' `/tokenize` of `PROBE`
        must give the same ids, and the ids of the policy's chat template around it (its role markers, special
        tokens a plain text never holds) must read as the same text on both (`/detokenize`). A server without
        these routes (a hosted API), or a policy without a chat template, cannot be checked: logged, not refused."""
        body = {"prompt": PROBE, "add_special_tokens": False}
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        async with httpx.AsyncClient(timeout=30, headers=headers, base_url=policy_url.rstrip("/")) as http:

            async def policy_post(path: str, request: dict) -> dict:
                answer = await http.post(path, json=request)
                answer.raise_for_status()
                return answer.json()

            try:
                policy = (await policy_post("/tokenize", body))["tokens"]
                teacher = (await self.endpoint.post_once("/tokenize", body))["tokens"]
            except _UNCHECKED as error:
                log.warning("teacher: cannot compare its tokenizer with the policy's (%s); it must be the same (the "
                            "student's token ids are sent as they are)", error)  # fmt: skip
                return
            if teacher != policy:
                raise ValueError(
                    f"orchestrator.teacher: the teacher at {self.config.root} tokenizes differently from the policy "
                    f"({len(teacher)} vs {len(policy)} tokens for the same probe text, first difference at token "
                    f"{_first_difference(teacher, policy)}); on-policy distillation sends the student's token ids as "
                    "they are, so the teacher must use the policy's tokenizer (e.g. a larger model of the same family)"
                )
            # The same text tokenizes the same, yet the special tokens of the student's chat template may mean other
            # things to the teacher (DeepSeek-R1-Distill-Qwen reads Qwen's <|im_start|> id as <｜User｜>): every
            # prompt's role markers were then other tokens to it, and its log-probs of the student's replies were
            # those of another conversation, silently
            chat = {"messages": [{"role": "user", "content": PROBE}], "add_generation_prompt": True}
            try:
                ids = (await policy_post("/tokenize", chat))["tokens"]
                said = (await policy_post("/detokenize", {"tokens": ids}))["prompt"]
                heard = (await self.endpoint.post_once("/detokenize", {"tokens": ids}))["prompt"]
            except _UNCHECKED as error:
                log.warning("teacher: cannot compare the special tokens of the policy's chat template with the "
                            "teacher's (%s); they must be the same ids", error)  # fmt: skip
                return
        if heard != said:
            at = _first_difference(heard, said)
            raise ValueError(
                f"orchestrator.teacher: the teacher at {self.config.root} reads the token ids of the policy's chat "
                f"template as other text ({said[max(0, at - 10) : at + 30]!r} to the policy, "
                f"{heard[max(0, at - 10) : at + 30]!r} to the teacher): the same plain text tokenizes the same, but "
                "their special tokens differ; on-policy distillation sends the student's token ids as they are, so "
                "the teacher must use the policy's tokenizer, special tokens included"
            )

    async def aclose(self) -> None:
        await self.endpoint.aclose()


#: what a server without the route (or an answer without the field) raises: that check is skipped, logged
_UNCHECKED = (httpx.HTTPError, EndpointError, KeyError, TypeError, ValueError)


def _choice_entries(body):
    try:
        return body["choices"][0]["prompt_logprobs"]
    except (KeyError, IndexError, TypeError):
        return None


def _first_difference(a: list | str, b: list | str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
