"""The `gyre` command: one entry point, subcommands imported only when run.

Light processes (the orchestrator, `gyre --help`) must never pay for importing torch, so every
subcommand is a ``"module:function"`` string resolved at dispatch time.
"""

from __future__ import annotations

import importlib
import os
import sys

# name -> (target "module:function(argv)", one-line help). Multi-word commands use spaces.
COMMANDS: dict[str, tuple[str, str]] = {
    "rl": ("gyre.local.launcher:main", "Run inference, orchestrator and trainer locally with an embedded Redis."),
    "inference": ("gyre_inference.main:main", "Serve a policy over the OpenAI API with gRPC weight control."),
    "trainer": ("gyre_trainer.main:main", "Train on batches from Redis; publish weights; notify the orchestrator."),
    "sft": ("gyre_trainer.sft:main", "Supervised fine-tuning on chat data (or generated data)."),
    "orchestrator": ("gyre_orchestrator.main:main", "Run environments, score, compute advantages, stream batches."),
    "eval": ("gyre_orchestrator.eval_command:main", "Evaluate a served model on an environment's held-out split."),
    "envs": ("gyre.envs.registry:main", "List the environments loadable by name (built-ins, installed packages)."),
    "model init": ("gyre.model_init:main", "Create a tiny Llama model and BPE tokenizer (HF format)."),
    "model fetch": ("gyre.model_source:main", "Download a hub model into the HF cache, after checking it fits."),
    "model import": ("gyre.model_import:main", "Import a pretrained model (GGUF, HF folder, hub) as an HF folder."),
    "report": ("gyre.local.report:main", "Draw reward / eval / step-time curves of a run as a PNG."),
    "export": ("gyre.local.export:main", "Write a run's checkpoint as a Hugging Face folder (LoRA merged + lora/)."),
    "replay": ("gyre_trainer.replay:main", "Recompute a kept step's (debug/step_N) loss and gradient norm."),
    "bench inference": ("gyre_inference.bench:main", "Benchmark the inference backend."),
    "bench trainer": ("gyre_trainer.bench:main", "Benchmark the trainer step."),
    "bench orchestrator": ("gyre_orchestrator.bench:main", "Benchmark orchestrator overhead per sample."),
    "bench async": ("gyre.local.bench_async:main", "Compare max_async_level 0 vs 1 step times."),
    "bench weights": ("gyre_trainer.bench_weights:main", "Weights swap time vs writing + reading the same bytes."),
}


def _usage() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = ["usage: gyre <command> [@ config.toml ...] [--key value ...]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {desc}" for name, (_, desc) in COMMANDS.items()]
    lines += ["", "Run 'gyre <command> --help' to see every option of a command with its default."]
    return "\n".join(lines)


_SYNONYMS = {"train": "trainer", "evaluate": "eval", "serve": "inference", "orch": "orchestrator", "infer": "inference"}


def _near(given: str, names: list[str]) -> str:
    """`'trainer'` for a near miss (`gyre train`, `gyre evaluate`), else ""."""
    import difflib

    near = [_SYNONYMS[given]] if _SYNONYMS.get(given) in names else difflib.get_close_matches(given, names, n=1)
    return f"{near[0]!r}" if near else ""


def resolve(argv: list[str]) -> tuple[str, str, list[str]] | None:
    """Longest command name matching the start of argv -> (name, target, remaining argv)."""
    for words in (2, 1):
        name = " ".join(argv[:words])
        if len(argv) >= words and name in COMMANDS:
            return name, COMMANDS[name][0], argv[words:]
    return None


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(sys.argv[1:] if argv is None else list(argv))
    except BrokenPipeError:  # `gyre envs | head`, `gyre --help | head`: the reader left; what it read is all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 0


def _main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] == "--version":
        from gyre import __version__

        print(f"gyre {__version__}")
        return 0
    found = resolve(argv)
    if found is None:
        subcommands = [name.split()[1] for name in COMMANDS if name.split()[0] == argv[0] and " " in name]
        if subcommands:  # `gyre model`, `gyre bench --help`: a group, not an unknown command
            given = argv[1] if len(argv) > 1 and not argv[1].startswith("-") else None
            near = _near(given, subcommands) if given else ""
            what = f" ({given!r} is none{'; did you mean ' + near + '?' if near else ''})" if given else ""
            print(f"gyre {argv[0]}: choose a subcommand: {', '.join(subcommands)}{what}\n\n{_usage()}",
                  file=sys.stderr)  # fmt: skip
        else:
            heads = sorted({name.split()[0] for name in COMMANDS})
            near = _near(argv[0], heads)
            print(f"gyre: unknown command {argv[0]!r}{f' (did you mean {near}?)' if near else ''}\n\n{_usage()}",
                  file=sys.stderr)  # fmt: skip
        return 2
    name, target, rest = found
    module_name, func_name = target.split(":")
    try:
        try:
            module = importlib.import_module(module_name)  # seconds for torch: a Ctrl-C lands here as often as later
        except ModuleNotFoundError as e:
            if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
                print(f"gyre: command {name!r} is not available in this installation ({e})", file=sys.stderr)
                return 2
            raise
        result = getattr(module, func_name)(rest)
    except KeyboardInterrupt:  # Ctrl-C of a command without its own handling: one line, not a traceback
        print(f"gyre {name}: interrupted", file=sys.stderr)
        return 130
    return int(result or 0)


if __name__ == "__main__":
    raise SystemExit(main())
