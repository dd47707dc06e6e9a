"""A rotated `auth.api_key_file` (a Kubernetes Secret updated in place) is taken up without a restart: the real
`gyre inference` process, the official openai client over HTTP."""

from __future__ import annotations

import openai
import pytest


def models(server, key: str):
    with openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=60) as client:
        return [card.id for card in client.models.list().data]


def test_a_rotated_key_file_is_taken_up_and_the_old_key_kept_for_the_grace(start_server, tmp_path):
    key_file = tmp_path / "api-key"
    key_file.write_text("sk-old\n")
    server = start_server("--auth.api-key-file", str(key_file), "--run-id", "key-rotation-tests")
    assert models(server, "sk-old")
    with pytest.raises(openai.AuthenticationError):
        models(server, "sk-new")

    # as the kubelet does it: the new content appears at once (here a rename over the old file)
    (tmp_path / "api-key.tmp").write_text("sk-new\n")
    (tmp_path / "api-key.tmp").rename(key_file)
    assert models(server, "sk-new")  # read once, this was a 401 until a restart
    assert models(server, "sk-old")  # clients whose copy of the Secret is not rewritten yet: the grace
    with pytest.raises(openai.AuthenticationError) as refused:
        models(server, "sk-wrong")
    assert refused.value.body["code"] == "invalid_api_key"

    # a file emptied or removed mid-rotation keeps the key in force: the server never opens up
    key_file.unlink()
    with pytest.raises(openai.AuthenticationError):
        models(server, "sk-wrong")
    assert models(server, "sk-new")
