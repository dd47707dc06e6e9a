"""Published weights: servable HF folders through WeightStore, reload in transformers, retention."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from gyre.transport import FolderStore
from gyre.weights import WeightStore
from gyre_trainer.publish import STEP_RECORD, WeightPublisher, servable_tensors, write_hf_folder


def trained_copy(model_dir):
    """The tiny model with every parameter moved, as a trainer would have it after some steps."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return model


def test_published_weights_reload_in_transformers(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = trained_copy(tiny_model)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    store = WeightStore(tmp_path / "weights")
    published = WeightPublisher(FolderStore(store.root), tiny_model, keep_last=2).publish(
        3, state, model.config, {"step": 3, "loss": 0.5}
    )
    assert published.path == store.path(3)
    manifest = store.verify(3, published.digest)
    assert {"model.safetensors", "config.json", "tokenizer.json", "chat_template.jinja", STEP_RECORD} <= set(
        manifest.files
    )
    assert all(oct(os.stat(published.path / f).st_mode & 0o777) == "0o644" for f in manifest.files)

    reloaded = AutoModelForCausalLM.from_pretrained(published.path, dtype=torch.float32)
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    tokenizer = AutoTokenizer.from_pretrained(published.path)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert ids == AutoTokenizer.from_pretrained(tiny_model).apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True
    )
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    out = reloaded.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)
    assert out.shape[1] == len(ids) + 4
    assert WeightPublisher(FolderStore(store.root), tiny_model, 2).read_record(3) == {"step": 3, "loss": 0.5}


def test_tied_embeddings_are_saved_once_and_reload(tmp_path, tiny_model):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    tensors = servable_tensors(model.state_dict(), config)
    assert "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors
    write_hf_folder(tmp_path / "tied", model.state_dict(), config, tiny_model)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "tied")
    ids = torch.tensor([[5, 6, 7]])
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)


def test_base_model_without_tokenizer_is_refused(tmp_path, tiny_model):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(tiny_model / "config.json", bare)
    model = trained_copy(tiny_model)
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        write_hf_folder(tmp_path / "out", model.state_dict(), model.config, bare)


def test_prune_keeps_newest_and_in_use_and_discard_after_rewinds(tmp_path, tiny_model):
    model = trained_copy(tiny_model)
    store = WeightStore(tmp_path / "weights")
    publisher = WeightPublisher(FolderStore(store.root), tiny_model, keep_last=2)
    for step in range(1, 6):
        publisher.publish(step, model.state_dict(), model.config, {"step": step})
    store.set_in_use("orchestrator", [1])
    assert publisher.prune() == [2, 3]
    assert store.steps() == [1, 4, 5]
    assert publisher.discard_after(1) == [4, 5]
    assert store.steps() == [1]
    assert not any(p.name.startswith(".tmp-") for p in store.root.iterdir())


def test_each_step_hashes_only_its_new_files(tiny_model, tmp_path, monkeypatch):
    """Nothing is read back to be hashed: the base model's tokenizer files are linked into every version
    and hashed once per process, the weights while written, config and step record from memory; the
    recorded hashes are still every file's true sha256."""
    from gyre import weights

    model = trained_copy(tiny_model)
    store = WeightStore(tmp_path / "weights")
    publisher = WeightPublisher(FolderStore(store.root), tiny_model, keep_last=3)
    read_back: list[str] = []
    real = weights._sha256_file
    monkeypatch.setattr(weights, "_sha256_file", lambda path: read_back.append(path.name) or real(path))
    for step in (1, 2):
        with torch.no_grad():
            next(model.parameters()).add_(1.0)
        publisher.publish(step, model.state_dict(), model.config, {"step": step})
    assert read_back == []
    for step in (1, 2):  # every recorded hash is the file's true sha256
        store.verify(step, store.digest(step), full=True)
    assert (
        store.verify(1, full=False).files["model.safetensors"] != store.verify(2, full=False).files["model.safetensors"]
    )


@pytest.mark.parametrize("adapter_only", [False, True])
def test_a_version_the_volume_cannot_hold_is_a_clear_error_and_never_visible(tmp_path, tiny_model, adapter_only):
    """A full volume while writing version 2 (a file-size limit here: EFBIG; ENOSPC alike): the error names the step,
    the folder and the free space (it was `OSError: [Errno 28] No space left on device`, no path, no step), version 1
    stays the latest and whole, and no partial folder is left for a reader or a notification."""
    from gyre.config.trainer import LoraConfig
    from gyre_trainer.lora import apply_lora
    from gyre_trainer.publish import PublishError
    from support.fs import file_size_limit

    model = trained_copy(tiny_model)
    store = WeightStore(tmp_path / "weights")
    publisher = WeightPublisher(FolderStore(store.root), tiny_model, keep_last=2)
    if adapter_only:
        lora = LoraConfig(rank=64, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
        model = apply_lora(model, lora)
        publish = lambda step: publisher.publish_adapter(step, model.state_dict(), lora, {"step": step})  # noqa: E731
    else:
        publish = lambda step: publisher.publish(step, model.state_dict(), model.config, {"step": step})  # noqa: E731
    first = publish(1)
    size = max(f.stat().st_size for f in store.path(1).iterdir())
    with file_size_limit(size // 2), pytest.raises(PublishError) as failed:
        publish(2)
    message = str(failed.value)
    assert f"writing weights step 2 into {store.root} failed" in message and "MiB free of" in message
    # still an OSError: MultiRunTrainer.scan_runs_dir logs a run whose volume fails and trains the others
    assert isinstance(failed.value, OSError)
    assert store.steps() == [1] and store.version(1) == first
    assert sorted(p.name for p in store.root.iterdir()) == ["step_1"]


def test_a_failing_fsync_is_a_publish_error_and_the_version_never_visible(tmp_path, tiny_model, monkeypatch):
    """A network volume reports a full disk at the fsync, after every file is written: the store's own I/O. It was a
    bare `OSError: [Errno 28] No space left on device`; it is a PublishError naming the step."""
    import errno

    import gyre.fsio
    from gyre_trainer.publish import PublishError

    model = trained_copy(tiny_model)
    store = WeightStore(tmp_path / "weights")
    publisher = WeightPublisher(FolderStore(store.root), tiny_model, keep_last=2)
    publisher.publish(1, model.state_dict(), model.config, {"step": 1})

    def full(path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(gyre.fsio, "fsync_file", full)
    with pytest.raises(PublishError, match=r"publishing weights step 2 failed: OSError: \[Errno 28\] No space left"):
        publisher.publish(2, model.state_dict(), model.config, {"step": 2})
    assert store.steps() == [1] and sorted(p.name for p in store.root.iterdir()) == ["step_1"]
