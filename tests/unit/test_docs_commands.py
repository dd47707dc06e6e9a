"""README.md and docs/*.md only show commands, options, files and links that exist.

Every `gyre <command> ... --option` line a user would copy (code blocks and inline code) names options that
`gyre <command> --help` lists (for `gyre rl`, `--trainer.*` / `--orchestrator.*` / `--inference.*` are the
services' own options) and `@ configs/...` files that exist; every repository path in backticks exists, and
every relative link reaches an existing file and heading. (docs/kubernetes.md's chart claims: tests/chart/test_docs.py.)
"""

from __future__ import annotations

import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
from gyre.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
# `gyre <command>` then the rest of its line, up to a ` #` comment (`@ exp.toml#trainer` is none), the end of
# inline code or a table cell
COMMAND = re.compile(r"\bgyre ((?:bench|model) \w+|\w+)((?: +(?:[^`|\n#]|(?<=\S)#)*)?)")
FLAG = re.compile(r"(?<![\w-])--([A-Za-z][\w.-]*)")
SERVICE_SECTIONS = ("trainer", "orchestrator", "inference")  # `gyre rl --trainer.optim.lr` is the trainer's key


def _command_lines(text: str) -> list[tuple[str, str]]:
    """(command, rest of the line) for every `gyre ...` a reader would copy: code blocks and inline code."""
    blocks = [m.group(1).replace("\\\n", " ") for m in FENCE.finditer(text)]
    prose = FENCE.sub("", text)
    inline = [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", prose)]  # an inline span may wrap
    found = []
    for chunk in blocks + inline:
        found += [(m.group(1), m.group(2)) for m in COMMAND.finditer(chunk) if m.group(1) in COMMANDS]
    return found


@cache
def _options() -> dict[str, set[str]]:
    """Each command's options, read from its --help in one child process (snake case)."""
    code = (
        "import contextlib, io, json, sys\nfrom gyre.cli import COMMANDS, main\nout = {}\n"
        "for name in COMMANDS:\n"
        "    buf = io.StringIO()\n"
        "    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):\n"
        "        try:\n            main([*name.split(), '--help'])\n        except SystemExit:\n            pass\n"
        "    out[name] = buf.getvalue()\n"
        "print(json.dumps(out))\n"
    )
    import json

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    helps = json.loads(done.stdout.splitlines()[-1])
    return {name: {flag.replace("-", "_") for flag in FLAG.findall(text)} for name, text in helps.items()}


def _known(command: str, flag: str) -> bool:
    options = _options()[command]
    key = flag.replace("-", "_")
    if key in options or f"{key}.enabled" in options:  # `--ckpt`: a bare section flag turns it on
        return True
    section, _, rest = key.partition(".")
    return command == "rl" and section in SERVICE_SECTIONS and rest in _options()[section]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_documented_gyre_option_exists(doc):
    lines = _command_lines(doc.read_text())
    flags = [(cmd, flag, rest) for cmd, rest in lines for flag in FLAG.findall(rest) if flag != "help"]
    unknown = [f"gyre {cmd}: --{flag}   ({rest.strip()[:80]})" for cmd, flag, rest in flags if not _known(cmd, flag)]
    configs = [path for _, rest in lines for path in re.findall(r"@ ((?:configs|deploy)/[^\s#]+)", rest)]
    assert unknown + [f"@ {path}: no such file" for path in configs if not (ROOT / path).is_file()] == []


def test_the_scan_sees_the_commands_of_every_kind():
    lines = [line for doc in DOCS for line in _command_lines(doc.read_text())]
    seen = {cmd for cmd, _ in lines}
    assert {"rl", "inference", "orchestrator", "eval", "sft", "bench trainer", "model init"} <= seen
    wrapped = [rest for cmd, rest in lines if cmd == "inference" and "--auth.api-key-file" in rest]
    assert wrapped, "an inline command wrapped over two lines (docs/kubernetes.md) is read as one"
    assert any("--orchestrator.env.args" in rest for cmd, rest in lines if cmd == "rl"), "a `\\` continuation"
    assert any("--bench" in rest for cmd, rest in lines if cmd == "trainer"), "options after `@ exp.toml#trainer`"


def test_an_unknown_option_is_caught():
    assert not _known("rl", "trainer.optim.learning_rate") and not _known("bench weights", "round")
    assert _known("rl", "trainer.optim.lr") and _known("rl", "orchestrator.max-async-level") and _known("rl", "ckpt")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_repository_paths_and_links_exist(doc):
    text = doc.read_text()
    tops = {p.name for p in ROOT.iterdir()}
    missing = [p for p in re.findall(r"`([\w./-]+/[\w./-]+)`", text)
               if p.split("/")[0] in tops and p.split("/")[0] != "outputs" and not (ROOT / p).exists()]  # fmt: skip
    for target, anchor in re.findall(r"\]\(([^)#\s]*)(#[^)\s]+)?\)", text):
        if target.startswith(("http://", "https://")):
            continue
        path = (doc.parent / target) if target else doc
        if not path.exists():
            missing.append(target)
        elif anchor and path.suffix == ".md":
            slugs = [re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
                     for line in path.read_text().splitlines() if line.startswith("#")]  # fmt: skip
            if anchor[1:] not in slugs:
                missing.append(target + anchor)
    assert missing == []


def test_every_dependency_is_explained_in_dependencies_md():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = project["dependencies"] + [s for extra in project["optional-dependencies"].values() for s in extra]
    names = {re.split(r"[<>=!~;\[ ]", spec, maxsplit=1)[0].lower() for spec in specs} - {"gyre"}
    text = (ROOT / "docs" / "dependencies.md").read_text().lower()
    assert sorted(name for name in names if name not in text) == []


def test_every_documented_make_target_exists():
    targets = set(re.findall(r"(?m)^([\w-]+):", (ROOT / "Makefile").read_text()))
    named = {t for doc in DOCS for t in re.findall(r"(?m)(?:`|^)make ([\w-]+)", doc.read_text())}
    assert "demo" in named and sorted(named - targets) == []


def test_the_readme_opens_with_the_two_commands_and_says_what_make_demo_runs():
    """The README's first code block is exactly `make demo` and `make test`; where a doc spells out what `make demo`
    runs, it is the Makefile's recipe (the README left out `--output-dir outputs/demo --fresh`, and the bare command
    it showed continues a run instead of starting over)."""
    readme = (ROOT / "README.md").read_text()
    first = FENCE.search(readme).group(1)
    assert [line.split("#")[0].strip() for line in first.strip().splitlines()] == ["make demo", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    values = dict(re.findall(r"(?m)^(\w+) \?= (.*)$", makefile))
    recipe = re.search(r"(?m)^demo:.*\n\t\$\(VENV\)/bin/(gyre [^#\n]*)", makefile).group(1).strip()
    command = re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], recipe)
    for doc in (ROOT / "README.md", ROOT / "docs" / "local.md"):
        stated = re.findall(r"make demo`? +(?:#\s*)?=\s*`?(gyre [^`\n(]*)", doc.read_text())
        assert stated and all(text.strip() == command for text in stated), (doc.name, stated, command)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_toml_examples_are_valid_configs(doc):
    """A ```toml block's service tables load as that service's config, its other keys as `gyre rl`'s."""
    import tomllib

    from gyre.config.inference import InferenceConfig
    from gyre.config.orchestrator import OrchestratorConfig
    from gyre.config.rl import RLConfig
    from gyre.config.trainer import TrainerConfig

    services = {"inference": InferenceConfig, "orchestrator": OrchestratorConfig, "trainer": TrainerConfig}
    for block in re.findall(r"(?ms)^```toml\n(.*?)^```", doc.read_text()):
        data = tomllib.loads(block)
        data.pop("project", None)  # a package's pyproject.toml (entry points), not a config
        for section, cls in services.items():
            if section in data:
                cls(**data.pop(section))
        if data:
            RLConfig(**data)
