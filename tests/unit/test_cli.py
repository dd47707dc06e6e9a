"""The `gyre` dispatcher: lazy subcommands, help, and `import gyre` never importing torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from gyre.cli import COMMANDS, resolve


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gyre.cli", *args], capture_output=True, text=True, timeout=120)


def test_help_lists_every_command():
    out = run("--help")
    assert out.returncode == 0
    for name in COMMANDS:
        assert name in out.stdout


def test_unknown_command_exits_2():
    out = run("frobnicate")
    assert out.returncode == 2 and "unknown command" in out.stderr and "did you mean" not in out.stderr


@pytest.mark.parametrize(
    ("argv", "said"),
    [(["train", "@", "x.toml"], "gyre: unknown command 'train' (did you mean 'trainer'?)"),
     (["evaluate"], "gyre: unknown command 'evaluate' (did you mean 'eval'?)"),
     (["model", "int"], "gyre model: choose a subcommand: init, fetch, import ('int' is none; did you mean 'init'?)")],
)  # fmt: skip
def test_a_near_miss_of_a_command_is_suggested(argv, said):
    # `gyre train` (PRIME-RL's `trainer` spelt short) said only "unknown command 'train @'"
    out = run(*argv)
    assert out.returncode == 2 and out.stderr.splitlines()[0] == said, out.stderr


@pytest.mark.parametrize("argv", [["model"], ["bench", "--help"], ["model", "nit"]])
def test_a_command_group_alone_names_its_subcommands(argv):
    out = run(*argv)  # once: "unknown command 'model'", though `gyre model init` exists
    assert out.returncode == 2 and "unknown command" not in out.stderr
    group = argv[0]
    expected = [name.split()[1] for name in COMMANDS if name.startswith(group + " ")]
    assert f"gyre {group}: choose a subcommand: {', '.join(expected)}" in out.stderr


def test_two_word_commands_resolve_before_one_word():
    assert resolve(["model", "init", "--seed", "1"])[0] == "model init"
    assert resolve(["bench", "trainer"])[0] == "bench trainer"
    assert resolve(["rl", "--max-steps", "2"])[2] == ["--max-steps", "2"]


def test_every_command_target_is_importable_as_a_module_path():
    for target, _ in COMMANDS.values():
        module, func = target.split(":")
        assert module and func.isidentifier()


def test_importing_any_module_of_gyre_does_not_import_torch():
    # libs/gyre is the torch-free library (the orchestrator image has no torch): every module of it, found by
    # walking the package (a hand-kept list of five had let the others go unchecked), imports torch lazily if at all
    code = (
        "import importlib, pkgutil, sys, gyre\n"
        "names = [m.name for m in pkgutil.walk_packages(gyre.__path__, 'gyre.')]\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "print(len(names))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) > 90  # the walk found the package's modules (97 when written)


def test_gyre_eval_help_describes_evaluation_not_the_orchestrator():
    # `gyre eval --help` once opened with the orchestrator's "... compute advantages, pack and stream batches"
    text = {name: run(name, "--help").stdout for name in ("eval", "orchestrator")}
    summary = {name: out.splitlines()[2] for name, out in text.items()}
    assert summary["eval"] != summary["orchestrator"]
    assert "held-out" in summary["eval"] and "stream batches" not in summary["eval"]
    # and it listed (and accepted, and ignored) every training option: --batch_size, --sampling.temperature...
    assert "--eval.num_examples " in text["eval"] and "--eval.temperature " in text["eval"]
    assert not {"--batch_size ", "--sampling.temperature ", "--redis.url ", "--eval.interval "} & set(
        word + " " for word in text["eval"].split()
    )


def test_output_cut_short_by_the_reader_is_not_a_traceback():
    # `gyre envs | head -1` printed a BrokenPipeError traceback
    pipe = subprocess.run(
        f"{sys.executable} -m gyre.cli envs | head -1", shell=True, capture_output=True, text=True, timeout=120
    )
    assert pipe.stdout.startswith("alphabet_sort") and "Traceback" not in pipe.stderr, pipe.stderr
    # gyre's own usage too (a traceback: only subcommands were handled); `true` reads nothing, and has left when gyre
    # writes (a `head -1` may still be reading a short text)
    for command in ("--help", "", "rl --help", "--version"):
        pipe = subprocess.run(f"{sys.executable} -m gyre.cli {command} | true", shell=True, capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        assert pipe.returncode == 0 and "Traceback" not in pipe.stderr, (command, pipe.stderr)


def test_replay_help_marks_step_dir_required_and_accepts_the_current_folder(tmp_path):
    # --help said `--step_dir Path  (default: ".")` beside "(required)", and `--step-dir .` was refused as missing
    assert "--step_dir Path  (required)" in run("replay", "--help").stdout
    missing = run("replay")
    assert missing.returncode == 2 and "gyre replay: error: config key 'step_dir': Field required" in missing.stderr
    here = subprocess.run([sys.executable, "-m", "gyre.cli", "replay", "--step-dir", "."], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert here.returncode == 2 and ". is not a kept step (no step.json)" in here.stderr


def test_ctrl_c_is_one_line_and_exit_130_not_a_traceback(tmp_path, tiny_model):
    # Ctrl-C of `gyre model import` (or `gyre eval`, ...) printed a KeyboardInterrupt traceback
    import signal
    import time

    out = tmp_path / "imported"
    # SIGINT as a terminal's foreground job has it: a shell's background job (how CI may start the suite) ignores
    # SIGINT, every child inherits that, and Python then rightly leaves it ignored
    proc = subprocess.Popen([sys.executable, "-m", "gyre.cli", "model", "import", str(tiny_model), "--output-dir",
                             str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    # once it is importing torch (inside the command, under gyre's handler): a fixed second was sometimes still the
    # interpreter's start-up on a loaded machine, where a Ctrl-C is Python's own KeyboardInterrupt traceback
    deadline = time.monotonic() + 60
    while "libtorch" not in Path(f"/proc/{proc.pid}/maps").read_text() and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    # exit 130, or death by SIGINT (a shell reports both as 130, what an interrupted command's caller looks for).
    # -2 is CPython re-raising SIGINT at exit (kill(getpid(), SIGINT), seen with strace) after a KeyboardInterrupt
    # it counted as unhandled. One cause was the command's import outside gyre's handler (a traceback too; fixed:
    # test_ctrl_c_while_the_command_is_imported_is_one_line_and_exit_130); CI's variant, after the message and
    # without a traceback, was reproduced (3 in ~30 tries) but not pinned to a line, and was not seen in 24 tries
    # since. A SIGINT that lands after the command has finished (SIGINT's default action restored) dies by it too
    assert proc.returncode in (130, -signal.SIGINT), err[-3000:]
    assert err.rstrip().endswith("gyre model import: interrupted") and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing half written, no staging folder left


def test_ctrl_c_while_the_command_is_imported_is_one_line_and_exit_130(tmp_path):
    # the command's module was imported outside the KeyboardInterrupt handler: a Ctrl-C while it loaded (pydantic,
    # torch: the first seconds of every command) was a traceback and death by SIGINT (CI's -2 once came from there)
    import signal
    import time

    (tmp_path / "slow_command.py").write_text(
        "import sys, time\nprint('importing', file=sys.stderr, flush=True)\ntime.sleep(60)\n"
        "def main(argv):\n    return 0\n"
    )
    code = ("import sys\nfrom gyre import cli\ncli.COMMANDS['slow'] = ('slow_command:main', 'imports for a minute')\n"
            "sys.exit(cli.main(['slow']))")  # fmt: skip
    path = f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": path},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    assert proc.stderr.readline().strip() == "importing"
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-3000:]
    assert err.strip() == "gyre slow: interrupted" and "Traceback" not in err


def test_model_fetch_help_marks_name_required_and_a_bad_one_names_the_key():
    # --help said `--name str  (default: "")` with "required" in its text; a missing one was "--name '' is not..."
    assert "--name str  (required)" in run("model", "fetch", "--help").stdout
    missing = run("model", "fetch")
    assert missing.returncode == 2 and "gyre model fetch: error: config key 'name': Field required" in missing.stderr
    bad = run("model", "fetch", "--name", "gpt2")
    assert bad.returncode == 2 and "config key 'name': 'gpt2' is not a hub id (org/name)" in bad.stderr


def test_help_shows_a_secret_option_type_without_its_module_path():
    from gyre.config import help_text
    from gyre.config.inference import InferenceConfig

    text = help_text(InferenceConfig, "gyre inference")
    assert "--auth.api_key SecretStr | None  (default: null)" in text and "pydantic.types" not in text
    from gyre.config.orchestrator import GyreEvalConfig

    assert "--judges list[JudgeConfig]  (default: [])" in help_text(GyreEvalConfig, "gyre eval")


def test_export_help_explains_every_option_without_importing_torch():
    # `gyre export` did not exist: a checkpoint was exported only by `python -m gyre_trainer.export @ <the trainer's
    # config>`, which a `gyre rl` user had to find in the run's folder
    code = "import sys\nfrom gyre.cli import main\nassert main(['export', '--help']) == 0\n"
    code += "assert 'torch' not in sys.modules, 'torch imported'\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for option in ("RUN_DIR", "@ trainer.toml", "--run NAME", "--step N", "--to DIR", "--key value", "lora/"):
        assert option in out.stdout, option


def test_export_names_the_run_by_its_folder_and_its_saved_trainer_config(tmp_path):
    from gyre.local.export import export_argv

    folder = tmp_path / "demo"
    (folder / "configs").mkdir(parents=True)
    # launched from elsewhere with a relative output_dir: the base model is the run's own folder, by that path
    (folder / "configs/trainer.toml").write_text('output_dir = "outputs/demo"\n[model]\nname = "outputs/demo/model"\n')
    assert export_argv([str(folder), "--step", "3", "--to", "hf"]) == [
        "@", str(folder / "configs/trainer.toml"), "--output-dir", str(folder), "--model.name", str(folder / "model"),
        "--step", "3", "--to", "hf"]  # fmt: skip
    (folder / "configs/trainer.toml").write_text(f'output_dir = "{folder}"\n[model]\nname = "Qwen/Qwen3-0.6B"\n')
    config = str(folder / "configs/trainer.toml")
    assert export_argv([str(folder), "--to", "hf"])[:4] == ["@", config, "--output-dir", str(folder)]
    assert export_argv(["@", "t.toml", "--to", "hf"]) == ["@", "t.toml", "--to", "hf"]  # the trainer's own form

    missing = run("export", str(tmp_path / "nope"), "--to", str(tmp_path / "hf"))
    assert missing.returncode == 2 and f"RUN_DIR {tmp_path / 'nope'} is no folder" in missing.stderr
    (tmp_path / "sft-run/configs").mkdir(parents=True)
    (tmp_path / "sft-run/configs/sft.toml").write_text("")
    sft = run("export", str(tmp_path / "sft-run"), "--to", str(tmp_path / "hf"))
    assert sft.returncode == 2 and "has no configs/trainer.toml" in sft.stderr and "SFT run" in sft.stderr
    assert not (tmp_path / "hf").exists()


def test_export_of_a_multi_run_experiment_needs_the_run_and_lists_the_names(tmp_path):
    # a [[runs]] experiment's trainer config has trainer.runs: the export refused it, whatever was given
    import json

    from gyre.local.export import export_argv

    folder = tmp_path / "multi"
    (folder / "configs").mkdir(parents=True)
    (folder / "runs/alpha").mkdir(parents=True)
    config = folder / "configs/trainer.toml"
    # launched from elsewhere (relative folders): each run's folder is read in the experiment's folder given
    config.write_text(
        'output_dir = "outputs/multi"\n'
        '[[runs]]\nname = "alpha"\noutput_dir = "outputs/multi/runs/alpha"\n'
        '[[runs]]\nname = "beta"\noutput_dir = "outputs/multi/runs/beta"\n[runs.lora]\nrank = 8\n'
    )
    argv = export_argv([str(folder), "--run", "beta", "--to", "hf"])
    assert argv[:4] == ["@", str(config), "--output-dir", str(folder)] and argv[-4:] == ["--run", "beta", "--to", "hf"]
    runs = json.loads(argv[argv.index("--runs") + 1])
    assert runs == [{"name": "alpha", "output_dir": str(folder / "runs/alpha")},
                    {"name": "beta", "output_dir": str(folder / "runs/beta"), "lora": {"rank": 8}}]  # fmt: skip
    # the run's own folder names the run
    own = export_argv([str(folder / "runs/alpha"), "--to", "hf"])
    assert own[:4] == ["@", str(config), "--output-dir", str(folder)] and own[-4:] == ["--to", "hf", "--run", "alpha"]

    for args, said in [
        ([], "is a multi-run experiment: name the run to export with --run (alpha, beta)"),
        (["--run", "gamma"], "--run gamma: " + str(folder) + " has no such run (alpha, beta)"),
    ]:
        res = run("export", str(folder), *args, "--to", str(tmp_path / "hf"))
        assert res.returncode == 2 and said in res.stderr, res.stderr
    res = run("export", str(folder / "runs/alpha"), "--run", "beta", "--to", str(tmp_path / "hf"))
    assert res.returncode == 2 and "is the folder of run 'alpha'" in res.stderr
    config.write_text('output_dir = "outputs/single"\n')
    res = run("export", str(folder), "--run", "alpha", "--to", str(tmp_path / "hf"))
    assert res.returncode == 2 and "is a single run (no [[runs]]); drop --run" in res.stderr
    assert not (tmp_path / "hf").exists()
