"""What a config model's fields are, read from their annotations: the section model a field holds, the model of a
list's entries, every dotted key of a model, whether an option is a number or a list of plain values, and a type
as `--help` and error messages write it. Shared by the loader, its error messages and `--help`."""

from __future__ import annotations

import re
import types
import typing
from typing import Any

from pydantic import BaseModel

LIST_INDEX = "#"  # a list entry's index in all_keys: `runs.#.optim.lr`


def all_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key of `model`, its sections' and list entries' too (`runs.#.optim.lr`)."""
    keys = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        sub = section_model(field.annotation)
        if sub is not None:
            keys += all_keys(sub, prefix + name + ".")
        # a list of tables, or (orchestrator.env) a table or a list of them: `env.name` and `env.#.name`
        if (entry := list_entry_model(field.annotation)) is not None:
            keys += all_keys(entry, f"{prefix}{name}.{LIST_INDEX}.")
    return keys


def unannotated(annotation: Any) -> Any:
    """`annotation` without its `Annotated[...]` metadata (a tagged union's members: `Annotated[Model, Tag(...)]`)."""
    return typing.get_args(annotation)[0] if typing.get_origin(annotation) is typing.Annotated else annotation


def section_model(annotation: Any) -> type[BaseModel] | None:
    """The model of a section field (also optional, or a union's member); None for any other type."""
    annotation = unannotated(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in map(unannotated, typing.get_args(annotation)):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                return arg
    return None


def list_entry_model(annotation: Any) -> type[BaseModel] | None:
    """The model of a `list[Model]` option's entries, also as a union's member (None for any other type)."""
    annotation = unannotated(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return next(filter(None, map(list_entry_model, typing.get_args(annotation))), None)
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation) or (None,)
        item = unannotated(item)
        return item if isinstance(item, type) and issubclass(item, BaseModel) else None
    return None


def number_only(annotation: Any) -> bool:
    """An int or float key (also optional, or one of several number types), never a bool one."""
    annotation = unannotated(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kinds = [arg for arg in map(unannotated, typing.get_args(annotation)) if arg is not type(None)]
    else:
        kinds = [annotation]
    return bool(kinds) and all(kind in (int, float) for kind in kinds)


def plain_list(annotation: Any) -> bool:
    """Whether `annotation` is a list of plain values (`list[str]`, optional or not), not of tables or lists."""
    for arg in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(arg) is list:
            (item,) = typing.get_args(arg) or (Any,)
            nested = {item, typing.get_origin(item)} & {list, dict}
            return section_model(item) is None and not nested
    return False


def option_type(model: type[BaseModel] | None, dotted: str, sections: bool = False) -> Any:
    """The type of option `--dotted` of `model`: its section's model, else its annotation; None for no such key.
    With `sections`, through the models `model`'s free-form sections are validated as (`gyre rl`'s [trainer])."""
    node: Any = model
    walked: list[str] = []
    for part in dotted.replace("-", "_").split("."):
        target = getattr(model, "section_models", {}).get(".".join(walked)) if sections and walked else None
        node = import_config_model(target) if target else node
        walked.append(part)
        field = node.model_fields.get(part) if isinstance(node, type) and issubclass(node, BaseModel) else None
        if field is None:
            return None
        node = section_model(field.annotation) or field.annotation
    return node


def import_config_model(target: str) -> type[BaseModel]:
    """The config class a `"module:attribute"` names (`section_models`, `reads_sections_of`)."""
    from gyre.imports import load_callable  # a config class is a callable: one importer of "module:attribute"

    return load_callable(target, "config model")


def type_name(annotation: Any) -> str:
    """`annotation` as `--help` and an error message write it: `int | None`, `list[JudgeConfig]`."""
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or str(annotation).replace("typing.", "")
    # module paths are noise in --help: `pydantic.types.SecretStr | None`, `list[gyre.config.endpoint.JudgeConfig]`
    return re.sub(r"\b(?:[a-z_][a-z0-9_]*\.)+(?=[A-Z])", "", text).replace("NoneType", "None")
