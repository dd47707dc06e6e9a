"""A model in the Hugging Face hub cache layout (snapshot files = relative symlinks into `blobs/`), the layout of
every hub download on a cluster: the trainer publishes weights from it, `gyre sft` saves its result, and
`gyre model import` turns it (or the whole `models--org--name` folder) into a plain folder. Before, the copy/link
helper hard-linked the symlink itself, which dangles in the new folder: the first publish failed ("write_fn
returned hashes of files it did not write") and `gyre sft` lost its result (FileNotFoundError tokenizer.json).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from gyre.config import load_config
from gyre.config.trainer import SFTConfig
from gyre.safetensors_io import read_header
from gyre.transport import FolderStore
from gyre.weights import WeightStore
from realmodel_testlib import gyre, hub_cache_layout

pytestmark = pytest.mark.timeout(600)


def logits(folder, ids=(1, 5, 9, 40, 2)):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto").eval()
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits.float()


def regular_files(folder) -> list[str]:
    files = sorted(os.listdir(folder))
    assert files and not any(os.path.islink(folder / f) for f in files)
    return files


def test_weights_publish_from_a_hub_cache_snapshot(tiny_snapshot, tmp_path):
    from gyre_trainer.publish import WeightPublisher
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert all(p.is_symlink() for p in tiny_snapshot.iterdir())
    model = AutoModelForCausalLM.from_pretrained(tiny_snapshot, dtype=torch.float32)
    store = WeightStore(tmp_path / "weights")
    published = WeightPublisher(FolderStore(store.root), tiny_snapshot, keep_last=2).publish(
        1, model.state_dict(), model.config, {"step": 1}
    )
    store.verify(1, published.digest)
    assert {"tokenizer.json", "chat_template.jinja", "generation_config.json"} <= set(regular_files(published.path))
    tokenizer = AutoTokenizer.from_pretrained(published.path)
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(tiny_snapshot).chat_template
    torch.testing.assert_close(logits(published.path), logits(tiny_snapshot), rtol=0, atol=0)


def test_weights_published_from_a_hub_id_keep_the_generation_config(tiny_model, tmp_path, monkeypatch):
    # `model.name` a hub id: its files were saved through `AutoTokenizer.save_pretrained`, which leaves
    # generation_config.json out, so the published and exported models lost the end-of-turn ids only it lists
    # (Gemma's <end_of_turn>: a server of them never stopped at the end of a turn)
    from gyre.eos import end_of_turn_ids
    from gyre_trainer.publish import WeightPublisher
    from huggingface_hub import constants
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = tmp_path / "base"
    shutil.copytree(tiny_model, base)
    generation = json.loads((base / "generation_config.json").read_text())
    generation["eos_token_id"] = [generation["eos_token_id"], 1]  # an id neither config.json nor the tokenizer has
    (base / "generation_config.json").write_text(json.dumps(generation))
    hub_cache_layout(base, tmp_path / "hub", "org/model")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    store = WeightStore(tmp_path / "weights")
    published = WeightPublisher(FolderStore(store.root), "org/model", keep_last=2).publish(
        1, model.state_dict(), model.config, {"step": 1}
    )
    store.verify(1, published.digest)
    assert (published.path / "generation_config.json").read_bytes() == (base / "generation_config.json").read_bytes()
    tokenizer = AutoTokenizer.from_pretrained(published.path)
    assert 1 in end_of_turn_ids(published.path, tokenizer) == end_of_turn_ids(base, tokenizer)
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(base).chat_template


def test_sft_saves_its_result_when_the_base_model_is_a_hub_cache_snapshot(tiny_snapshot, tmp_path):
    from gyre_trainer import sft

    args = ["--model.name", str(tiny_snapshot), "--output-dir", str(tmp_path), "--device", "cpu", "--data.fake",
            "--data.num-examples", "32", "--data.seq-len", "64", "--data.batch-size", "4",
            "--max-steps", "2"]  # fmt: skip
    torch.set_num_threads(1)
    assert sft.run(load_config(SFTConfig, args)) == 0
    assert {"model.safetensors", "tokenizer.json", "chat_template.jinja"} <= set(regular_files(tmp_path / "sft"))
    logits(tmp_path / "sft")  # loads


@pytest.mark.parametrize("source", ["snapshot", "repo folder"])
def test_model_import_of_a_hub_cache_gives_a_plain_verified_folder(tiny_model, tiny_snapshot, tmp_path, source):
    path = tiny_snapshot if source == "snapshot" else tiny_snapshot.parents[1]  # models--org--model: refs/main
    run = gyre("model", "import", str(path), "--output-dir", str(tmp_path / "out"))
    assert run.returncode == 0, run.stderr
    assert "hub cache snapshot" in run.stderr and f"-> {tiny_snapshot}" in run.stderr
    assert "differ by at most 0 " in run.stderr and "tokens identical, chat template identical" in run.stderr
    expected = {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja"}
    assert expected <= set(regular_files(tmp_path / "out"))
    torch.testing.assert_close(logits(tmp_path / "out"), logits(tiny_model), rtol=0, atol=0)


def test_model_import_converts_the_dtype(tiny_model, tmp_path):
    run = gyre("model", "import", str(tiny_model), "--output-dir", str(tmp_path / "bf16"), "--dtype", "bfloat16")
    assert run.returncode == 0, run.stderr
    assert {t["dtype"] for t in read_header(tmp_path / "bf16" / "model.safetensors").values()} == {"BF16"}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    torch.testing.assert_close(logits(tmp_path / "bf16"), logits(tiny_model), rtol=0, atol=0.05)


def test_model_import_writes_the_models_context_as_the_tokenizers_limit(tiny_model, tmp_path):
    # a tokenizer that sets no limit (a GGUF's, many hub ones) loads with transformers' 1e30: it was written so, and
    # so were the arguments of the load (is_local, local_files_only), facts of the importing machine
    shutil.copytree(tiny_model, tmp_path / "src")
    config = json.loads((tmp_path / "src" / "tokenizer_config.json").read_text())
    del config["model_max_length"]
    (tmp_path / "src" / "tokenizer_config.json").write_text(json.dumps(config))
    run = gyre("model", "import", str(tmp_path / "src"), "--output-dir", str(tmp_path / "out"))
    assert run.returncode == 0, run.stderr
    written = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    context = json.loads((tiny_model / "config.json").read_text())["max_position_embeddings"]
    assert written["model_max_length"] == context == 1024
    assert "is_local" not in written and "local_files_only" not in written
    # a limit the source sets itself is kept
    config["model_max_length"] = 512
    (tmp_path / "src" / "tokenizer_config.json").write_text(json.dumps(config))
    run = gyre("model", "import", str(tmp_path / "src"), "--output-dir", str(tmp_path / "own"))
    assert run.returncode == 0, run.stderr
    assert json.loads((tmp_path / "own" / "tokenizer_config.json").read_text())["model_max_length"] == 512


def test_model_import_refuses_before_writing_anything(tiny_model, tmp_path):
    # a hub id without a reachable hub: one line saying so and what works offline, exit 2, nothing written
    run = gyre("model", "import", "org/not-cached", "--output-dir", str(tmp_path / "a"), env={"HF_HUB_OFFLINE": "1"})
    assert run.returncode == 2 and "the Hugging Face hub cannot provide it" in run.stderr
    assert "smollm2" in run.stderr and "Traceback" not in run.stderr and not (tmp_path / "a").exists()
    # an output folder that is not empty is left alone
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "keep.txt").write_text("mine")
    run = gyre("model", "import", str(tiny_model), "--output-dir", str(tmp_path / "b"))
    assert run.returncode == 2 and "not empty" in run.stderr and os.listdir(tmp_path / "b") == ["keep.txt"]
    # a model folder without its tokenizer: said before loading (transformers' "Couldn't instantiate the backend
    # tokenizer from one of: ... install sentencepiece or tiktoken" before)
    shutil.copytree(tiny_model, tmp_path / "no-tokenizer", ignore=shutil.ignore_patterns("tokenizer*"))
    run = gyre("model", "import", str(tmp_path / "no-tokenizer"), "--output-dir", str(tmp_path / "e"))
    assert run.returncode == 2 and "holds no tokenizer (tokenizer.json, tokenizer.model" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and not (tmp_path / "e").exists()
    # neither a GGUF nor a model folder
    run = gyre("model", "import", str(tiny_model / "config.json"), "--output-dir", str(tmp_path / "c"))
    assert run.returncode == 2 and "not a .gguf file" in run.stderr
    # an output path that is a file, --overwrite or not ("not empty; pass --overwrite" said before)
    (tmp_path / "d").write_text("mine")
    run = gyre("model", "import", str(tiny_model), "--output-dir", str(tmp_path / "d"), "--overwrite")
    assert run.returncode == 2 and "is a file, not a folder" in run.stderr and (tmp_path / "d").read_text() == "mine"
    assert list(tmp_path.glob(".tmp-*")) == []


def test_model_import_of_a_file_it_cannot_load_is_one_line_and_nothing_written(tiny_model, tmp_path, capsys):
    # a .gguf that is not one, and a model folder with truncated weights: before, both were a transformers /
    # safetensors traceback (exit 1) instead of the one-line error every other bad source gets
    from gyre.model_import import main

    pytest.importorskip("gguf")
    (tmp_path / "fake.gguf").write_text("not a gguf")
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    for f in tiny_model.iterdir():
        (truncated / f.name).write_bytes(f.read_bytes()[: 100 if f.suffix == ".safetensors" else None])
    for source, what in [(tmp_path / "fake.gguf", "GGUF file"), (truncated, "model folder")]:
        assert main([str(source), "--output-dir", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert f"error: cannot load {what} {source}: " in err and "nothing was written" in err
        assert not (tmp_path / "out").exists() and list(tmp_path.glob(".tmp-*")) == []
