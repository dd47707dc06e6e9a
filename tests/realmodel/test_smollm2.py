"""SmolLM2-135M-Instruct, a real pretrained instruct model, through Gyre's real services.

One `gyre model import smollm2` per session (conftest.py); every step here is tiny (few prompts, few tokens), so
the file costs a few minutes of CPU: the import and its check, SFT masks with the model's own tokenizer and
template, the torch backend's log-probs against transformers and the trainer's, `gyre sft` and `gyre rl` end to end, and
`gyre eval` on each kind of environment against a real server (with its end-of-turn handling).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import torch
from gyre.events import read_events
from realmodel_testlib import ROOT, gyre

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
TEMPLATES = ROOT / "tests/unit/trainer_service/data/chat_templates"
IM_END = 2  # SmolLM2's <|im_end|>: eos, pad and the end of every turn


def test_the_packaged_gguf_imports_as_a_plain_verified_folder(smollm2_import):
    folder, run = smollm2_import
    assert "SmolLM2-135M-Instruct" in run.stderr and "dequantising" in run.stderr
    assert "loaded LlamaForCausalLM, 134.5M parameters, torch.float32" in run.stderr
    assert "differ by at most 0 (tolerance 0.0001); tokens identical, chat template identical" in run.stderr
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    assert (config["num_hidden_layers"], config["vocab_size"], config["eos_token_id"]) == (30, 49152, IM_END)
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == IM_END
    assert (folder / "chat_template.jinja").read_text() == (TEMPLATES / "smollm2.jinja").read_text()
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    # the GGUF's context length, not transformers' 1e30 for a tokenizer that sets no limit
    assert tokenizer_config["model_max_length"] == config["max_position_embeddings"] == 8192
    assert "is_local" not in tokenizer_config and "local_files_only" not in tokenizer_config


def test_sft_learns_only_the_replies_with_smollm2s_own_tokenizer_and_template(smollm2):
    from gyre.eos import end_of_turn_ids
    from gyre_trainer.sft_data import Conversation, tokenize
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6"}]  # fmt: skip
    ids, mask = tokenize(Conversation(chat), tokenizer, end_of_turn_ids(smollm2, tokenizer))
    learned = [(tokenizer.convert_ids_to_tokens(t), m) for t, m in zip(ids, mask, strict=True) if m]
    assert learned == [("4", True), ("<|im_end|>", True), ("6", True), ("<|im_end|>", True)]
    # ...and each reply is exactly the token after "<|im_start|>assistant\n", the generation prompt
    for i, m in enumerate(mask):
        if m and ids[i] != IM_END:
            assert tokenizer.decode(ids[:i]).endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_torch_backend_logprobs_equal_transformers(smollm2):
    from gyre_inference.backend import SamplingParams
    from gyre_inference.torch_backend import TorchBackend
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]
               for q in ("What is 17 + 25?", "Name a fruit.")]  # fmt: skip

    async def sample():
        engine = TorchBackend(smollm2, threads=2, max_batch_size=4, max_model_len=256)
        await engine.start()
        try:
            runs = await asyncio.gather(*(
                _collect(engine.generate(p, SamplingParams(max_tokens=12, temperature=t, seed=3)))
                for p in prompts for t in (1.0, 0.0)))  # fmt: skip
        finally:
            await engine.shutdown()
        return runs

    runs = asyncio.run(sample())
    reference = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    for (prompt, temperature), (tokens, logprobs) in zip([(p, t) for p in prompts for t in (1.0, 0.0)], runs,
                                                         strict=True):  # fmt: skip
        with torch.no_grad():
            logits = reference(torch.tensor([list(prompt) + tokens])).logits[0, len(prompt) - 1 : -1].float()
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-4), (temperature, logprobs, expected)
        if temperature == 0:
            assert tokens == logits.argmax(-1).tolist()  # greedy = transformers' argmax, token for token


def test_the_trainer_scores_sampled_tokens_at_the_log_probs_inference_reported(smollm2):
    """The importance ratio's two sides on the real model: completions sampled by the torch backend at temperatures
    other than 1, packed into one row as a batch carries them, get from the trainer the log-probs inference
    reported for exactly those tokens (no shift, the same temperature), so r = 1 on-policy."""
    from gyre.config.shared import ModelConfig
    from gyre_inference.backend import SamplingParams
    from gyre_inference.torch_backend import TorchBackend
    from gyre_trainer.model import load_model, packed_logprobs
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]
               for q in ("What is 17 + 25?", "Name a fruit.")]  # fmt: skip

    async def sample(temperature: float):
        engine = TorchBackend(smollm2, threads=2, max_batch_size=4, max_model_len=256)
        await engine.start()
        try:
            return await asyncio.gather(*(_collect(engine.generate(p, SamplingParams(max_tokens=10,
                                          temperature=temperature, seed=3))) for p in prompts))  # fmt: skip
        finally:
            await engine.shutdown()

    model = load_model(ModelConfig(name=str(smollm2)), "cpu", torch.float32)
    for temperature in (0.7, 1.3):
        runs = asyncio.run(sample(temperature))
        ids = torch.tensor([t for p, (tokens, _) in zip(prompts, runs, strict=True) for t in [*p, *tokens]])
        lengths = torch.tensor([len(p) + len(tokens) for p, (tokens, _) in zip(prompts, runs, strict=True)])
        positions = torch.cat([torch.arange(int(n)) for n in lengths])
        with torch.no_grad():
            lp, _ = packed_logprobs(model, ids, positions, lengths, temperature)
        sampled = torch.cat([torch.cat([torch.zeros(len(p), dtype=torch.bool), torch.ones(len(t), dtype=torch.bool)])
                             for p, (t, _) in zip(prompts, runs, strict=True)])  # fmt: skip
        reported = torch.tensor([x for _, logprobs in runs for x in logprobs])
        torch.testing.assert_close(lp[sampled], reported, rtol=0, atol=2e-4)


async def _collect(events):
    out = [e async for e in events]
    return [e.token_id for e in out], [e.logprob for e in out]


def test_gyre_sft_trains_a_few_steps_on_its_own_chat_template(smollm2, tmp_path):
    run = gyre("sft", "--model.name", str(smollm2), "--output-dir", str(tmp_path), "--data.env", "arithmetic",
               "--data.num-examples", "8", "--data.seq-len", "128", "--data.batch-size", "2", "--max-steps", "2",
               "--optim.lr", "1e-5", "--device", "cpu")  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    steps = read_events(tmp_path / "events" / "sft_steps.jsonl")
    assert [s["step"] for s in steps] == [1, 2] and all(0 < s["loss"] < 20 for s in steps)
    saved = tmp_path / "sft"
    assert (saved / "chat_template.jinja").read_text() == (smollm2 / "chat_template.jinja").read_text()
    assert json.loads((saved / "generation_config.json").read_text())["eos_token_id"] == IM_END


def test_gyre_rl_runs_two_steps_on_the_real_model(smollm2, tmp_path):
    config = tmp_path / "rl.toml"
    config.write_text(f"""
run_id = "smollm2-ci"
output_dir = "{tmp_path / "run"}"
max_steps = 2
[model]
name = "{smollm2}"
[inference.engine]
max_batch_size = 8
max_model_len = 512
[trainer]
weights_keep_last = 2
[trainer.lora]
rank = 4
alpha = 8
target_modules = ["q_proj", "v_proj"]
[trainer.data]
seq_len = 512
[orchestrator]
batch_size = 2
rollouts_per_example = 2
max_async_level = 1
[orchestrator.env]
name = "arithmetic"
[orchestrator.sampling]
max_tokens = 12
temperature = 1.0
seed = 5
[orchestrator.advantage]
drop_zero_signal = false
[orchestrator.batch]
seq_len = 512
[orchestrator.rollouts]
interval = 1
""")
    run = gyre("rl", "@", str(config), timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    out = tmp_path / "run"
    assert [s["step"] for s in read_events(out / "events" / "trainer_steps.jsonl")] == [1, 2]
    steps = read_events(out / "events" / "orchestrator_steps.jsonl")
    assert [s["step"] for s in steps] == [1, 2] and all(s["num_samples"] == 4 for s in steps)
    dumped = [json.loads(line) for line in (out / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    assert len(dumped) == 4 and all(r["completion"][0]["role"] == "assistant" for r in dumped)
    # the special tokens stay out of the text the environment scores
    assert not any("<|im_end|>" in r["completion"][0]["content"] for r in dumped)


KINDS = {
    "arithmetic": {},
    "dataset": {"path": str(ROOT / "tests/unit/envs/data/reverse_words.jsonl"), "system_prompt": "Reverse the text.",
                "reward": "exact"},
    "reasoning_gym:chain_sum": {"config": {"min_terms": 2, "max_terms": 2, "max_digits": 1}, "num_eval": 4},
    "verifiers:vf_gyre_tasks": {"taskset": {"source": "calculator"}, "num_eval": 4},
}  # fmt: skip


@pytest.fixture(scope="module")
def smollm2_server(smollm2, tmp_path_factory):
    from support.inference import InferenceServer

    server = InferenceServer(smollm2, "--engine.max-model-len", "1024", "--engine.max-batch-size", "8",
                             log_dir=tmp_path_factory.mktemp("smollm2-inference"))  # fmt: skip
    yield server
    server.stop()


def test_a_served_reply_ends_at_the_end_of_turn_token(smollm2_server):
    import openai

    client = openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="unused")
    reply = client.chat.completions.create(
        model=smollm2_server.model_name, messages=[{"role": "user", "content": "Say hello."}], max_tokens=64,
        temperature=0, logprobs=True, extra_body={"return_token_ids": True},
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and choice.token_ids[-1] == IM_END  # stopped at <|im_end|>, kept in ids
    assert choice.message.content and "<|im_end|>" not in choice.message.content  # and out of the text


@pytest.mark.parametrize("name", sorted(KINDS))
def test_gyre_eval_on_each_kind_of_environment(smollm2_server, tmp_path, name):
    if name.startswith("reasoning_gym"):
        pytest.importorskip("reasoning_gym")
    if name.startswith("verifiers"):
        pytest.importorskip("verifiers.v1")
    path = os.pathsep.join(filter(None, [str(ROOT / "tests/verifiers_envs"), os.environ.get("PYTHONPATH")]))
    run = gyre("eval", "--output-dir", str(tmp_path), "--env.name", name, "--env.args", json.dumps(KINDS[name]),
               "--inference.urls", json.dumps([smollm2_server.url]), "--eval.num-examples", "2", "--eval.k", "2",
               "--sampling.max-tokens", "24", "--sampling.seed", "1", env={"PYTHONPATH": path})  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["env"] == name and result["num_examples"] == 2 and result["k"] == 2
    assert 0.0 <= result["avg_at_k"] <= 1.0 and 0.0 <= result["pass_at_k"] <= 1.0
    assert read_events(Path(tmp_path) / "events/eval.jsonl")[-1]["avg_at_k"] == result["avg_at_k"]
