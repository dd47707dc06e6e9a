"""How a config mistake is explained: ConfigError, the message of a failed validation (the unknown key with the one
meant: near misses, synonyms from other frameworks, PRIME-RL's keys that Gyre has elsewhere), GYRE_ environment
variables that are no key, and a section's error written under the larger config (`gyre rl`'s [trainer])."""

from __future__ import annotations

import difflib
import json
import re
import typing

from pydantic import BaseModel, ValidationError

from gyre.config.fields import LIST_INDEX, all_keys, import_config_model


class ConfigError(ValueError):
    """A config source or value is invalid; the message names the key."""


def under_section(error: ConfigError, section: str) -> ConfigError:
    """`error` of a section's own config (`gyre rl`'s [trainer], sft.args) with every key it names, the
    suggested ones too, written as the larger config's key (`optim.lr` -> `trainer.optim.lr`)."""
    text = str(error).replace("config key '", f"config key '{section}.")
    text = re.sub(r"(PRIME-RL's [\w.]+ is ')", rf"\g<1>{section}.", text)  # `_prime_rl_key`'s answer
    text = re.sub(
        r"; '([\w.]+)' is one table here, not a list: drop the index \(e.g. '",
        rf"; '{section}.\g<1>' is one table here, not a list: drop the index (e.g. '{section}.",
        text,
    )

    def each(meant: re.Match) -> str:  # every key of "did you mean 'a' or 'b'?" (the second was left unprefixed)
        return "did you mean '" + "' or '".join(f"{section}.{key}" for key in meant.group(1).split("' or '")) + "'?"

    return ConfigError(re.sub(r"did you mean '(.*?)'\?", each, text))


# Names other frameworks (PRIME-RL, verl, TRL) give a key that Gyre names otherwise, in the same section (a tuple: the
# keys it stands for): a near miss by spelling finds the rest (async_level -> max_async_level). A synonym goes before a
# near miss, which can be another key: verl's clip_ratio_low was "did you mean 'loss.clip_ratio_c'?" (the dual clip).
KEY_SYNONYMS: dict[str, str | tuple[str, ...]] = {
    "id": "name", "env_id": "name", "learning_rate": "lr", "max_norm": "max_grad_norm", "num_steps": "max_steps",
    "total_steps": "max_steps", "max_new_tokens": "max_tokens", "max_num_seqs": "max_batch_size",
    # verl's actor keys (docs/trainer.md, "Coming from verl or PRIME-RL")
    "clip_ratio_low": "eps_low", "clip_ratio_high": "eps_high", "clip_ratio": ("eps_low", "eps_high"),
    "loss_agg_mode": "aggregation", "kl_loss_coef": "ref_kl_coef", "kl_loss_type": "ref_kl_estimator",
    "grad_clip": "max_grad_norm", "clip_grad": "max_grad_norm", "lr_warmup_steps": "warmup_steps",
    "warmup_style": "scheduler", "lr_scheduler_type": "scheduler",
}  # fmt: skip


def _synonyms(leaf: str) -> tuple[str, ...]:
    meant = KEY_SYNONYMS.get(leaf, ())
    return (meant,) if isinstance(meant, str) else meant


# PRIME-RL keys that Gyre has in another place or shape (docs/local.md, "Coming from PRIME-RL"), by their dotted tail
# in the config an unknown key was found in: (the key to write, found among the config's keys; what it is).
PRIME_RL_KEYS = {
    "wandb.name": ("run_id", "one W&B run per service, named {run_id}-{service}; wandb.group groups them"),
    "client": ("inference.urls", "client.base_url; the table's other keys are beside it: api_key_file, timeout_s"),
    "client.base_url": ("inference.urls", "the servers' root or /v1 URLs, a list"),
    "client.timeout": ("inference.timeout_s", "one request's timeout"),
    "model.lora": ("lora", "the trainer's LoRA adapter: rank, alpha, dropout, target_modules"),
    "clean": (
        "fresh",
        "it deletes the previous run in output_dir first; without it the same command continues "
        "that run, where PRIME-RL's rl cleaned by default",
    ),
}


# what other tools call their config file option: `--config x.toml` was "unknown key" alone
CONFIG_FILE_KEYS = ("config", "config_file", "config_path", "configs")


def _prime_rl_key(key: str, known: list[str]) -> str | None:
    """What to write for PRIME-RL's `key` (an unknown dotted key of a config whose keys are `known`), or None."""
    parts = key.split(".")
    for start in range(len(parts)):
        tail = ".".join(parts[start:])
        if tail not in PRIME_RL_KEYS:
            continue
        target, what = PRIME_RL_KEYS[tail]
        where = ".".join(parts[:start])
        # the one in the key's own section, else the shallowest anywhere (gyre rl: orchestrator.inference.urls)
        found = sorted((k for k in known if k == target or k.endswith(f".{target}")),
                       key=lambda k: (k != f"{where}.{target}", k.count(".")))  # fmt: skip
        if found:
            return f"PRIME-RL's {tail} is '{found[0]}' here ({what})"
    return None


def _suggestion(key: str, known: list[str]) -> tuple[str | None, str]:
    """(the known key `key` most likely means, else None; else a listing of its section's keys, or ""), for an
    unknown `key`. In order: a near miss in its own section (or a synonym, KEY_SYNONYMS), a near miss of the whole
    dotted key that is not a section holding it (`orchestrator.env.id` was "did you mean 'orchestrator.env'?"), the
    same name in another section (a key set in the wrong place: a top-level `seq_len`), else the section's keys."""
    parent, _, leaf = key.rpartition(".")
    prefix = f"{parent}." if parent else ""
    siblings = [k[len(prefix) :] for k in known if k.startswith(prefix) and "." not in k[len(prefix) :]]
    if leaf.isdigit() and parent and siblings:
        # PRIME-RL's `--orchestrator.env.0.args.x` (its env is always a list) on a single [orchestrator.env] table:
        # "env has: name, args, ..." did not say that the index was the mistake
        return None, (f"; '{parent}' is one table here, not a list: drop the index (e.g. '{parent}.{siblings[0]}'), "
                      "or give it as a list of tables ([[...]] entries) to index them")  # fmt: skip
    meant = [prefix + name for name in _synonyms(leaf) if name in siblings]
    if meant:
        return "' or '".join(meant), ""
    near = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.7)
    if near:
        return prefix + near[0], ""
    # not a sibling (their common prefix made `wandb.name` "mean" 'wandb.mode'), nor a section holding the key
    close = [k for k in difflib.get_close_matches(key, known, n=3)
             if not key.startswith(k + ".") and k.rpartition(".")[0] != parent]  # fmt: skip
    if close:
        return close[0], ""
    if not parent or not siblings:  # a top-level key or one under no section: maybe set in the wrong place
        leaves = {k: k.rpartition(".")[2] for k in known if LIST_INDEX not in k}
        same = [k for k, name in leaves.items() if name in (leaf, *_synonyms(leaf))]
        near = difflib.get_close_matches(leaf, set(leaves.values()), n=1, cutoff=0.8)
        same = same or [k for k, name in leaves.items() if near and name == near[0]]
        if same:
            depth = min(k.count(".") for k in same)  # the shallowest: `server.port` and `metrics.port` for a `port`
            return "' or '".join([k for k in same if k.count(".") == depth][:3]), ""
    if parent and 0 < len(siblings) <= 12:
        return None, f"; {parent} has: {', '.join(siblings)}"
    return None, ""


def _section_keys(cls: type[BaseModel]) -> list[str]:
    """The keys of `cls`'s free-form sections that another model validates (`gyre rl`'s [trainer] is a
    `gyre trainer` config: `section_models`), prefixed: a key set at the wrong level is suggested where it lives."""
    keys = []
    for name, target in getattr(cls, "section_models", {}).items():
        keys += all_keys(import_config_model(target), f"{name}.")
    return keys


def format_validation_error(cls: type[BaseModel], err: ValidationError) -> str:
    lines = []
    known = all_keys(cls)
    moved: dict[str, str] = getattr(cls, "moved_keys", {})  # old dotted key -> the key that replaced it
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        # a validator's own reason needs no "Value error, " before it (pydantic's wrapping, noise to a user)
        msg = e["msg"].removeprefix("Value error, ") if e["type"] == "value_error" and e["loc"] else e["msg"]
        if e["type"] == "extra_forbidden" and key in moved:
            # "config key" twice: a caller prefixing keys (gyre rl: "inference.") prefixes the new one too
            msg = f"this key was removed; set config key {moved[key]!r} instead"
        elif e["type"] == "extra_forbidden":
            # matched with its list indices as in `known` (`runs.0.optim.lrr` once got 'optim.lr'), then put back
            indices = [str(p) for p in e["loc"] if isinstance(p, int)]
            generic = ".".join(LIST_INDEX if isinstance(p, int) else str(p) for p in e["loc"])
            close, listing = _suggestion(generic, known + _section_keys(cls))
            if close and close.count(LIST_INDEX) == len(indices):
                parts = close.split(LIST_INDEX)
                close = "".join(part + index for part, index in zip(parts, [*indices, ""], strict=True))
            elif close:
                close = None
            msg = "unknown key" + (f" (did you mean '{close}'?)" if close else listing)  # close: "a' or 'b" too
            if not close and (prime := _prime_rl_key(generic, known + _section_keys(cls))):
                msg = f"unknown key; {prime}"  # its listing named no key of it (wandb has: enabled, project...)
            if generic in CONFIG_FILE_KEYS:  # `--config x.toml` (other tools' habit) said no more, or 'log.file'
                msg = "unknown key; a config file is read with '@': @ x.toml (several merge left to right)"
        elif not e["loc"] and e["type"] == "value_error":
            # a check across keys (a model validator) says "some.key: why": name that key as field errors do
            name, sep, why = msg.removeprefix("Value error, ").partition(": ")
            generic = ".".join(LIST_INDEX if part.isdigit() else part for part in name.split("."))
            if sep and (name in known or generic in known):  # a list entry's key too (`env.1.rollouts_per_example`)
                key, msg = name, why
        elif e["type"] == "value_error" and not isinstance(e.get("input"), str | int | float | bool | None):
            msg = msg.removeprefix("Value error, ")  # the reason says it; a list or table input repeated is noise
        elif e["type"] == "list_type" and isinstance(e.get("input"), dict):
            # `--servers.0.model x`: dotted options build tables, never list entries; say how a list is written
            msg += f"; dotted options set table keys, not list entries: set the whole list, --{key} '[...]' (JSON)"
        elif "input" in e and not isinstance(e["input"], dict):
            msg += f" (got {e['input']!r})"
            if e["type"] == "list_type" and isinstance(e["input"], str):  # `--inference.urls URL`
                listed = json.dumps([e["input"]])
                msg += f"; write a list: {key.rpartition('.')[2]} = {listed} in TOML, --{key} '{listed}' as an option"
        lines.append(f"config key {key!r}: {msg}")
    return "\n".join(lines)


ENV_PREFIX = "GYRE_"


def check_environment_keys(cls: type[BaseModel], environ: typing.Mapping[str, str]) -> None:
    """ConfigError naming the variable for a `GYRE_...` environment variable that looks like a key of `cls` but
    is none: pydantic-settings reads only the variables that match a field, so `GYRE_MAX_STEPZ=3` or
    `GYRE_TRAINER_OPTIM__LR=1e-4` (one `_` too few) were silently ignored and the run went on with the defaults.
    Looks like a key: it has the nested delimiter `__` (only config keys have it) or is a near miss of a
    top-level key. Other `GYRE_` variables (`GYRE_CACHE_DIR`, a user's `GYRE_API_KEY`) are not config keys."""
    fields = list(cls.model_fields)
    for name in sorted(environ):
        if not name.upper().startswith(ENV_PREFIX):
            continue
        key = name[len(ENV_PREFIX) :].lower()
        head = key.split("__")[0]
        if head in fields:
            continue  # a key (a typo below it is the section's own "unknown key" error)
        near = difflib.get_close_matches(head, fields, n=1, cutoff=0.85)
        if "__" not in key and not near:
            # gyre rl: a key of one of its sections set at top level (GYRE_SEQ_LEN, as PRIME-RL's shared seq_len) was
            # not a config key, and ignored; an exact name only (GYRE_CACHE_DIR is no key anywhere), and no secret (a
            # user's own GYRE_API_KEY is not inference.auth.api_key)
            keys = _section_keys(cls)
            placed = [k for k in keys if k.rpartition(".")[2] == key and LIST_INDEX not in k]
            placed = [k for k in placed if f"{k}_file" not in keys]
            if placed:
                where = min(placed, key=lambda k: k.count("."))
                raise ConfigError(
                    f"config key {key!r}: unknown key, set by the environment variable {name} (did you mean "
                    f"{ENV_PREFIX}{where.upper().replace('.', '__')}?); nested keys are written "
                    f"{ENV_PREFIX}SECTION__KEY"
                )
            continue
        # the nearest top-level key, else `trainer_optim__lr`: a key's `__` written as `_`
        split = next((f for f in fields if head.startswith(f + "_")), None)
        guess = near[0] + key[len(head) :] if near else f"{split}__{key[len(split) + 1 :]}" if split else None
        hint = f" (did you mean {ENV_PREFIX}{guess.upper()}?)" if guess else ""
        dotted = key.replace("__", ".")
        raise ConfigError(
            f"config key {dotted!r}: unknown key, set by the environment variable {name}{hint}; nested keys are "
            f"written {ENV_PREFIX}SECTION__KEY"
        )


def name_environment_variables(message: str, environ: typing.Mapping[str, str]) -> str:
    """`message` with each `config key 'a.b'` line that an environment variable `GYRE_A__B` sets saying so: a typo
    below a section (`GYRE_TRAINER__OPTIM__LRR`) is the section's own "unknown key" error, which named the key alone,
    and the user looked for it in their command line and files."""
    names = {name.upper(): name for name in environ if name.upper().startswith(ENV_PREFIX)}

    def named(line: str) -> str:
        found = re.match(r"config key '([\w.]+)'", line)
        var = names.get(ENV_PREFIX + found.group(1).replace(".", "__").upper()) if found else None
        return f"{line} (set by the environment variable {var})" if var and var not in line else line

    return "\n".join(named(line) for line in message.split("\n"))
