"""The trainer benchmark's parts: fake batches (packed by `gyre.packing`), one tiny end-to-end run."""

from __future__ import annotations

import numpy as np
import pytest
from gyre.config.shared import ModelConfig
from gyre_trainer.bench import TrainerBenchConfig, fake_batch, main, run


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


def test_lengths_that_do_not_fit_name_their_key():
    # it said "config key '<root>': Value error, need min_len <= max_len <= seq_len"
    from gyre.config import ConfigError, load_config
    from gyre_trainer.bench import TrainerBenchConfig

    for argv, key in ((["--max-len", "5000"], "max_len"), (["--min-len", "500"], "min_len")):
        with pytest.raises(ConfigError, match=rf"^config key '{key}': need min_len <= max_len <= seq_len"):
            load_config(TrainerBenchConfig, argv)
