"""The trainer benchmark's parts: the first-fit-decreasing packer, fake batches, one tiny end-to-end run."""

from __future__ import annotations

import numpy as np
import pytest
from gyre.config.shared import ModelConfig
from gyre_trainer.bench import TrainerBenchConfig, fake_batch, main, pack_first_fit_decreasing, run
from hypothesis import given, settings
from hypothesis import strategies as st


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 100), max_size=60), st.integers(100, 300))
def test_ffd_places_every_sample_once_within_capacity(lengths, capacity):
    bins = pack_first_fit_decreasing(lengths, capacity)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
    # First fit never leaves two bins that could be merged, so at most one bin is half empty or worse.
    assert sum(sum(lengths[i] for i in b) <= capacity / 2 for b in bins) <= 1


def test_ffd_is_optimal_on_a_tight_instance():
    lengths = [2, 5, 2, 5, 8, 8]  # first fit in arrival order needs 4 rows of 10; sorted first, 3 full ones
    bins = pack_first_fit_decreasing(lengths, 10)
    assert sorted(sorted(lengths[i] for i in b) for b in bins) == [[2, 8], [2, 8], [5, 5]]
    with pytest.raises(ValueError, match="more than the row capacity"):
        pack_first_fit_decreasing([13], 12)


def test_fake_batch_is_valid_and_well_packed():
    cfg = TrainerBenchConfig(seq_len=512, num_samples=200, min_len=16, max_len=192)
    batch, efficiency = fake_batch(cfg, vocab_size=1024, rng=np.random.default_rng(0))
    rows = batch.for_rank(0)
    assert batch.num_samples == 200 and sum(r.num_samples for r in rows) == 200
    assert all(r.num_tokens <= 512 for r in rows)
    assert efficiency == pytest.approx(batch.num_tokens / (len(rows) * 512))
    assert efficiency >= 0.95
    assert all(not r.loss_mask[0] for r in rows)  # a sample's first token is never in the loss


def test_one_tiny_run_reports_every_figure(tiny_model, capsys):
    cfg = TrainerBenchConfig(
        model=ModelConfig(name=str(tiny_model)),
        seq_len=128,
        num_samples=8,
        min_len=8,
        max_len=64,
        steps=1,
        warmup=0,
        threads=1,
        device="cpu",
    )
    result = run(cfg)
    out = capsys.readouterr().out
    assert result.tokens_per_step > 0 and result.rows >= 1
    assert result.bare_tokens_per_s > 0 and result.rl_tokens_per_s > 0
    assert result.ratio == pytest.approx(result.rl_tokens_per_s / result.bare_tokens_per_s)
    assert 0 < result.rl_mfu < 1 and 0 < result.packing_efficiency <= 1
    for label in ("bare fwd+bwd+AdamW", "full RL train_step", "ratio", "packing efficiency", "MFU"):
        assert label in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--seq-len", "not-a-number"], "seq_len"), (["--min-len", "64", "--max-len", "32"], "min_len <= max_len")],
)
def test_bad_arguments_exit_with_status_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_missing_model_folder_is_a_clear_error(tmp_path, capsys):
    assert main(["--model.name", str(tmp_path / "nope"), "--steps", "1"]) == 2
    assert "does not exist" in capsys.readouterr().err
