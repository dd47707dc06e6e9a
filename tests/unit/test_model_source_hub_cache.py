"""A hub id loaded from the hub cache gets the start-up checks a model folder gets.

The chart's services run with `HF_HUB_OFFLINE=1` and load `model.name = org/name` from the cache's snapshot
(`models--org--name/snapshots/<rev>`, symlinks into `blobs/`). A plain folder without a tokenizer stopped the service
at start naming `model.name` (exit 2); the same model as a hub id passed (a service took it on trust, `gyre sft` and
`gyre rl` fetched only its config from the cache) and failed after start, in transformers.
"""

from __future__ import annotations

import shutil

import pytest
from gyre.model_source import ModelUnavailable, check_model_source, check_service_model
from support.models import hub_cache_layout


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hub"


def cached(tiny_model, tmp_path, cache, repo: str, leave_out: tuple[str, ...] = ()):
    folder = tmp_path / repo.replace("/", "-")
    shutil.copytree(tiny_model, folder, ignore=shutil.ignore_patterns(*leave_out))
    return hub_cache_layout(folder, cache, repo)


@pytest.mark.parametrize("hub", [False, True])
def test_a_cached_snapshot_without_a_tokenizer_is_refused_as_a_folder_is(tiny_model, tmp_path, offline_cache, hub):
    snapshot = cached(tiny_model, tmp_path, offline_cache, "org/no-tokenizer", leave_out=("tokenizer*",))
    with pytest.raises(ModelUnavailable) as folder_error:
        check_model_source(str(snapshot), hub=False)
    with pytest.raises(ModelUnavailable) as hub_error:
        check_model_source("org/no-tokenizer", hub=hub)
    assert "holds no tokenizer" in str(folder_error.value)
    assert str(hub_error.value).startswith(f"model.name = 'org/no-tokenizer': the model folder {snapshot} holds no "
                                           "tokenizer (tokenizer.json, ")  # fmt: skip


def test_a_snapshot_whose_weights_blob_is_missing_holds_no_weights(tiny_model, tmp_path, offline_cache):
    snapshot = cached(tiny_model, tmp_path, offline_cache, "org/pruned")
    (snapshot / "model.safetensors").resolve().unlink()  # the symlink dangles, as after a pruned or partial cache
    with pytest.raises(ModelUnavailable, match="holds no weights"):
        check_model_source("org/pruned", hub=False)


def test_a_complete_cached_model_passes_and_one_not_cached_is_said_at_start(tiny_model, tmp_path, offline_cache,
                                                                            capsys):  # fmt: skip
    cached(tiny_model, tmp_path, offline_cache, "org/complete")
    assert check_model_source("org/complete", hub=False) == "hub id" == check_model_source("org/complete")
    assert check_service_model("org/missing", "gyre inference") == 2
    said = capsys.readouterr().err
    assert "model.name = 'org/missing' is not a local folder" in said
    assert f"HF_HUB_OFFLINE is set, and it is not in the hub cache {offline_cache}" in said


def test_the_hub_caches_repo_folder_is_refused_naming_its_snapshots(tiny_model, tmp_path, offline_cache, capsys):
    # `gyre model import` takes `models--org--name` (its refs/main snapshot); a service loads folders with a
    # config.json, and said only "not a model folder"
    snapshot = cached(tiny_model, tmp_path, offline_cache, "org/repo")
    repo_folder = snapshot.parent.parent
    assert check_service_model(str(repo_folder), "gyre trainer") == 2
    said = capsys.readouterr().err
    assert f"{repo_folder} is a hub cache folder, not a model folder: give one of its snapshots" in said
    assert check_service_model(str(snapshot), "gyre trainer") is None
