"""A real `gyre inference` replica serves vLLM's runtime LoRA routes when `lora.runtime_updates` is set, or vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING=true is in its environment; behind the control token when one is configured."""

from __future__ import annotations

import json

import httpx
import openai
import pytest


def write_adapter(tiny_model, folder) -> None:
    import peft
    from gyre.lora import ADAPTER_CONFIG, ADAPTER_FILE, adapter_config, adapter_tensors
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in adapter_tensors(model.state_dict()).items()}, folder / ADAPTER_FILE)
    (folder / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(4, 8, 0.0, ["q_proj", "v_proj"], str(tiny_model))))


def load_list_unload(server, folder, token: str | None) -> None:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    root = server.base_url.removesuffix("/v1")
    with httpx.Client(timeout=60) as raw, openai.OpenAI(base_url=server.base_url, api_key="unused") as client:
        if token:
            assert (
                raw.post(root + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "y"}).status_code == 401
            )
        response = raw.post(root + "/v1/load_lora_adapter", json={"lora_name": "ops", "lora_path": str(folder)},
                            headers=headers)  # fmt: skip
        assert response.status_code == 200, response.text
        assert [card.id for card in client.models.list().data][1:] == ["ops"]
        assert client.completions.create(model="ops", prompt=[5, 6], max_tokens=2).model == "ops"
        response = raw.post(root + "/v1/unload_lora_adapter", json={"lora_name": "ops"}, headers=headers)
        assert response.status_code == 200, response.text
        assert [card.id for card in client.models.list().data][1:] == []


@pytest.mark.parametrize("switch", ["config", "env"])
def test_the_routes_are_served_when_turned_on(start_server, tiny_model, tmp_path, monkeypatch, switch):
    write_adapter(tiny_model, tmp_path / "adapter")
    args = ["--lora.max-loras", "1", "--lora.max-rank", "4", "--run-id", f"runtime-lora-{switch}"]
    if switch == "config":
        server = start_server(*args, "--lora.runtime-updates", "true", "--auth.control-token", "operator-token")
        load_list_unload(server, tmp_path / "adapter", "operator-token")
    else:
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
        server = start_server(*args)
        load_list_unload(server, tmp_path / "adapter", None)
    server.stop()
