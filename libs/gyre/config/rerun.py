"""A re-run against what a previous run recorded: which keys changed that the run's result is shaped by.

Shared by `gyre rl` (its SFT warm-up, checked before anything starts) and a stand-alone `gyre sft`: both record
the resolved SFT config as ``{output_dir}/configs/sft.toml`` (`SFT_RECORD`) and refuse a re-run that would go on
from (or skip as finished) a result of other settings, naming every changed key. `env_changes` is the rule for an
RL run's environment, shared by `gyre rl` (against the config its previous launch wrote) and the orchestrator
itself (against its progress checkpoint: a `helm upgrade` of a running experiment passes no launcher).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

SFT_RECORD = Path("configs") / "sft.toml"  # in output_dir: the config of the SFT trained (or being trained) there
# `gyre sft` keys that do not shape its result (or are the run's, checked elsewhere): free on a re-run.
SFT_FREE_KEYS = ("run_id", "output_dir", "save_dir", "log", "wandb", "ckpt", "device")
# ... and nested keys of how a step is computed, not what it computes: the loss is the mean over the whole batch's loss
# tokens, however many rows each forward takes. A run stopped by an out-of-memory error was refused its checkpoint
# when re-run with a smaller `data.micro_batch_size`, the one fix for it (or another attention kernel, compile off).
SFT_FREE_NESTED = {"data": ("micro_batch_size",), "model": ("name", "compile", "attn_implementation")}
# ... and of an SFT stopped half way, which the re-run resumes from its checkpoint: how far it goes.
SFT_FREE_KEYS_IN_PROGRESS = ("max_steps", "epochs")


def dotted_keys(values: dict[str, Any], prefix: str = "") -> set[str]:
    """Every leaf key of a nested dict, dotted (`data.seq_len`)."""
    out = set()
    for key, value in values.items():
        out |= dotted_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}"}
    return out


def differences(old: Any, new: Any, explicit: set[str], prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) of every key whose value differs between two config dicts, sorted; a key
    that one of them lacks counts only when it is in `explicit` (a key added to the command since the record was
    written, at its default, is no change the user made)."""
    if isinstance(old, dict) and isinstance(new, dict):
        found = []
        for key in sorted(set(old) | set(new)):
            dotted = f"{prefix}{key}"
            if (key not in old or key not in new) and not any(k == dotted or k.startswith(dotted + ".")
                                                              for k in explicit):  # fmt: skip
                continue
            found += differences(old.get(key), new.get(key), explicit, dotted + ".")
        return found
    return [] if old == new else [(prefix.rstrip("."), old, new)]


def moved_with(path: str | None, old_dir: str | None, new_dir: str | Path | None) -> str | None:
    """`path` as recorded by a run in `old_dir`, in `new_dir` when it was inside the run's folder (its created base
    model, its SFT result): a run folder moved or renamed (`mv outputs/a outputs/b`) is the same run, and its
    recorded model was refused as another one. Compared as written (both were written alike: relative or not)."""
    if path is None or old_dir is None or new_dir is None:
        return path
    inside = Path(path)
    if not inside.is_relative_to(old_dir):
        return path
    return str(Path(new_dir) / inside.relative_to(old_dir))


def same_model(a: str | None, b: str | None) -> bool:
    """Whether two model names are one model: equal, or two paths of one existing folder (a hub id is its name)."""
    if a == b:
        return True
    return a is not None and b is not None and Path(a).exists() and Path(a).resolve() == Path(b).resolve()


def sft_changes(old: dict, new: dict, explicit: set[str], in_progress: bool) -> list[tuple[str, Any, Any]]:
    """The keys in which SFT config `new` differs from the recorded `old` that shape the result: the base model
    (`model.name`, compared as a path) first, then every other key but the free ones (`SFT_FREE_KEYS`,
    `SFT_FREE_NESTED`, and how far it goes when `in_progress`: a half-done SFT is resumed, and may be taken further)."""
    old_model, new_model = (old.get("model") or {}).get("name"), (new.get("model") or {}).get("name")
    old_model = moved_with(old_model, old.get("output_dir"), new.get("output_dir"))
    found = [] if same_model(old_model, new_model) else [("model.name", old_model, new_model)]
    old, new = ({k: v for k, v in values.items()} for values in (old, new))
    for values in (old, new):
        for key in SFT_FREE_KEYS + (SFT_FREE_KEYS_IN_PROGRESS if in_progress else ()):
            values.pop(key, None)
        for section, keys in SFT_FREE_NESTED.items():  # model.name: compared above, as a path
            if isinstance(values.get(section), dict):
                values[section] = {k: v for k, v in values[section].items() if k not in keys}
    return found + differences(old, new, explicit)


def sft_refusal(changes: list[tuple[str, Any, Any]], what: str, way_out: str, prefix: str = "") -> str:
    """The error of a re-run refused for `changes` (`sft_changes`, not empty): the first key as the error's key,
    every changed key with its recorded and new value, and `way_out`. `prefix`: where the keys live in the
    command's own config (`sft.args.` under `gyre rl`); the base model is `model.name` in both."""

    def key_of(key: str) -> str:
        return key if key == "model.name" else f"{prefix}{key}"

    (key, was, now), more = changes[0], changes[1:]
    said = (f"was trained from {was}, not {now}" if key == "model.name" else f"was trained with {key} = {was!r}, "
            f"not {now!r}")  # fmt: skip
    also = "; ".join(f"{key_of(k)} = {w!r}, not {n!r}" for k, w, n in more)
    return f"config key '{key_of(key)}': {what} {said}" + (f" (also changed: {also})" if also else "") + f"; {way_out}"


# leaves of orchestrator.env (one table, or a mix's entry) a started run may change: an entry's group size, its eval
# settings and sampling.max_tokens, free as the orchestrator's own rollouts_per_example, eval.* and sampling.max_tokens
# are; and a mix's ratios (`env_changes`)
FREE_ENV_KEY = re.compile(r"(\.\d+)?\.(rollouts_per_example|sampling\.max_tokens|eval(\.\w+)?)")


def env_changes(recorded: Any, now: Any) -> list[tuple[str, Any, Any]]:
    """(".dotted.leaf", old, new) of every change between a started run's dumped `orchestrator.env` (`recorded`: one
    table or a mix's list) and the current one (`now`, dumped) that the run cannot absorb: its task position and the
    batches in its stream belong to the first environment. A mix's ratios stay free (PRIME-RL users reweight between
    launches): each entry keeps its task position, only the draws to come change (docs/orchestrator.md)."""
    from gyre.config.orchestrator import OrchestratorConfig

    changes = _section_changes(_as_now(OrchestratorConfig, "env", recorded), now)
    return [c for c in changes if not (isinstance(now, list) and c[0].endswith(".ratio"))
            and not FREE_ENV_KEY.fullmatch(c[0])]  # fmt: skip


def _section_changes(old: Any, new: Any, key: str = "") -> list[tuple[str, Any, Any]]:
    """(".dotted.key", old, new) of every leaf in which two dumped config sections differ (a table, or a list of
    tables: one environment or several). Tables of other keys differ as a whole: `old` is read through the current
    schema first (`_as_now`), so a setting added to gyre since holds its default there, and what remains is a
    free-form table (`args`) given other keys."""
    if isinstance(old, dict) and isinstance(new, dict) and set(old) == set(new):  # else: the whole table, as set
        return [c for k in sorted(old) for c in _section_changes(old[k], new[k], f"{key}.{k}")]
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [c for i, (a, b) in enumerate(zip(old, new, strict=True)) for c in _section_changes(a, b, f"{key}.{i}")]
    return [] if old == new else [(key, old, new)]


def _as_now(cls: type, field: str, recorded: Any) -> Any:
    """A section an earlier launch dumped (`recorded`), validated and dumped again by the current schema of `field` of
    `cls`: the keys added since get their defaults. As recorded when it no longer validates (its form changed)."""
    from pydantic import TypeAdapter, ValidationError

    adapter = TypeAdapter(cls.model_fields[field].annotation)
    try:
        return adapter.dump_python(adapter.validate_python(recorded), mode="json")
    except ValidationError:
        return recorded
