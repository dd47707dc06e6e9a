"""How Gyre hands a chat to a model's chat template, the same way when serving (`/v1/chat/completions`) and
when training (`gyre sft`), so the model learns on exactly the text it is later given."""

from __future__ import annotations

from typing import Any


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` as chat templates know them: OpenAI's `developer` role is what templates call `system`
    (a template that does not know the role renders it as a turn of its own, or refuses it)."""
    return [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
