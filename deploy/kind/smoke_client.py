"""Smoke checks against a running Gyre experiment: the API answers and the trainer trains.

    python deploy/kind/smoke_client.py --base-url http://127.0.0.1:8000/v1 --api-key "$GYRE_API_KEY" \
        --trainer 127.0.0.1:50071 --min-steps 3 --timeout 900

Checks, in order (exit 0 when all pass, 1 with the reason otherwise):
1. `GET /v1/models` with the API key lists a model (retried while the model loads);
2. one `POST /v1/chat/completions` through the official `openai` client returns a choice with its token
   ids (`return_token_ids`) and the policy version that generated it;
3. the trainer's `gyre.v1.Trainer/GetStatus` reports `step >= --min-steps` (polled until --timeout).

Used by deploy/kind/smoke.sh (through `kubectl port-forward`), by the container smoke
(deploy/docker/smoke.py, through published ports) and by the chart's wiring test (against the rendered
commands run as local processes), so all three check the same things.
"""

from __future__ import annotations

import argparse
import sys
import time


def wait_for_model(base_url: str, api_key: str, deadline: float) -> str:
    from openai import OpenAI, OpenAIError

    client = OpenAI(base_url=base_url, api_key=api_key, timeout=30, max_retries=0)
    while True:
        try:
            models = [m.id for m in client.models.list()]
            if models:
                return models[0]
            problem = "no model listed"
        except OpenAIError as error:  # not ready yet (503), port-forward not up, ...
            problem = f"{type(error).__name__}: {error}"
        if time.monotonic() > deadline:
            raise SystemExit(f"smoke: /v1/models never listed a model: {problem}")
        time.sleep(2)


def chat_once(base_url: str, api_key: str, model: str) -> tuple[str, list[int], int]:
    """One chat completion asking for token ids: (text, the choice's token ids, its policy version)."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key, timeout=120, max_retries=3)
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Reverse the text: kind smoke"}],
        max_tokens=16,
        extra_body={"return_token_ids": True},
    )
    if not reply.choices:
        raise SystemExit("smoke: chat completion returned no choices")
    choice = reply.choices[0]
    token_ids, version = getattr(choice, "token_ids", None), getattr(choice, "policy_version", None)
    if not token_ids or not all(isinstance(t, int) for t in token_ids):
        raise SystemExit(f"smoke: chat completion has no token ids (return_token_ids): {choice}")
    if not isinstance(version, int):
        raise SystemExit(f"smoke: chat completion has no policy_version: {choice}")
    return choice.message.content or "", token_ids, version


def wait_for_steps(address: str, min_steps: int, deadline: float) -> int:
    import grpc
    from gyre.v1 import trainer_pb2, trainer_pb2_grpc

    step, problem = -1, ""
    with grpc.insecure_channel(address) as channel:
        stub = trainer_pb2_grpc.TrainerStub(channel)
        while True:
            try:
                step = stub.GetStatus(trainer_pb2.GetTrainerStatusRequest(), timeout=10).step
                problem = f"at step {step}"
                if step >= min_steps:
                    return step
            except grpc.RpcError as error:
                problem = f"{error.code().name}: {error.details()}"
            if time.monotonic() > deadline:
                raise SystemExit(f"smoke: trainer did not reach step {min_steps} in time ({problem})")
            time.sleep(3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True, help="OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", required=True, help="inference API key")
    parser.add_argument("--trainer", required=True, help="host:port of the trainer's gRPC status server")
    parser.add_argument("--min-steps", type=int, default=3, help="training steps to wait for")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for the whole check")
    args = parser.parse_args(argv)

    deadline = time.monotonic() + args.timeout
    model = wait_for_model(args.base_url, args.api_key, deadline)
    print(f"smoke: /v1/models lists {model!r}", flush=True)
    text, token_ids, version = chat_once(args.base_url, args.api_key, model)
    print(f"smoke: chat completion: {text!r}, token_ids {token_ids}, policy_version {version}", flush=True)
    step = wait_for_steps(args.trainer, args.min_steps, deadline)
    print(f"smoke: trainer at step {step} (>= {args.min_steps})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
