"""`gyre bench async` option parsing: its own options anywhere, the rest passed on to `gyre rl`."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from gyre.local import bench_async
from gyre.local.bench_async import ROOT_CONFIG, parse_args


def test_own_options_after_the_config_are_not_passed_on():
    args, extra = parse_args(["exp.toml", "--output-dir", "runs", "--max-steps", "5", "--levels", "0,2"])
    assert (args.config, args.output_dir, args.max_steps, args.levels) == (["exp.toml"], Path("runs"), 5, [0, 2])
    assert extra == []


def test_unknown_options_and_everything_after_a_double_dash_go_to_gyre_rl():
    args, extra = parse_args(["exp.toml", "--trainer.device", "cuda", "--output-dir", "x", "--", "--max-steps", "9"])
    assert args.output_dir == Path("x") and args.max_steps == 8
    assert extra == ["--trainer.device", "cuda", "--max-steps", "9"]


def test_defaults():
    args, extra = parse_args([])
    assert args.config == [str(ROOT_CONFIG)] and args.output_dir is None and extra == []


def test_the_experiment_is_given_as_every_command_takes_it_and_an_options_value_is_no_file():
    # `@ exp.toml` was passed on as a config file named '@'; `--trainer.optim.lr 1` gave the file "1"
    args, extra = parse_args(["@", "a.toml", "@b.toml", "--trainer.optim.lr", "1", "--levels", "0", "--fresh"])
    assert args.config == ["a.toml", "b.toml"] and args.levels == [0]
    assert extra == ["--trainer.optim.lr", "1", "--fresh"]


def test_a_mistake_in_the_experiment_or_the_options_passed_on_stops_it_before_any_run(tmp_path, monkeypatch, capsys):
    # they failed only when the first run started, a level's after the other levels' runs had been made
    monkeypatch.setattr(bench_async.subprocess, "Popen", lambda *a, **k: pytest.fail("a run started"))
    for argv, said in [
        (["--trainer.optim.lrr", "1"], "config key 'trainer.optim.lrr': unknown key"),
        (["@", str(tmp_path / "nope.toml")], "config file not found"),
    ]:
        with pytest.raises(SystemExit) as e:
            bench_async.main([*argv, "--output-dir", str(tmp_path / "runs")])
        assert str(e.value.code).startswith("gyre bench async: error: ") and said in str(e.value.code), e.value.code


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--levels", "a,b"], "argument --levels: not comma-separated integers: 'a,b'"),
        (["--levels", "0,-1"], "argument --levels: each level once, each >= 0"),
        (["--levels", "1,1"], "argument --levels: each level once"),
        (["--max-steps", "2"], "argument --max-steps: 2: the measurement needs at least 3 steps"),
    ],
)
def test_bad_values_name_the_option_before_any_run(argv, said, capsys):
    # --levels a,b was a ValueError traceback; --max-steps 2 failed only after both runs had been made
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2 and said in capsys.readouterr().err


class FakeRl:
    """Stands in for the `gyre rl` child: records its argv, and with `interrupt` is Ctrl-C'd while waited for."""

    made: list[FakeRl] = []

    def __init__(self, cmd, interrupt=False, **_):
        self.cmd, self.interrupt, self.signals, self.killed, self.returncode = cmd, interrupt, [], False, None
        FakeRl.made.append(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def communicate(self, timeout=None):
        if self.interrupt and self.returncode is None and not self.signals:
            raise KeyboardInterrupt
        self.returncode = 130 if self.signals else 0
        return "", ""

    def poll(self):
        return self.returncode

    def send_signal(self, sig):
        self.signals.append(sig)

    def wait(self, timeout=None):
        self.returncode = 130
        return 130

    def kill(self):
        self.killed = True


def test_each_run_starts_over_and_a_ctrl_c_lets_gyre_rl_stop_its_services(tmp_path, monkeypatch):
    # a kept --output-dir made the second benchmark's runs "already finished": it reported the first one's numbers
    monkeypatch.setattr(bench_async, "measure", lambda out: {"out": out})
    monkeypatch.setattr(bench_async.subprocess, "Popen", FakeRl)
    FakeRl.made.clear()
    assert bench_async.run_level(["exp.toml"], 1, 5, tmp_path / "async1", []) == {"out": tmp_path / "async1"}
    assert "--fresh" in FakeRl.made[0].cmd
    # Ctrl-C: subprocess.run SIGKILLed gyre rl, whose services died as in a crash while the temp folder was deleted
    monkeypatch.setattr(bench_async.subprocess, "Popen", lambda cmd, **kw: FakeRl(cmd, interrupt=True))
    with pytest.raises(KeyboardInterrupt):
        bench_async.run_level(["exp.toml"], 1, 5, tmp_path / "async1", [])
    assert FakeRl.made[1].signals == [signal.SIGINT] and not FakeRl.made[1].killed


# A stand-in `gyre rl` that, once Ctrl-C'd, prints a lot while its services stop (their warnings, tracebacks), then
# notes that it stopped: SIGINT is blocked and waited for, so nothing here races the signal.
LOUD_STOP = """
import pathlib, signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
print("running", flush=True)
signal.sigwait({signal.SIGINT})
sys.stdout.write("o" * 300_000)
sys.stderr.write("e" * 300_000)
sys.stdout.flush()
sys.stderr.flush()
pathlib.Path(sys.argv[1]).write_text("stopped")
"""


def test_a_ctrl_c_lets_gyre_rl_finish_stopping_however_much_it_prints_meanwhile(tmp_path, monkeypatch):
    # run_level waited for the stopping gyre rl without reading its pipes: once they held 64 KiB, gyre rl blocked in a
    # write, was SIGKILLed 120 s later and its services died as in a crash, their stop checkpoint lost
    import subprocess
    import sys

    stopped = tmp_path / "stopped"

    class CtrlCdRl(subprocess.Popen):
        interrupted = False

        def __init__(self, cmd, **kw):
            super().__init__([sys.executable, "-c", LOUD_STOP, str(stopped)], **kw)

        def communicate(self, *args, **kw):
            if not CtrlCdRl.interrupted:  # the first wait: Ctrl-C once the child runs
                CtrlCdRl.interrupted = True
                assert self.stdout.readline() == "running\n"
                raise KeyboardInterrupt
            return super().communicate(*args, **kw)

    monkeypatch.setattr(bench_async.subprocess, "Popen", CtrlCdRl)
    with pytest.raises(KeyboardInterrupt):
        bench_async.run_level(["exp.toml"], 1, 5, tmp_path / "async1", [])
    assert stopped.read_text() == "stopped"
