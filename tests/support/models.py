"""Tiny models for tests: the `tiny` preset made once per session, and teaching it fixed answers.

A random tiny model almost never ends a turn or emits a tool call; tests that need real text of a given
shape fine-tune it (seconds on one core) until greedy decoding reproduces the taught tokens.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

REVISION = "0123456789abcdef0123456789abcdef01234567"  # a hub cache snapshot's name
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def tiny_model_path(tmp_path_factory) -> Path:
    """The `tiny` preset of `gyre model init` (about 1M parameters), created once under the session's temp."""
    from gyre.model_init import init_model

    path = tmp_path_factory.getbasetemp() / "tiny-model"
    if not (path / "config.json").exists():
        init_model(path, preset="tiny", seed=0)
    return path


# Qwen3's own chat template (renders reasoning_content in a <think> block; enable_thinking), as llama.cpp ships it
QWEN3_TEMPLATE = Path(__file__).parents[1] / "unit" / "trainer_service" / "data" / "chat_templates" / "qwen3.jinja"


def qwen3_templated(tmp_path_factory, tiny_model: Path) -> Path:
    """The tiny model with Qwen3's chat template (its <|im_start|> / <|im_end|> are the tiny tokenizer's too)."""
    path = tmp_path_factory.mktemp("tiny-qwen3-template")
    shutil.copytree(tiny_model, path, dirs_exist_ok=True)
    shutil.copy(QWEN3_TEMPLATE, path / "chat_template.jinja")
    return path


def teach(base: Path, path: Path, input_ids, labels, attention_mask=None, *, margin: float = 0.0,
          max_steps: int = 600, lr: float = 1e-2) -> Path:  # fmt: skip
    """Fine-tune `base` on rows `input_ids` until greedy decoding reproduces every labelled token (labels
    -100 are not taught) with a logit lead of more than `margin`; saved at `path` with the base's tokenizer
    files. Made once: an existing `path` is returned as it is. RuntimeError when `max_steps` are not enough."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # more threads than free cores is many times slower on a busy machine
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    target = labels[:, 1:]
    taught = target != -100
    try:
        for _ in range(max_steps):
            out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
            top2 = out.logits[:, :-1].detach().topk(2, dim=-1)
            right = bool((top2.indices[..., 0][taught] == target[taught]).all())
            lead = (top2.values[..., 0] - top2.values[..., 1])[taught]
            if right and float(lead.min()) > margin:
                break
            optimizer.zero_grad()
            out.loss.backward()
            optimizer.step()
        else:
            raise RuntimeError(f"the model did not learn its answers in {max_steps} steps")
    finally:
        torch.set_num_threads(threads)
    return save_beside(model, base, path)


def reward_model_path(tmp_path_factory) -> Path:
    """A tiny reward model: the `tiny` preset's shape and tokenizer as a LlamaForSequenceClassification with one
    label (a randomly initialised score head; what `gyre inference --runner pooling` serves), made once."""
    path = tmp_path_factory.getbasetemp() / "tiny-reward-model"
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import AutoConfig, LlamaForSequenceClassification

    base = tiny_model_path(tmp_path_factory)
    config = AutoConfig.from_pretrained(base, num_labels=1, id2label={0: "reward"}, label2id={"reward": 0})
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config)
    return save_beside(model, base, path)


def save_beside(model, base: Path, path: Path) -> Path:
    """Save `model` at `path` with `base`'s tokenizer files, visible only complete (staged, then renamed)."""
    staging = path.with_name(path.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    for name in TOKENIZER_FILES:
        if (base / name).exists():
            shutil.copy(base / name, staging / name)
    staging.rename(path)
    return path


def hub_cache_layout(folder: Path, cache: Path, repo: str = "org/model") -> Path:
    """Lay `folder` out as the Hugging Face hub cache does; return the snapshot folder.

    `models--org--model/blobs/<sha256>` hold the bytes, `snapshots/<revision>/<file>` are relative symlinks
    to them (`../../blobs/<sha256>`) and `refs/main` names the revision."""
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / REVISION
    (repo_dir / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in sorted(folder.iterdir()):
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, repo_dir / "blobs" / digest)
        (snapshot / file.name).symlink_to(Path("../../blobs") / digest)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(REVISION)
    return snapshot
