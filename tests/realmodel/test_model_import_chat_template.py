"""`gyre model import --chat-template FILE`: the template a model folder carries (every service reads it from
there), set once at import: vLLM's `--chat-template` for a base model without one, or one that replaces the
source's. A file that cannot be read, or a template that cannot render a chat, is one error line before anything
is written."""

from __future__ import annotations

import json
import shutil

import pytest
from realmodel_testlib import gyre

pytestmark = pytest.mark.timeout(600)

# Llama 2's way: a turn ends with plain text, no token of its own
PLAIN_END = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@pytest.fixture
def base_model(tiny_model, tmp_path):
    """The tiny model as a base model (Qwen2.5 base's way): no chat template anywhere in the folder, and its configs
    name only `<|endoftext|>` as the end."""
    folder = tmp_path / "base"
    shutil.copytree(tiny_model, folder, ignore=shutil.ignore_patterns("chat_template.jinja"))
    for name in ("tokenizer_config.json", "config.json", "generation_config.json"):
        config = json.loads((folder / name).read_text())
        config.pop("chat_template", None)
        if "eos_token_id" in config:
            config["eos_token_id"] = 0  # <|endoftext|>
        (folder / name).write_text(json.dumps(config))
    return folder


def test_a_base_model_gets_the_template_and_its_end_of_turn(tiny_model, base_model, tmp_path):
    from gyre.eos import end_of_turn_ids
    from transformers import AutoTokenizer

    run = gyre("model", "import", str(base_model), "--output-dir", str(tmp_path / "plain"))
    assert run.returncode == 0 and "no chat template (give one with --chat-template FILE)" in run.stderr

    template = tiny_model / "chat_template.jinja"
    run = gyre(
        "model", "import", str(base_model), "--output-dir", str(tmp_path / "out"), "--chat-template", str(template)
    )
    assert run.returncode == 0, run.stderr
    assert "an assistant's turn ends at '<|im_end|>'" in run.stderr and "chat template identical" in run.stderr
    assert (tmp_path / "out" / "chat_template.jinja").read_text() == template.read_text()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    chat = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    # the base model stopped only at its eos; the folder now ends a reply at <|im_end|> too
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end not in end_of_turn_ids(base_model, AutoTokenizer.from_pretrained(base_model))
    assert im_end in end_of_turn_ids(tmp_path / "out", tokenizer)


def test_a_template_replaces_the_sources_and_one_without_an_end_token_is_warned_of(tiny_model, tmp_path):
    (tmp_path / "plain.jinja").write_text(PLAIN_END)
    run = gyre("model", "import", str(tiny_model), "--output-dir", str(tmp_path / "out"),
               "--chat-template", str(tmp_path / "plain.jinja"))  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "ends an assistant's turn with no special token of its own" in run.stderr
    assert (tmp_path / "out" / "chat_template.jinja").read_text() == PLAIN_END


@pytest.mark.parametrize(
    ("template", "message"),
    [
        (None, "cannot read it (No such file or directory)"),
        ("", "the file is empty"),
        ("{% for m in messages %}{{ m['content'] }", "it cannot render a chat"),  # a Jinja syntax error
        ("{{ raise_exception('needs a system turn') }}", "it cannot render a chat (needs a system turn)"),
        ("{% for m in messages %}{{ m['role'] }}{% endfor %}", "a rendered chat leaves out the user's message"),
    ],
)
def test_a_template_that_cannot_be_used_is_one_line_and_nothing_written(tiny_model, tmp_path, template, message):
    path = tmp_path / "template.jinja"
    if template is not None:
        path.write_text(template)
    run = gyre("model", "import", str(tiny_model), "--output-dir", str(tmp_path / "out"), "--chat-template", str(path))
    assert run.returncode == 2 and f"error: chat_template {path}: {message}" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and "nothing was written" in run.stderr
    assert not (tmp_path / "out").exists() and list(tmp_path.glob(".tmp-*")) == []
