"""The files `gyre rl` writes into a run's folder and reads back on a re-run (`configs/`: each service's resolved
config, the SFT warm-up's record its changed-settings check compares with) are whole or absent: a launch killed
while writing one left it truncated, and the re-run read the stump."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from gyre.config import load_config, to_toml
from gyre.config.trainer import SFTConfig


def test_a_config_write_cut_short_leaves_the_previous_file_whole(tmp_path):
    path = tmp_path / "configs" / "sft.toml"
    path.parent.mkdir()
    before = to_toml(load_config(SFTConfig, ["--data.fake", "--max-steps", "2"]))
    path.write_text(before)
    # the write is cut after 64 bytes, as a kill (or a full disk) cuts it: RLIMIT_FSIZE fails the write with EFBIG
    script = textwrap.dedent(f"""
        import resource, signal
        from pathlib import Path
        from gyre.config import load_config
        from gyre.config.trainer import SFTConfig
        from gyre.local.launcher import _write_config

        config = load_config(SFTConfig, ["--data.env", "reverse_text", "--max-steps", "7"])
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))
        _write_config(Path({str(path)!r}), config)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "File too large" in run.stderr, run.stderr
    assert path.read_text() == before
    assert [p.name for p in path.parent.iterdir()] == ["sft.toml"]  # no temp file left behind


def test_a_written_config_is_private_and_complete(tmp_path):
    from gyre.local.launcher import _write_config

    config = load_config(SFTConfig, ["--data.fake"])
    path = _write_config(tmp_path / "configs" / "sft.toml", config)
    assert path.stat().st_mode & 0o777 == 0o600  # it may hold the API key / control token
    assert load_config(SFTConfig, ["@", str(path)]) == config


def test_a_ctrl_c_before_training_promises_no_checkpoint(tmp_path):
    # Ctrl-C while the base model was being created said "the trainer checkpoints its last step first (up to 300s)":
    # nothing had started to train, and the user waited for a checkpoint that never comes
    import signal
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    launch = subprocess.Popen([sys.executable, "-m", "gyre.cli", "rl", "@", str(root / "configs/ci.toml"),
                               "--output-dir", str(tmp_path / "run")], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        for line in launch.stdout:
            if line.startswith("creating base model"):  # `gyre model init` runs now (seconds: it imports torch)
                launch.send_signal(signal.SIGINT)
                break
        _, err = launch.communicate(timeout=120)
    finally:
        if launch.poll() is None:
            launch.kill()
            time.sleep(1)
    assert launch.returncode == 130, err[-2000:]
    assert "interrupted before training started" in err and "checkpoints its last step" not in err, err[-2000:]


def test_a_ctrl_c_whose_keyboard_interrupt_was_lost_still_stops_the_launch(tmp_path):
    # A Ctrl-C that lands while a child is forked raises its KeyboardInterrupt inside logging's at-fork hook, where
    # Python prints "Exception ignored" and drops it: the launch went on (created the model, trained the whole run)
    import time

    import pytest
    from gyre.config.rl import RLConfig
    from gyre.local.launcher import Launcher

    launcher = Launcher(load_config(RLConfig, ["--output-dir", str(tmp_path)]))
    launcher.interrupted = True  # what the signal handler did before its KeyboardInterrupt was lost
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        launcher._run_once("model-init", [sys.executable, "-c", "import time; time.sleep(20)"])
    assert time.monotonic() - started < 10
    launcher.shutdown()  # stops the child it left running
    assert not launcher.children


def test_a_ctrl_c_during_the_summary_ends_it_and_says_so(tmp_path):
    # every service had stopped; a Ctrl-C while the summary drew report.png was answered "killing the services now
    # (the next launch resumes the run)" and ignored: the user waited for the drawing anyway
    import signal
    import time

    script = textwrap.dedent(f"""
        import sys, time
        from gyre.local import launcher

        launcher.Launcher.run = lambda self: 0  # a run that finished
        def summarize(cfg, wall_seconds=None):
            print("summarizing", flush=True)
            time.sleep(60)  # report.png being drawn
        launcher.summarize = summarize
        sys.exit(launcher.main(["--output-dir", {str(tmp_path / "run")!r}]))
    """)
    run = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert run.stdout.readline().strip() == "summarizing"
        time.sleep(1.5)  # past the second in which a stop's signal delivered twice is one
        started = time.monotonic()
        run.send_signal(signal.SIGINT)
        _, err = run.communicate(timeout=30)
    finally:
        run.kill()
    assert time.monotonic() - started < 10
    assert run.returncode == 130, err
    assert "killing the services" not in err
    assert f"interrupted while writing the summary (the run is done); `gyre report {tmp_path / 'run'}` draws it" in err
