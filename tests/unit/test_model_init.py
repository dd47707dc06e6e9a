"""`gyre model init`: the tiny Llama + byte-level BPE tokenizer reload offline and behave as documented."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from gyre import model_init
from gyre.model_init import PRESETS, init_model, parameter_count
from gyre.tiny_tokenizer import ENDOFTEXT, IM_END, IM_START
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

SAMPLE_TEXTS = [
    "Hello, world!",
    "Reverse the text: the quick brown fox\nxof nworb kciuq eht",
    "What is 12345 + 678?\nThe answer is \\boxed{13023}.",
    "Sort: pear, apple, kiwi -> apple, kiwi, pear",
    "  leading spaces, trailing spaces  \n\n\ttabs\r\nwindows newline",
    'Call <tool_call>\n{"name": "calculator", "arguments": {"expression": "(3 + 4) * 5"}}\n</tool_call>',
    "unicode: café naïve Zürich 東京 Москва 😀🚀 ≤ ± π",
    "spaces before punctuation , and . stay as written ?",
    f"{IM_START}user\nhi{IM_END}\n{ENDOFTEXT}",
    "-3.1415 0 007 1e10 $100,000",
    "",
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


def file_hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return init_model(tmp_path_factory.mktemp("tiny") / "model", preset="tiny", seed=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)


@pytest.fixture(scope="module")
def raw_tokenizer(tiny_dir) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))


def run_python(code: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter with an empty HF cache and the hub switched off."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home"), **env}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full_env, timeout=300
    )


# --- files, reload, determinism ----------------------------------------------------------------------


def test_folder_holds_the_hf_files_and_nothing_else(tiny_dir):
    assert sorted(p.name for p in tiny_dir.iterdir()) == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert not list(tiny_dir.parent.glob(".tmp-*")), "staging folder left behind"


def test_reloads_offline_in_a_fresh_process_and_generates(tiny_dir, tmp_path):
    code = f"""
        import json, torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        model = AutoModelForCausalLM.from_pretrained({str(tiny_dir)!r})
        tok = AutoTokenizer.from_pretrained({str(tiny_dir)!r})
        prompt = tok.apply_chat_template([{{"role": "user", "content": "What is 2 + 2?"}}],
                                         add_generation_prompt=True, return_tensors="pt", return_dict=True)
        out = model.generate(**prompt, max_new_tokens=5, do_sample=False)
        print(json.dumps({{"arch": type(model).__name__, "dtype": str(model.dtype), "vocab": len(tok),
                           "new_tokens": out.shape[1] - prompt["input_ids"].shape[1],
                           "ids": tok.encode("12 + 7 = 19")}}))
    """
    result = run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout.strip().splitlines()[-1])
    assert info["arch"] == "LlamaForCausalLM"
    assert info["dtype"] == "torch.float32"
    assert info["vocab"] == PRESETS["tiny"].vocab_size
    assert 1 <= info["new_tokens"] <= 5
    assert info["ids"] == Tokenizer.from_file(str(tiny_dir / "tokenizer.json")).encode("12 + 7 = 19").ids


def test_cli_in_a_fresh_process_writes_byte_identical_files(tiny_dir, tmp_path):
    # Also proves determinism across processes (Rust hash seeds, thread scheduling), not only within one.
    target = tmp_path / "cli-model"
    code = f"import sys; from gyre.cli import main; sys.exit(main(['model', 'init', '--output-dir', {str(target)!r}]))"
    result = run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert file_hashes(target) == file_hashes(tiny_dir)
    assert "1,115,264 parameters" in result.stdout and str(target) in result.stdout


def test_same_seed_gives_byte_identical_files(tiny_dir, tmp_path):
    assert file_hashes(init_model(tmp_path / "again", seed=0)) == file_hashes(tiny_dir)


def test_different_seed_gives_different_weights(tiny_dir, tmp_path):
    base = load_file(tiny_dir / "model.safetensors")
    other = load_file(init_model(tmp_path / "seed1", seed=1) / "model.safetensors")
    assert base.keys() == other.keys()
    random_matrices = [name for name, tensor in base.items() if tensor.dim() == 2]
    assert len(random_matrices) == 2 + 7 * PRESETS["tiny"].num_hidden_layers  # embed, lm_head, q k v o gate up down
    for name in random_matrices:
        assert base[name].shape == other[name].shape
        assert not torch.equal(base[name], other[name]), name


def test_init_does_not_touch_the_callers_rng(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    init_model(tmp_path / "m", seed=5)
    assert torch.equal(torch.rand(3), expected)


# --- sizes ---------------------------------------------------------------------------------------------


def test_tiny_has_about_a_million_parameters(tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True)
    counted = sum(p.numel() for p in model.parameters())
    assert parameter_count(tiny_dir) == counted  # header-only count agrees with torch
    assert 700_000 <= counted <= 1_500_000
    assert not model.config.tie_word_embeddings


@pytest.mark.parametrize(("preset", "low", "high"), [("small", 3e6, 5e6), ("medium", 15e6, 25e6)])
def test_larger_presets(preset, low, high, tmp_path):
    shape = PRESETS[preset]
    assert (shape.hidden_size // shape.num_attention_heads) % 8 == 0  # vLLM attention kernels need this
    assert shape.num_attention_heads % shape.num_key_value_heads == 0  # grouped-query attention
    path = init_model(tmp_path / preset, preset=preset)
    assert low <= parameter_count(path) <= high
    config = json.loads((path / "config.json").read_text())
    assert config["num_key_value_heads"] == shape.num_key_value_heads < shape.num_attention_heads
    # The generated corpus yields enough merges to fill the larger vocabulary too.
    assert len(AutoTokenizer.from_pretrained(path, local_files_only=True)) == config["vocab_size"] == shape.vocab_size


def test_vocab_and_context_overrides(tmp_path):
    path = init_model(tmp_path / "m", vocab_size=512, max_position_embeddings=256)
    config = json.loads((path / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert config["vocab_size"] == 512 == len(tokenizer)
    assert config["max_position_embeddings"] == 256 == tokenizer.model_max_length


# --- tokenizer -----------------------------------------------------------------------------------------


def test_special_tokens_and_eos_ids(tiny_dir, tokenizer):
    config = json.loads((tiny_dir / "config.json").read_text())
    generation = json.loads((tiny_dir / "generation_config.json").read_text())
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    assert [tokenizer.convert_tokens_to_ids(t) for t in (ENDOFTEXT, IM_START, IM_END)] == [0, 1, 2]
    assert tokenizer.eos_token == tokenizer.pad_token == ENDOFTEXT
    assert tokenizer.bos_token is None
    assert config["eos_token_id"] == generation["eos_token_id"] == im_end  # generation stops at end of turn
    assert config["pad_token_id"] == generation["pad_token_id"] == tokenizer.pad_token_id
    assert config["model_type"] == "llama"
    assert len(tokenizer) == config["vocab_size"]


def test_tool_tags_are_single_tokens_that_survive_skip_special_tokens(tokenizer):
    text = f'{IM_START}assistant\n<tool_call>\n{{"name": "calculator"}}\n</tool_call>{IM_END}'
    ids = tokenizer.encode(text)
    for tag in ("<tool_call>", "</tool_call>"):
        assert tokenizer.convert_tokens_to_ids(tag) in ids
    decoded = tokenizer.decode(ids, skip_special_tokens=True)
    assert decoded == 'assistant\n<tool_call>\n{"name": "calculator"}\n</tool_call>'


@pytest.mark.parametrize("text", SAMPLE_TEXTS)
def test_raw_and_auto_tokenizer_agree_and_round_trip(text, tokenizer, raw_tokenizer):
    ids = tokenizer.encode(text)
    assert ids == raw_tokenizer.encode(text).ids
    assert tokenizer.decode(ids) == text


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=80))
def test_any_text_round_trips(text, tokenizer, raw_tokenizer):
    ids = tokenizer.encode(text)
    assert ids == raw_tokenizer.encode(text).ids
    assert tokenizer.decode(ids) == text


def test_digits_are_single_tokens(tokenizer):
    # Regular number tokenisation is what lets a tiny model learn arithmetic.
    tokens = tokenizer.convert_ids_to_tokens(tokenizer.encode("x = 9876543210 + 42"))
    assert [t for t in tokens if any(c.isdigit() for c in t)] == list("9876543210") + ["4", "2"]


def test_task_text_tokenises_compactly(tokenizer):
    # The corpus covers the built-in environments' text, so common words are whole tokens.
    for word in (" the", " answer", " calculator", " expression", " alphabetically", "Reverse"):
        assert len(tokenizer.encode(word)) == 1, word


# --- chat template -------------------------------------------------------------------------------------


def test_chat_template_renders_chatml_and_round_trips(tokenizer):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": [{"type": "text", "text": "And 3 + 3?"}]},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nAnd 3 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert ids.count(tokenizer.convert_tokens_to_ids(IM_START)) == 5
    assert ids.count(tokenizer.convert_tokens_to_ids(IM_END)) == 4
    without_prompt = tokenizer.apply_chat_template(messages, tokenize=False)
    assert without_prompt + "<|im_start|>assistant\n" == text


def test_chat_template_lists_tools_and_renders_tool_calls(tokenizer):
    messages = [
        {"role": "system", "content": "Use the calculator."},
        {"role": "user", "content": "What is 6 * 7?"},
        # OpenAI shape: arguments as a JSON string.
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "6 * 7"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        # HF shape: arguments as a dict, after some text.
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [{"name": "calculator", "arguments": {"expression": "42"}}],
        },
    ]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nUse the calculator.\n\n# Tools")
    listed = system.split("<tools>\n")[1].split("\n</tools>")[0]
    assert [json.loads(line) for line in listed.splitlines()] == TOOLS
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n'
        "</tool_call><|im_end|>\n<|im_start|>tool\n42<|im_end|>\n"
        '<|im_start|>assistant\nChecking.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "42"}}\n'
        "</tool_call><|im_end|>\n"
    ) in text
    calls = [json.loads(chunk.split("</tool_call>")[0]) for chunk in text.split("<tool_call>\n")[2:]]
    assert calls == [
        {"name": "calculator", "arguments": {"expression": "6 * 7"}},
        {"name": "calculator", "arguments": {"expression": "42"}},
    ]
    no_tools = tokenizer.apply_chat_template(messages[:2], tokenize=False)
    assert "# Tools" not in no_tools and no_tools.startswith("<|im_start|>system\nUse the calculator.<|im_end|>")


def test_template_is_append_only_across_turns(tokenizer):
    # Multi-turn rollouts splice each turn's prompt onto the tokens sampled so far: the prompt for turn k+1
    # must extend (prompt for turn k) + (sampled reply ending in <|im_end|>), in text and in token ids.
    calc_call = {"name": "calculator", "arguments": {"expression": "17*3"}}
    conversation = [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "What is 17 * 3?"},
        {"role": "assistant", "content": "", "tool_calls": [calc_call]},
        {"role": "tool", "content": '{"result": 51}'},
        {"role": "assistant", "content": "17 * 3 = 51"},
        {"role": "user", "content": "Thanks!"},
    ]
    replies = {
        2: '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17*3"}}\n</tool_call>',
        4: "17 * 3 = 51",
    }
    for k, reply in replies.items():
        render = {"tools": TOOLS, "add_generation_prompt": True, "tokenize": False}
        prompt = tokenizer.apply_chat_template(conversation[:k], **render)
        sampled = prompt + reply + IM_END
        next_prompt = tokenizer.apply_chat_template(conversation[: k + 2], **render)
        assert next_prompt.startswith(sampled)
        sampled_ids = tokenizer.encode(prompt) + tokenizer.encode(reply + IM_END)
        assert tokenizer.encode(next_prompt)[: len(sampled_ids)] == sampled_ids


def test_assistant_mask_covers_replies_and_their_end_of_turn(tokenizer):
    messages = [
        {"role": "user", "content": "Reverse: abc"},
        {"role": "assistant", "content": "cba"},
        {"role": "user", "content": "Again: xy"},
        {"role": "assistant", "content": "yx"},
    ]
    encoded = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    trained = [i for i, keep in zip(encoded["input_ids"], encoded["assistant_masks"], strict=True) if keep]
    assert tokenizer.decode(trained) == "cba<|im_end|>yx<|im_end|>"


def test_unknown_role_is_a_clear_error(tokenizer):
    with pytest.raises(Exception, match="unknown chat role robot"):
        tokenizer.apply_chat_template([{"role": "robot", "content": "beep"}], tokenize=False)


def test_generation_stops_at_im_end(tiny_dir, tokenizer):
    # Force <|im_end|> as the third new token: generate must stop there using only the saved generation config.
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True)
    im_end = tokenizer.convert_tokens_to_ids(IM_END)

    def force_im_end_third(batch_id, input_ids):
        return [im_end] if input_ids.shape[0] - prompt_len == 2 else list(range(3, len(tokenizer)))

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    prompt_len = prompt["input_ids"].shape[1]
    out = model.generate(**prompt, max_new_tokens=20, do_sample=False, prefix_allowed_tokens_fn=force_im_end_third)
    new = out[0, prompt_len:].tolist()
    assert len(new) == 3 and new[-1] == im_end


# --- bad input loses nothing ---------------------------------------------------------------------------


def test_existing_folder_is_refused_and_left_intact(tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "keep.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="overwrite"):
        init_model(target)
    assert [p.name for p in target.iterdir()] == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_overwrite_replaces_the_folder(tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "config.json").write_text("{}")  # a model folder
    (target / "stale.txt").write_text("old")
    init_model(target, overwrite=True)
    assert not (target / "stale.txt").exists() and (target / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no staging or retired folders


@pytest.mark.parametrize("command", ["init", "import"])
def test_overwrite_never_replaces_a_folder_that_is_not_a_model(tmp_path, tiny_dir, command, capsys):
    # `--output-dir outputs/demo --overwrite` deleted a whole run (checkpoints, weights), `--output-dir .` a project
    from gyre import model_import

    run = tmp_path / "run"
    (run / "checkpoints" / "trainer" / "step_3").mkdir(parents=True)
    (run / "notes.txt").write_text("precious")
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    if command == "init":
        code = model_init.main(["--output-dir", str(run), "--overwrite"])
    else:
        code = model_import.main([str(tiny_dir), "--output-dir", str(run), "--overwrite", "--verify", "false"])
    assert code == 2
    assert "is not a model folder (no config.json): --overwrite replaces only a model folder" in capsys.readouterr().err
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no staging folder left


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"preset": "huge"}, "unknown preset"), ({"vocab_size": 100}, "vocab_size"), ({"seed": -1}, "seed")],
)
def test_bad_arguments_raise_before_writing(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        init_model(tmp_path / "model", **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_failure_midway_leaves_no_folder(tmp_path, monkeypatch):
    def explode(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(model_init, "_build_model", explode)
    with pytest.raises(RuntimeError, match="disk full"):
        init_model(tmp_path / "model")
    assert list(tmp_path.iterdir()) == []


def test_main_exits_2_naming_the_bad_key(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        model_init.main(["--output-dir", str(tmp_path / "m"), "--preset", "huge"])
    assert exit_info.value.code == 2
    assert "preset" in capsys.readouterr().err
    target = tmp_path / "full"
    target.mkdir()
    (target / "x").write_text("x")
    assert model_init.main(["--output-dir", str(target)]) == 2
    assert "already exists" in capsys.readouterr().err


def test_corpus_is_a_function_of_the_seed():
    from gyre.tiny_tokenizer import training_corpus

    first = list(training_corpus(0, 200))
    assert first == list(training_corpus(0, 200))
    assert first != list(training_corpus(1, 200))
    text = "\n".join(training_corpus(0, 2000))
    for needle in ("<tool_call>", '"arguments"', "Reverse the text", "alphabetically", " = ", "\\boxed{"):
        assert needle in text


QWEN3_TINY = {
    "model_type": "qwen3", "vocab_size": 2000, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}  # fmt: skip


def test_an_hf_config_json_builds_that_architecture(tmp_path, tokenizer):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN3_TINY))
    path = init_model(tmp_path / "model", config=config)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.config.tie_word_embeddings
    assert (model.config.num_key_value_heads, model.config.head_dim, model.config.vocab_size) == (2, 32, 2000)
    qwen_tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert len(qwen_tokenizer) == 2000  # min(vocab_size, 4096)
    # Same special tokens and ChatML ids as every Gyre model: services rely on them.
    assert qwen_tokenizer.convert_tokens_to_ids([ENDOFTEXT, IM_START, IM_END]) == [0, 1, 2]
    assert model.config.eos_token_id == tokenizer.convert_tokens_to_ids(IM_END)


def test_bad_config_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="not a file"):
        init_model(tmp_path / "a", config=tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"hidden_size": 8}))  # no model_type
    with pytest.raises(ValueError, match="not an HF model config"):
        init_model(tmp_path / "b", config=bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json"]


def test_qwen3_preset_has_qwen3_06b_shape(tokenizer):
    import torch

    shape = PRESETS["qwen3-0.6b"]
    config = model_init._preset_config(shape, tokenizer)
    with torch.device("meta"):  # the shape only: no 2.4 GB of weights on a CI machine
        model = AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 596_049_920
    assert (config.vocab_size, config.head_dim, config.tie_word_embeddings) == (151936, 128, True)
    assert shape.tokenizer_vocab_size == 4096 and shape.dtype == "bfloat16"


def test_main_on_a_file_or_an_uncreatable_folder_is_one_error_line(tmp_path, capsys):
    # a file said "already exists and is not empty; pass overwrite=True" (also with --overwrite), and a
    # folder that cannot be created was a traceback
    a_file = tmp_path / "f"
    a_file.write_text("mine")
    assert model_init.main(["--output-dir", str(a_file), "--overwrite"]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err and a_file.read_text() == "mine"
    assert model_init.main(["--output-dir", str(a_file / "model")]) == 2
    assert str(a_file) in capsys.readouterr().err


def _sigterm_once_staging_exists(argv: list[str], output_dir: Path, log: Path) -> int:
    """Run `gyre *argv` and SIGTERM it (the process alone, as `kill` or a pod's stop does) while it writes its
    `.tmp-*` staging folder beside `output_dir`; its exit status."""
    import signal
    import time

    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gyre.cli", *argv], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not list(output_dir.parent.glob(f".tmp-{output_dir.name}-*")) and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.002)
        proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("command", ["init", "import"])
def test_a_sigterm_while_the_folder_is_written_leaves_no_staging_folder(tmp_path, command):
    # SIGTERM's default action ended `gyre model init` / `import` on the spot: the `.tmp-*` folder it was writing (up to
    # a model's size) stayed beside --output-dir; only `gyre rl` removed such folders, and only in its own run folder
    output_dir = tmp_path / "out" / "model"
    if command == "init":  # the tokenizer is trained inside the staging folder's lifetime: seconds
        argv = ["model", "init", "--preset", "small", "--output-dir", str(output_dir)]
    else:  # a local HF folder: loaded, written into staging, reloaded and compared
        source = init_model(tmp_path / "source", preset="small", seed=0)
        argv = ["model", "import", str(source), "--output-dir", str(output_dir)]
    code = _sigterm_once_staging_exists(argv, output_dir, tmp_path / "log")
    log = (tmp_path / "log").read_text()
    assert code == 130, log
    assert f"gyre model {command}: interrupted" in log
    assert sorted(p.name for p in output_dir.parent.iterdir()) == [], log  # neither staging nor a partial model


@pytest.mark.parametrize("command", ["init", "import"])
def test_overwrite_never_replaces_the_model_of_a_running_run(tmp_path, tiny_dir, command, capsys):
    # `gyre model init --output-dir outputs/demo/model --overwrite` during the run swapped its base model: replicas
    # restarting and the trainer's next resume would have loaded another model than the run started from
    from gyre import model_import
    from gyre.runlock import RunLock

    run = tmp_path / "run"
    init_model(run / "model")
    before = {p.name: p.read_bytes() for p in (run / "model").iterdir()}
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom gyre.runlock import RunLock\n"
         f"RunLock({str(run)!r}, 'rl').acquire()\nprint('held', flush=True)\ntime.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        if command == "init":
            code = model_init.main(["--output-dir", str(run / "model"), "--overwrite"])
        else:
            code = model_import.main(
                [str(tiny_dir), "--output-dir", str(run / "model"), "--overwrite", "--verify", "false"]
            )
        assert code == 2
        assert f"is the model of a running run: pid {holder.pid} (rl" in capsys.readouterr().err
        assert {p.name: p.read_bytes() for p in (run / "model").iterdir()} == before
    finally:
        holder.kill()
        holder.wait()
    # the run stopped: the same command replaces it
    RunLock(run, "rl").acquire().release()
    assert model_init.main(["--output-dir", str(run / "model"), "--overwrite", "--seed", "7"]) == 0
