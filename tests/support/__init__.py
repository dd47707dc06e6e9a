"""Test support shared by every test folder (imported as `support`: `tests/` is on pytest's `pythonpath`).

- `support.models`: the session's tiny model, and teaching a tiny model a few answers;
- `support.inference`: a real `gyre inference` replica on free ports (`gyre.inference_process` underneath).
- `support.kube_api`: the EndpointSlice list/watch of a Kubernetes API server (replica discovery).
- `support.judge_server`: a scripted OpenAI-compatible judge / reward-model server (`ScriptedServer`).
- `support.asgi`: a small ASGI app on a real uvicorn server in a thread of the test.

The session-scoped `tiny_model` fixture itself lives in `tests/conftest.py`.
"""
