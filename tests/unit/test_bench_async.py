"""`gyre bench async` option parsing: its own options anywhere, the rest passed on to `gyre rl`."""

from __future__ import annotations

from pathlib import Path

from gyre.local.bench_async import ROOT_CONFIG, parse_args


def test_own_options_after_the_config_are_not_passed_on():
    args, extra = parse_args(["exp.toml", "--output-dir", "runs", "--max-steps", "5", "--levels", "0,2"])
    assert (args.config, args.output_dir, args.max_steps, args.levels) == ("exp.toml", Path("runs"), 5, "0,2")
    assert extra == []


def test_unknown_options_and_everything_after_a_double_dash_go_to_gyre_rl():
    args, extra = parse_args(["exp.toml", "--trainer.device", "cuda", "--output-dir", "x", "--", "--max-steps", "9"])
    assert args.output_dir == Path("x") and args.max_steps == 8
    assert extra == ["--trainer.device", "cuda", "--max-steps", "9"]


def test_defaults():
    args, extra = parse_args([])
    assert args.config == str(ROOT_CONFIG) and args.output_dir is None and extra == []
