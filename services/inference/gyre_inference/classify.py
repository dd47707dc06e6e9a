"""Reward models: `gyre inference --runner pooling` serves a sequence-classification model on vLLM's `/classify`.

    request:  {"model", "input": str | [str] | [int] | [[int]], "use_activation": bool, "add_special_tokens"}
              or {"model", "messages": [chat messages]} (one conversation, rendered by the model's chat template)
    response: {"id", "object": "list", "created", "model", "usage",
               "data": [{"index", "label", "probs": [float] * num_classes, "num_classes"}]}

As vLLM's (`vllm serve --runner pooling`, its `classify` task): the model's score head on the hidden state of
each input's LAST token (no padding token is ever looked for, so a conversation ending in the pad token still
scores at its end), then an activation unless `use_activation: false` (`activation` is vLLM's older name):
softmax over the classes, or sigmoid for a one-label model. A reward model's score is its raw logit:
`use_activation: false` with one label (what `gyre.envs.reward_model.RewardModel` sends). Inputs of one request run as
one right-padded batch. Generation routes on such a server answer 400 (and /classify on a generative one).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Annotated

import torch
from fastapi import FastAPI
from gyre.model_shape import served_context
from gyre.transport import FetchedWeights
from pydantic import Field, model_validator

from gyre_inference.backend import Backend, BackendStoppedError, SamplingParams, TokenEvent, WeightsIncompatibleError
from gyre_inference.chat_messages import ChatMessage
from gyre_inference.cpus import default_engine_threads
from gyre_inference.errors import APIError, unknown_model
from gyre_inference.strict import ParamError, StrictModel
from gyre_inference.torch_backend import resolve_device, resolve_dtype

log = logging.getLogger(__name__)

MAX_INPUTS = 256
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class ClassifierBackend(Backend):
    """A transformers `*ForSequenceClassification` decoder (Llama, Qwen2/3, Mistral: a `score` head) on one thread."""

    name = "torch"
    runner = "pooling"

    def __init__(self, model_path: str | Path, *, device: str = "auto", dtype: str = "auto",
                 max_model_len: int | None = None, threads: int | None = None):  # fmt: skip
        self.model_path = Path(model_path)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self._requested_max_len = max_model_len
        self._threads = threads
        self._model = None
        self._max_model_len = 0
        self._lock = threading.Lock()  # one forward at a time; requests queue on the executor
        self._running = 0

    @property
    def ready(self) -> bool:
        return self._model is not None

    @property
    def version(self) -> int:
        return 0

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def labels(self) -> list[str]:
        config = self._model.config
        return [config.id2label.get(i, f"LABEL_{i}") for i in range(config.num_labels)]

    def load_stats(self) -> tuple[int, int]:
        return self._running, 0

    async def start(self) -> None:
        await asyncio.to_thread(self._load)

    def _load(self) -> None:
        from transformers import AutoModelForSequenceClassification

        model = AutoModelForSequenceClassification.from_pretrained(self.model_path, dtype=self.dtype)
        if not hasattr(model, "score") or not hasattr(model, "base_model"):
            raise ValueError(f"{type(model).__name__}: runner pooling serves decoder classifiers with a `score` "
                             "head (Llama, Mistral, Qwen2, Qwen3 *ForSequenceClassification)")  # fmt: skip
        self._max_model_len = served_context(model.config, self._requested_max_len)
        self._model = model.to(self.device).eval().requires_grad_(False)
        log.info("loaded %s (%s, %d labels)", self.model_path, type(model).__name__, model.config.num_labels)

    async def shutdown(self) -> None:
        self._model = None

    async def classify(self, inputs: list[list[int]]) -> list[list[float]]:
        """Raw scores (logits) of each token list at its last token: [len(inputs)][num_labels]."""
        if self._model is None:
            raise BackendStoppedError("the classifier is not loaded")
        self._running += len(inputs)
        try:
            return await asyncio.to_thread(self._forward, inputs)
        finally:
            self._running -= len(inputs)

    def _forward(self, inputs: list[list[int]]) -> list[list[float]]:
        with self._lock, torch.inference_mode():
            if self.device.type == "cpu":
                torch.set_num_threads(self._threads or default_engine_threads())
            width = max(len(ids) for ids in inputs)
            ids = torch.zeros(len(inputs), width, dtype=torch.long)
            mask = torch.zeros(len(inputs), width, dtype=torch.long)
            for row, tokens in enumerate(inputs):
                ids[row, : len(tokens)] = torch.tensor(tokens)
                mask[row, : len(tokens)] = 1
            hidden = self._model.base_model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device))
            last = torch.tensor([len(tokens) - 1 for tokens in inputs], device=self.device)
            states = hidden.last_hidden_state[torch.arange(len(inputs), device=self.device), last]
            return self._model.score(states).float().cpu().tolist()

    async def generate(self, prompt: list[int], params: SamplingParams):  # pragma: no cover - refused by the API
        raise BackendStoppedError("a pooling model does not generate")
        yield TokenEvent(0, 0.0, 0)

    async def update_weights(self, weights: FetchedWeights) -> None:
        raise WeightsIncompatibleError("a reward model (runner = pooling) takes no weight updates")

    async def reload_base(self) -> None:
        raise WeightsIncompatibleError("a reward model (runner = pooling) takes no weight updates")


class ClassifyRequest(StrictModel):
    """vLLM's classification request (completion form, or its chat form with `messages`)."""

    model: str | None = Field(None, description="Served model id (see GET /v1/models).")
    input: str | TokenIds | Annotated[list[str], Field(min_length=1, max_length=MAX_INPUTS)] | Annotated[
        list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)
    ] | None = Field(None, description="Text(s) or token id list(s) to classify.")  # fmt: skip
    messages: list[ChatMessage] | None = Field(None, min_length=1, description="One conversation (vLLM's chat form).")
    add_special_tokens: bool = Field(True, description="Tokenize text input with the tokenizer's special tokens.")
    use_activation: bool | None = Field(None, description="Softmax (sigmoid for one label); default true.")
    activation: bool | None = Field(None, description="vLLM's older name of use_activation.")
    user: str | None = Field(None, description="Ignored.")

    @model_validator(mode="after")
    def _one_form(self):
        if (self.input is None) == (self.messages is None):
            raise ValueError("give input or messages (exactly one)")
        if self.use_activation is not None and self.activation is not None:
            raise ParamError("activation", "give use_activation or activation, not both")
        return self

    def inputs(self) -> list[str | list[int]]:
        value = self.input
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            return [value]
        return list(value)


def add_classify_route(app: FastAPI, state) -> None:
    """Register `POST /classify` and `POST /v1/classify` on the inference app (`state`: api.AppState)."""

    async def classify(body: ClassifyRequest) -> dict:
        backend = state.backend
        if getattr(backend, "runner", "generate") != "pooling":
            raise APIError(400, "this server runs a generative model: /classify needs a reward model served with "
                                "--runner pooling", param="model")  # fmt: skip
        if body.model is not None and body.model != state.model_id:
            raise unknown_model(body.model, state.model_id)
        if body.messages is not None:
            messages = [message.model_dump(exclude_none=True) for message in body.messages]
            inputs = [await asyncio.to_thread(state.text.chat_prompt, messages, None, False)]
        else:
            inputs = []
            for i, item in enumerate(body.inputs()):
                param = "input" if len(body.inputs()) == 1 else f"input.{i}"
                if isinstance(item, str):
                    inputs.append(await asyncio.to_thread(state.text.encode, item, body.add_special_tokens))
                else:
                    inputs.append(state.text.check_ids(item, param))
        for i, tokens in enumerate(inputs):
            if not tokens or len(tokens) > backend.max_model_len:
                message = f"input {i} has {len(tokens)} tokens; this model takes 1 to {backend.max_model_len}"
                raise APIError(400, message, param="input", code="context_length_exceeded")
        started = time.monotonic()
        try:
            scores = await backend.classify(inputs)
        except Exception:
            state.metrics.request_done("classify", "server_error", time.monotonic() - started)
            raise
        activate = body.use_activation if body.use_activation is not None else body.activation
        labels = backend.labels
        data = []
        for index, row in enumerate(scores):
            values = torch.tensor(row)
            if activate is not False:
                values = values.sigmoid() if len(row) == 1 else values.softmax(-1)
            data.append({"index": index, "label": labels[int(values.argmax())], "probs": values.tolist(),
                         "num_classes": len(row)})  # fmt: skip
        tokens = sum(len(t) for t in inputs)
        state.metrics.prompt_tokens.labels(state.metrics.run_id).inc(tokens)
        state.metrics.request_done("classify", "success", time.monotonic() - started)
        return {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": state.model_id, "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                          "prompt_tokens_details": None}}  # fmt: skip

    summary = "vLLM-compatible: scores of a sequence-classification (reward) model, runner = pooling."
    app.post("/classify", summary=summary)(classify)
    app.post("/v1/classify", summary=summary)(classify)
