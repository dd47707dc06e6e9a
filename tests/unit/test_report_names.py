"""`gyre report` names its run as the other commands do: `--output-dir` (every other command's option; it was
"unrecognized arguments: --output-dir") or the experiment file `gyre rl` ran (`@ exp.toml`, its output_dir)."""

from __future__ import annotations

import json

import pytest
from gyre.local.report import main


def a_run(folder):
    (folder / "events").mkdir(parents=True)
    (folder / "events" / "trainer_steps.jsonl").write_text(json.dumps({"step": 1, "num_tokens": 5, "time": 1.0}))
    return folder


def test_the_run_by_its_folder_its_option_or_its_experiment_file(tmp_path, capsys):
    run = a_run(tmp_path / "run")
    (tmp_path / "exp.toml").write_text(f'output_dir = "{run}"\nmax_steps = 3\n[orchestrator]\nbatch_size = 4\n')
    exp = str(tmp_path / "exp.toml")
    for argv in ([str(run)], ["--output-dir", str(run)], ["--output_dir", str(run)], ["@", exp], [f"@{exp}"],
                 ["@", exp, "--output-dir", str(run)]):  # fmt: skip
        assert main(argv) == 0, argv
        assert "steps trained" in capsys.readouterr().out, argv


@pytest.mark.parametrize(
    ("argv", "said"),
    [([], "which run? give its output folder"), (["a", "--output-dir", "b"], "two output folders: a and b"),
     (["@", "missing.toml"], "config file not found: missing.toml")],
)  # fmt: skip
def test_no_run_or_two_are_usage_errors(argv, said, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and said in capsys.readouterr().err


def test_drawing_on_a_fresh_machine_logs_nothing_of_matplotlibs_font_cache(tmp_path):
    # matplotlib's first import on a machine builds its font cache and logs it at INFO: `make demo` on a fresh
    # machine printed "INFO launcher matplotlib.font_manager: generated new fontManager" under its progress bar
    import os
    import subprocess
    import sys

    run = a_run(tmp_path / "run")
    code = (
        "import sys\nfrom pathlib import Path\nfrom gyre.logging import setup_logging\n"
        "setup_logging('INFO', None, 'launcher')\nfrom gyre.local.report import draw\ndraw(Path(sys.argv[1]))\n"
    )
    fresh = {**os.environ, "MPLCONFIGDIR": str(tmp_path / "mpl")}  # no font cache yet, as on a fresh machine
    out = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True, text=True, env=fresh, timeout=300)
    assert out.returncode == 0, out.stderr
    assert (run / "report.png").is_file() and (tmp_path / "mpl").is_dir()  # the cache was built: it had to be
    assert "matplotlib" not in out.stderr, out.stderr
