"""A scripted OpenAI-compatible judge / reward-model server (a documented test double of a judge model).

It answers what the test tells it (late when told, with an error status when told), served by uvicorn on a free
port in the test's own process, so the judges' HTTP client (timeouts, retries, concurrency, cache, counters) runs
for real. Used by tests/unit/envs/test_env_judges.py and `gyre eval`'s judge test.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


class ScriptedServer:
    """On `port` (default: a free one): /v1/models (first the answers of `models_script`), /v1/chat/completions
    (replies from `script`: text, ("sleep", s, text), ("hold", threading.Event, text) (answered once the event
    is set, at most 60 s later: a request held in flight as long as a test needs), ("length", text) (cut at
    max_tokens), ("status", code[, headers[, message]]), ("raw", body, content type) (a body as given, e.g. broken
    JSON) or ("trickle", seconds, text) (a space every 0.1 s for `seconds`, then the answer: each read is quick,
    the whole answer slow); first `reply_for`'s reply to what is asked, when it gives one), /tokenize (one token per
    character), /classify (score = number of tokens / 10; a 400 for an input longer than `max_len`; first the bodies
    of `classify_script`). Records every request.
    `base`: where the OpenAI routes are (/v1beta/openai: as Gemini serves them)."""

    def __init__(self, port: int = 0, base: str = "/v1"):
        self.script: list = []
        self.requests: list[tuple[str, dict]] = []
        self.auth: list[str | None] = []
        self.max_len: int | None = None  # /classify refuses a longer input (400), as a real server's context
        self.classify_script: list[str] = []  # raw JSON bodies /classify answers first (a misbehaving server)
        self.models_script: list[tuple] = []  # (body, content type[, status]) /v1/models answers first
        #: the last message's content -> the chat reply (an action as in `script`), or None for the script's next
        self.reply_for: Callable[[str], Any] | None = None
        app = FastAPI()

        @app.get(f"{base}/models")
        async def models():
            if self.models_script:  # (body, content type[, status]): a 503 of a model still loading
                body, media_type, *status = self.models_script.pop(0)
                return Response(body, media_type=media_type, status_code=status[0] if status else 200)
            return {"object": "list", "data": [{"id": "judge-model", "object": "model", "created": 0, "owned_by": "x"}]}

        @app.post(f"{base}/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            self.requests.append(("chat", body))
            self.auth.append(request.headers.get("authorization"))
            # a reply chosen by what is asked (concurrent calls take the script's replies in no set order)
            chosen = self.reply_for(body["messages"][-1]["content"]) if self.reply_for else None
            action = chosen if chosen is not None else self.script.pop(0) if self.script else "5"
            if isinstance(action, tuple) and action[0] == "sleep":
                await asyncio.sleep(action[1])
                action = action[2]
            if isinstance(action, tuple) and action[0] == "hold":
                await asyncio.to_thread(action[1].wait, 60)
                action = action[2]
            if isinstance(action, tuple) and action[0] == "raw":
                return Response(action[1], media_type=action[2])
            if isinstance(action, tuple) and action[0] == "trickle":
                answer = {"id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
                          "choices": [{"index": 0, "message": {"role": "assistant", "content": action[2]},
                                       "finish_reason": "stop"}]}  # fmt: skip

                async def trickle():
                    for _ in range(int(action[1] * 10)):
                        yield b" "  # JSON allows leading whitespace: the body is valid once it ends
                        await asyncio.sleep(0.1)
                    yield json.dumps(answer).encode()

                return StreamingResponse(trickle(), media_type="application/json")
            finish = "stop"
            if isinstance(action, tuple) and action[0] == "length":  # ("length", text): cut at max_tokens
                finish, action = "length", action[1]
            if isinstance(action, tuple) and action[0] == "status":  # ("status", code[, headers[, message]])
                headers = action[2] if len(action) > 2 else None
                message = action[3] if len(action) > 3 else "scripted"
                return JSONResponse({"error": {"message": message, "type": "x"}}, status_code=action[1],
                                    headers=headers)  # fmt: skip
            return {"id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": action},
                                 "finish_reason": finish}]}  # fmt: skip

        @app.post("/tokenize")
        async def tokenize(request: Request):
            body = await request.json()
            self.requests.append(("tokenize", body))

            def text_of(content):  # a string, or a list of text parts
                return content if isinstance(content, str) else "".join(part["text"] for part in content)

            text = body["prompt"] if "prompt" in body else "".join(text_of(m["content"]) for m in body["messages"])
            return {"tokens": [ord(c) for c in text], "count": len(text), "max_model_len": 1000, "token_strs": None}

        @app.post("/classify")
        async def classify(request: Request):
            body = await request.json()
            self.requests.append(("classify", body))
            if self.classify_script:
                return Response(self.classify_script.pop(0), media_type="application/json")
            too_long = [i for i, ids in enumerate(body["input"]) if self.max_len and len(ids) > self.max_len]
            if too_long:  # as `gyre inference --runner pooling` refuses a conversation longer than its context
                message = f"input {too_long[0]} has too many tokens; this model takes 1 to {self.max_len}"
                return JSONResponse({"error": {"message": message, "type": "BadRequestError"}}, status_code=400)
            data = [{"index": i, "label": "reward", "probs": [len(ids) / 10], "num_classes": 1}
                    for i, ids in enumerate(body["input"])]  # fmt: skip
            return {"id": "x", "object": "list", "created": 0, "model": body["model"], "data": data}

        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ScriptedServer:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def count(self, kind: str) -> int:
        return sum(1 for k, _ in self.requests if k == kind)
