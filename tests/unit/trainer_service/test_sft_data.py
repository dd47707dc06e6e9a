"""SFT data: JSONL / environment / generated sources, chat-template masks, packing, step order."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from gyre.config import load_config
from gyre.config.trainer import SFTConfig
from gyre_trainer.sft import main
from gyre_trainer.sft_data import (
    Conversation,
    SFTDataError,
    environment_conversations,
    fake_conversations,
    pack,
    prepare_rows,
    read_jsonl,
    rows_for_step,
    tokenize,
    unseen_per_epoch,
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def learned_text(tokenizer, conversation) -> str:
    ids, mask = tokenize(conversation, tokenizer)
    assert len(ids) == len(mask) and not mask[0]
    return tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])


def test_only_assistant_tokens_are_learned(tokenizer):
    chat = Conversation(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Say hi"},
            {"role": "assistant", "content": "hi"},
            {"role": "user", "content": "Again"},
            {"role": "assistant", "content": "hi again"},
        ]
    )
    # both replies and their end-of-turn tokens; nothing of the system/user turns
    assert learned_text(tokenizer, chat) == "hi<|im_end|>hi again<|im_end|>"


def test_environment_reference_answers_including_tool_calls(tokenizer):
    (reverse,) = environment_conversations("reverse_text", {}, 1, seed=0)
    answer = reverse.messages[-1]["content"]
    assert learned_text(tokenizer, reverse) == answer + "<|im_end|>"
    (calc,) = environment_conversations("calculator", {}, 1, seed=0)
    assert calc.tools  # rendered with the tool schemas, like in rollouts
    text = learned_text(tokenizer, calc)
    assert text.startswith("<tool_call>") and text.endswith(calc.messages[-1]["content"] + "<|im_end|>")
    question = next(m["content"] for m in calc.messages if m["role"] == "user")
    assert question not in text and "<|im_start|>tool" not in text  # prompt and tool output are not learned


def test_a_dataset_environment_whose_rows_num_examples_repeats_or_leaves_out_says_so(tmp_path):
    # its train split is endless: the default data.num_examples=2000 trained 5 rows 400 times each, or 2000 of 100,000
    # rows, without a word
    from support.logs import logged

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{n} + 1?", "answer": str(n + 1)}) + "\n" for n in range(8)))
    args = {"path": str(rows), "num_eval": 3}
    with logged("gyre_trainer") as lines:
        assert len(environment_conversations("dataset", args, 20, seed=0)) == 20
        assert len(environment_conversations("dataset", args, 2, seed=0)) == 2
        environment_conversations("dataset", args, 5, seed=0)
    assert lines == [
        "environment dataset has 5 train rows: data.num_examples=20 trains each 4.0 times (5 trains each once)",
        "environment dataset has 5 train rows: data.num_examples=2 trains 2 of them (5 trains each once)",
    ]


def test_fake_data_is_deterministic_and_varied():
    a, b = fake_conversations(50, seed=3), fake_conversations(50, seed=3)
    assert a == b and a != fake_conversations(50, seed=4)
    assert len({c.messages[-1]["content"] for c in a}) > 40


def test_packing_respects_seq_len_and_truncates():
    samples = [([1] * 5, [False] + [True] * 4), ([2] * 4, [False, True, True, True]), ([3] * 12, [False] + [True] * 11)]
    samples.append(([4] * 3, [False] * 3))  # nothing to learn: dropped
    rows, truncated, dropped = pack(samples, seq_len=10)
    assert (truncated, dropped) == (1, 1)
    assert [r.sample_lengths.tolist() for r in rows] == [[5, 4], [10]]
    assert rows[0].input_ids.tolist() == [1] * 5 + [2] * 4 and rows[0].input_ids.dtype == np.int32
    assert rows[1].loss_mask.sum() == 9


def test_each_step_has_fixed_rows_and_epochs_reshuffle():
    rows = [object() for _ in range(10)]
    epoch0 = [rows_for_step(rows, s, 3, seed=0) for s in (1, 2, 3)]
    assert all(e == 0 for e, _ in epoch0)
    seen = [id(r) for _, batch in epoch0 for r in batch]
    assert len(seen) == len(set(seen)) == 10  # every row once per epoch: the last step takes the 10th too
    assert rows_for_step(rows, 4, 3, seed=0)[0] == 1
    assert rows_for_step(rows, 2, 3, seed=0) == rows_for_step(rows, 2, 3, seed=0)


def test_an_epoch_trains_the_rows_beyond_its_last_full_batch():
    # 11 rows, batch 4: 2 steps per epoch; the 3 rows that do not fill a third batch used to be skipped (a different
    # 3 each epoch). On 2 ranks the last step takes 2 of them (an even split), 1 row is left out and counted.
    rows = [object() for _ in range(11)]
    for world_size, trained in ((1, 11), (2, 10)):
        for epoch in (0, 1):
            batches = [rows_for_step(rows, epoch * 2 + s, 4, seed=3, world_size=world_size) for s in (1, 2)]
            assert [e for e, _ in batches] == [epoch, epoch]
            seen = [id(r) for _, batch in batches for r in batch]
            assert len(seen) == len(set(seen)) == trained
            assert len(batches[1][1]) % world_size == 0  # each rank the same number of rows
        assert unseen_per_epoch(len(rows), 4, world_size) == 11 - trained


def test_bad_jsonl_names_the_line(tmp_path):
    path = tmp_path / "chats.jsonl"
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    path.write_text(json.dumps(good) + "\n\n" + '{"messages": [{"role": "user", "content": "no reply"}]}\n')
    with pytest.raises(SFTDataError, match=r"chats.jsonl:3: no assistant message"):
        read_jsonl(path)
    path.write_text(json.dumps(good) + "\n{oops\n")
    with pytest.raises(SFTDataError, match=r"chats.jsonl:2: not JSON"):
        read_jsonl(path)
    path.write_text(json.dumps(good) + "\n")
    assert read_jsonl(path) == [Conversation(good["messages"])]


CALL = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}


def test_openai_content_parts_and_content_less_tool_calls_are_learned_as_the_server_renders_them(tokenizer, tmp_path):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "hi"}]}]  # fmt: skip
    calls = [{"role": "user", "content": "1 + 2?"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
             {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "3"}]},
             {"role": "assistant", "content": "3"}]  # fmt: skip
    no_content = [calls[0], {"role": "assistant", "tool_calls": [CALL]}, *calls[2:]]  # model_dump() drops the null
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in (parts, calls, no_content)))
    first, second, third = read_jsonl(path)
    assert learned_text(tokenizer, first) == "hi<|im_end|>"
    text = learned_text(tokenizer, second)
    assert text.startswith('<tool_call>\n{"name": "add"') and text.endswith("</tool_call><|im_end|>3<|im_end|>")
    assert learned_text(tokenizer, third) == text


def test_an_assistant_s_refusal_parts_are_learned_as_their_text_as_the_server_renders_them(tokenizer, tmp_path):
    # OpenAI's SDK types an assistant's content as text and refusal parts, and the server renders a refusal part as
    # its text (chat_messages): SFT refused the same conversation ("expected a text part")
    parts = [{"type": "text", "text": "Sorry,"}, {"type": "refusal", "refusal": "no."}]
    said = [{"role": "user", "content": "Help?"}, {"role": "assistant", "content": parts}]
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": said}) + "\n")
    (conversation,) = read_jsonl(path)
    assert learned_text(tokenizer, conversation) == "Sorry,\nno.<|im_end|>"
    said[1]["content"][1] = {"type": "refusal"}
    path.write_text(json.dumps({"messages": said}) + "\n")
    with pytest.raises(SFTDataError, match=re.escape("chats.jsonl:1: messages[1].content[1].refusal: a refusal part")):
        read_jsonl(path)


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


@pytest.mark.parametrize(
    ("message", "said"),
    [({"role": "user", "content": [{"type": "text", "text": "Look:"}, IMAGE]},
      "content[1]: image input (image_url parts) is not supported"),
     ({"role": "user", "content": None}, "content: null: a user message needs content"),
     ({"role": "user"}, "content: missing: a user message needs content"),
     ({"role": "user", "content": {"text": "hi"}}, "content: expected a string or a list of text parts, not dict"),
     ({"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}, "content[0]: expected a text part"),
     ({"role": "assistant", "content": None}, "content: null: an assistant message needs content unless it has tool_"),
     ({"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]}, "tool_calls[0]: expected")],
)  # fmt: skip
def test_content_the_openai_format_does_not_give_a_text_model_is_refused_naming_file_row_and_field(
    tmp_path, message, said
):
    # a template renders these its own way, without a word: an image part dropped, None as "None" or nothing, a dict
    # as nothing, an assistant turn of null content as an empty reply (the model learned to answer nothing)
    path = tmp_path / "chats.jsonl"
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    bad = {"messages": [message, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(SFTDataError, match=re.escape(f"chats.jsonl:2: messages[0].{said}")):
        read_jsonl(path)


def test_a_line_that_is_not_utf8_is_named_and_a_bom_or_u2028_in_a_string_is_fine(tmp_path):
    # a Latin-1 line was a UnicodeDecodeError traceback naming no line (exit 1, after the lock and the re-run checks)
    path = tmp_path / "chats.jsonl"
    good = {"messages": [{"role": "user", "content": "a\u2028b\x1cc"}, {"role": "assistant", "content": "é"}]}
    line = json.dumps(good, ensure_ascii=False).encode()
    path.write_bytes(line + b"\n" + "caf\u00e9".encode("latin-1") + b"\n")
    with pytest.raises(SFTDataError, match=r"chats.jsonl:2: not UTF-8 text \(unexpected end of data at byte 3"):
        read_jsonl(path)
    # str.splitlines() cut this valid JSON line at U+2028 and \x1c ("not JSON"); an editor's BOM read as not JSON too
    path.write_bytes(b"\xef\xbb\xbf" + line + b"\r\n")
    assert read_jsonl(path) == [Conversation(good["messages"])]


def test_too_little_data_is_a_clear_error(tokenizer, tmp_path):
    cfg = load_config(SFTConfig, ["--data.fake", "--data.num-examples", "3", "--data.batch-size", "16"])
    with pytest.raises(SFTDataError, match="fewer than data.batch_size=16"):
        prepare_rows(cfg, tokenizer)


def test_cli_reports_data_errors_with_status_2(tmp_path, tiny_model, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("[1, 2]\n")
    argv = [
        "--model.name",
        str(tiny_model),
        "--data.path",
        str(bad),
        "--output-dir",
        str(tmp_path),
        "--device",
        "cpu",
    ]
    assert main(argv) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err


def test_a_conversation_the_chat_template_cannot_render_is_named_not_a_traceback(tmp_path, tiny_model, capsys):
    # a template that refuses a conversation (raise_exception: here, any system message) failed in Jinja; `gyre sft`
    # crashed with that traceback instead of naming the line (as a bad JSON line is named)
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    template = (model / "chat_template.jinja").read_text()
    refuses = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system messages') }}{% endif %}"
    (model / "chat_template.jinja").write_text(refuses + template)
    good = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
    system = {"messages": [{"role": "system", "content": "Be brief."}, *good["messages"]]}
    typo = {"messages": [{"role": "user", "contents": "2+2?"}, {"role": "assistant", "content": "4"}]}
    data = tmp_path / "chats.jsonl"
    argv = ["--model.name", str(model), "--data.path", str(data), "--output-dir", str(tmp_path / "out"),
            "--data.batch-size", "1", "--max-steps", "1", "--device", "cpu"]  # fmt: skip
    data.write_text(json.dumps(good) + "\n" + json.dumps(system) + "\n")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "chats.jsonl:2: the model's chat template cannot render this conversation (no system messages)" in err
    assert "Traceback" not in err and not (tmp_path / "out" / "sft").exists()
    # a message without content (a "contents" typo) is named with its field before the template reads it
    data.write_text(json.dumps(good) + "\n" + json.dumps(typo) + "\n")
    assert main(argv) == 2
    assert "chats.jsonl:2: messages[0].content: missing: a user message needs content" in capsys.readouterr().err


def test_a_conversation_longer_than_the_models_context_is_cut_to_it_when_rows_are_longer(tiny_model, tmp_path):
    # data.seq_len 4096 on the tiny model (context 1024): a 2,700-token conversation trained at positions the model
    # was never trained for and is never served at, while transformers warned of "indexing errors"
    from gyre.events import read_events
    from support.logs import logged

    reply = " ".join(str(n) for n in range(700))
    data = tmp_path / "long.jsonl"
    chat = {"messages": [{"role": "user", "content": "Count."}, {"role": "assistant", "content": reply}]}
    data.write_text(json.dumps(chat) + "\n" + json.dumps(chat) + "\n")
    argv = ["--model.name", str(tiny_model), "--data.path", str(data), "--output-dir", str(tmp_path / "out"),
            "--data.seq-len", "4096", "--data.batch-size", "1", "--max-steps", "1", "--device", "cpu"]  # fmt: skip
    with logged("transformers", "gyre_trainer") as lines:
        assert main(argv) == 0
    (step,) = read_events(tmp_path / "out" / "events" / "sft_steps.jsonl")
    assert step["num_tokens"] == 2 * 1024  # both cut to the context, packed into one row of 4096
    assert "2 of 2 conversations were cut to the model's context, 1024 tokens" in "\n".join(lines)
    assert not [line for line in lines if "Token indices sequence length" in line]


def test_exactly_one_data_source_is_required():
    from gyre.config import ConfigError

    with pytest.raises(ConfigError, match="exactly one of data.path, data.fake, data.env"):
        load_config(SFTConfig, ["--data.fake", "--data.env", "reverse_text"])
    # no source at all (the first mistake of a new user) was "config key '<root>': Value error, set exactly one...",
    # and it hid a typo made beside it
    with pytest.raises(ConfigError) as e:
        load_config(SFTConfig, [])
    assert str(e.value) == "config key 'data': set exactly one of data.path, data.fake, data.env (got none)"
    with pytest.raises(ConfigError, match=r"config key 'max_stepz': unknown key \(did you mean 'max_steps'\?\)"):
        load_config(SFTConfig, ["--max-stepz", "3"])


def test_wandb_enabled_logs_the_sft_steps(tiny_model, tmp_path, monkeypatch):
    """`gyre sft --wandb.enabled` (listed by its --help, inherited by `[sft]` of a `gyre rl` file) logged nothing."""
    pytest.importorskip("wandb", reason="the wandb extra is part of the dev install")
    import wandb
    from gyre_trainer import sft

    monkeypatch.setenv("WANDB_MODE", "offline")  # a real wandb run, nothing leaves the machine
    monkeypatch.setenv("WANDB_SILENT", "true")
    args = ["--model.name", str(tiny_model), "--output-dir", str(tmp_path), "--device", "cpu", "--data.fake",
            "--data.num-examples", "40", "--data.seq-len", "64", "--data.batch-size", "2", "--max-steps", "2",
            "--wandb.enabled", "true", "--run-id", "sft-wb"]  # fmt: skip
    assert sft.run(load_config(SFTConfig, args)) == 0
    wandb.teardown()  # flushes the offline run file, as the process exiting does
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    data = next(run_dir.glob("run-*.wandb")).read_bytes()
    for key in (b"sft/loss", b"sft/step", b"sft/lr", b"sft/grad_norm"):
        assert key in data, key


def test_a_second_sft_on_a_folder_in_use_fails_at_once_naming_the_holder(tmp_path, tiny_model, capsys):
    # two `gyre sft` on one output folder both trained: their step records interleaved in sft_steps.jsonl and
    # each deleted the other's checkpoints (keep_last)
    from gyre.runlock import RunLock

    argv = ["--model.name", str(tiny_model), "--data.fake", "--output-dir", str(tmp_path), "--device", "cpu"]
    with RunLock(tmp_path, "sft"):  # the first one, training
        assert main([*argv, "--max-steps", "1"]) == 2
    err = capsys.readouterr().err
    assert f"gyre sft: error: {tmp_path / 'locks' / 'sft.lock'} is held by pid" in err and "Traceback" not in err
    assert not (tmp_path / "events").exists()  # it stopped before anything was written
    (tmp_path / "file").write_text("")
    assert main([*argv[:-4], "--output-dir", str(tmp_path / "file"), "--device", "cpu"]) == 2
    assert "config key 'output_dir': cannot use" in capsys.readouterr().err


def test_ctrl_c_says_what_a_rerun_does_instead_of_a_traceback(tmp_path, tiny_model):
    # Ctrl-C printed a KeyboardInterrupt traceback from inside backward() and exited 1; a graceful stop now
    # finishes the step, checkpoints it (ckpt.on_stop) and exits 0
    import os
    import re
    import signal
    import subprocess
    import sys
    import time

    argv = [sys.executable, "-m", "gyre.cli", "sft", "--model.name", str(tiny_model), "--data.fake",
            "--data.num-examples", "64", "--data.seq-len", "64", "--data.batch-size", "2", "--data.micro-batch-size",
            "2", "--max-steps", "100000", "--ckpt.interval", "1", "--output-dir", str(tmp_path),
            "--device", "cpu"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    steps = tmp_path / "events" / "sft_steps.jsonl"
    deadline = time.monotonic() + 120
    while not (steps.exists() and steps.read_text().count("\n") >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)  # with a checkpoint every step: often inside a checkpoint save
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "SIGINT: stopping after the current step (Ctrl-C again stops at once)" in err
    stopped = re.search(r"gyre sft: stopped after step (\d+); the same command resumes from checkpoint step "
                        r"(\d+) in (\S+)\n", err)  # fmt: skip
    assert stopped and stopped[1] == stopped[2] and stopped[3] == str(tmp_path / "checkpoints" / "sft"), err[-2000:]
    assert f"step_{stopped[2]}" in os.listdir(stopped[3])


def test_ctrl_c_while_the_data_is_prepared_stops_there_without_loading_the_model(tmp_path, tiny_model, monkeypatch,
                                                                                 capsys):  # fmt: skip
    # tokenizing a large dataset takes minutes: a Ctrl-C then waited for all of it, and for the model to load, to stop
    # before the first step; and it said "stopping after the current step", with no step running
    import os
    import signal

    from gyre_trainer import model, sft_data

    loaded, load_conversations = [], sft_data.load_conversations

    def ctrl_c_while_loading(*args):
        os.kill(os.getpid(), signal.SIGINT)  # a real SIGINT, to the handler gyre sft installs
        return load_conversations(*args)

    def load_model(*args, **kwargs):
        loaded.append(args)
        return real_load_model(*args, **kwargs)

    real_load_model = model.load_model
    monkeypatch.setattr(sft_data, "load_conversations", ctrl_c_while_loading)  # prepare_rows reads it there
    monkeypatch.setattr(model, "load_model", load_model)
    argv = ["--model.name", str(tiny_model), "--data.fake", "--data.num-examples", "64", "--data.seq-len", "64",
            "--data.batch-size", "2", "--max-steps", "3", "--output-dir", str(tmp_path), "--device", "cpu"]  # fmt: skip
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "gyre sft: stopped after step 0; no checkpoint (nothing trained yet): the same command starts over" in err
    assert "SIGINT: stopping before the next step (none is running)" in err and "current step" not in err
    assert loaded == [] and not (tmp_path / "sft").exists()


@pytest.mark.parametrize(
    ("env", "args", "said"),
    [("reverse_txt", "{}", "unknown environment 'reverse_txt'"),
     ("reverse_text", '{"num_exampels": 5}', "bad arguments (got an unexpected keyword argument 'num_exampels')"),
     ("dataset", '{"path": "ROWS"}', "_args': ROWS: 3 rows and num_eval=64 leave no training rows"),
     ("dataset", '{"path": "ROWS", "num_eval": 3}', "_args': ROWS: 3 rows and num_eval=3 leave no training rows"),
     ("dataset", '{"path": "EMPTY"}', "_args': EMPTY: the file has no rows")],
)  # fmt: skip
def test_a_mistyped_environment_or_argument_is_an_error_naming_the_key(tmp_path, tiny_model, capsys, env, args, said):
    # `gyre sft --data.env-args '{"num_exampels": 5}'` died in an EnvironmentLoadError traceback; a dataset with no
    # training rows (too few for its held-out eval rows, or none at all) in a DatasetError traceback (exit 1)
    rows, empty = tmp_path / "rows.jsonl", tmp_path / "empty.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{n} + 1?", "answer": str(n + 1)}) + "\n" for n in range(3)))
    empty.write_text("")
    args, said = (text.replace("ROWS", str(rows)).replace("EMPTY", str(empty)) for text in (args, said))
    argv = ["--model.name", str(tiny_model), "--data.env", env, "--data.env-args", args, "--output-dir",
            str(tmp_path / "out"), "--device", "cpu"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "gyre sft: error: config key 'data.env" in err and said in err and "Traceback" not in err, err


REASONED = [{"role": "user", "content": "What is 1 plus 2?"},
            {"role": "assistant", "content": "3", "reasoning_content": "one and two make three"}]  # fmt: skip


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_reasoning_a_template_does_not_render_is_refused_not_dropped(tokenizer, field):
    """The tiny model's template (gyre model init's) does not read reasoning_content: the reply was learned without
    its reasoning, silently."""
    reply = {"role": "assistant", "content": "3", field: "one and two make three"}
    with pytest.raises(SFTDataError, match="does not render the assistant's reasoning_content"):
        tokenize(Conversation([REASONED[0], reply]), tokenizer)
    # the same reasoning in the content, as a <think> block, is learned
    inline = [REASONED[0], {"role": "assistant", "content": "<think>one and two make three</think>3"}]
    assert learned_text(tokenizer, Conversation(inline)) == "<think>one and two make three</think>3<|im_end|>"


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_reasoning_is_learned_where_the_template_renders_it_under_either_name(tiny_model, tmp_path_factory, field):
    """Where the template renders it the check lets it through: Qwen3's, under vLLM's either name (transformers gives
    newer vLLM's `reasoning` to the template as `reasoning_content` too)."""
    from support.models import qwen3_templated
    from transformers import AutoTokenizer

    qwen3 = AutoTokenizer.from_pretrained(qwen3_templated(tmp_path_factory, tiny_model))
    reply = {"role": "assistant", "content": "3", field: "one and two make three"}
    learned = learned_text(qwen3, Conversation([REASONED[0], reply]))
    assert "<think>\none and two make three\n</think>\n\n3<|im_end|>" in learned
