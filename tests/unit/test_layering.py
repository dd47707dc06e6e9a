"""The layering rule of docs/architecture.md, read from the source (every import, also those inside functions):

- a service imports `gyre` and never another service;
- `gyre` (libs/gyre) never imports a service;
- no import circle inside `gyre` or inside any service package (two modules that import each other, even
  lazily, are one concept in two homes).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "gyre": ROOT / "libs" / "gyre",
    "gyre_inference": ROOT / "services" / "inference" / "gyre_inference",
    "gyre_orchestrator": ROOT / "services" / "orchestrator" / "gyre_orchestrator",
    "gyre_trainer": ROOT / "services" / "trainer" / "gyre_trainer",
}
SERVICES = [name for name in PACKAGES if name != "gyre"]
GENERATED = {"gyre.v1"}  # protoc's output imports itself; not ours to shape


def modules(package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module of `package`."""
    root = PACKAGES[package]
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if not any(name == g or name.startswith(g + ".") for g in GENERATED):
            found[name] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every module `name` imports (absolute names; `from pkg import sub` counts `pkg.sub` when it is a module)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against this module's package
                base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in known)
    return found


def graph(package: str) -> dict[str, set[str]]:
    mods = modules(package)
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def top(module: str) -> str:
    return module.split(".")[0]


@pytest.mark.parametrize("package", list(PACKAGES))
def test_no_package_imports_a_service_other_than_itself(package):
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in graph(package).items()
        for target in targets
        if top(target) in SERVICES and top(target) != package
    )
    assert not wrong, "services import gyre, never another service; gyre imports no service:\n" + "\n".join(wrong)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in edges:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("package", list(PACKAGES))
def test_no_import_circle_inside_a_package(package):
    # a package's __init__ (re-exporting its modules) is not a concept of its own: only module -> module edges
    inits = {name for name, path in modules(package).items() if path.name == "__init__.py"}
    edges = {m: {t for t in ts if t != m and t not in inits} for m, ts in graph(package).items() if m not in inits}
    assert cycles(edges) == [], f"modules of {package} that import each other (directly or around a circle)"


def test_the_checker_sees_a_circle_and_a_lazy_import(tmp_path):
    """The rule's own check: a lazy (function-level) import counts, and a two-module circle is found."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("import os\n\ndef f():\n    from pkg import b\n")
    b.write_text("from pkg.a import f\n")
    edges = {"pkg.a": imports("pkg.a", a, {"pkg.a", "pkg.b"}), "pkg.b": imports("pkg.b", b, {"pkg.a", "pkg.b"})}
    assert edges == {"pkg.a": {"os", "pkg", "pkg.b"}, "pkg.b": {"pkg.a"}}
    assert cycles(edges) == [["pkg.a", "pkg.b"]]


def test_the_trainers_crash_points_are_written_once():
    """The commit order exactly-once rests on lives in one module (`gyre_trainer.run.RunState`), shared by the
    single-run and the multi-run trainer: every crash point between the commits is called there, once each.
    The points inside a write (files on disk, folder not committed) are in the writers: the checkpoint's one,
    and one in each of the two publishes (full weights, LoRA adapter); the one inside the optimizer step is an
    optimizer hook (`process.crash_in_optimizer_step`)."""
    calls = {}
    for module, path in modules("gyre_trainer").items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "crash_point":
                calls.setdefault(module, []).append(node.args[0].value)
    points = ["after_ack", "after_checkpoint", "after_log", "after_publish", "after_train"]
    assert {module: sorted(names) for module, names in calls.items()} == {
        "gyre_trainer.run": points,
        "gyre_trainer.checkpoint": ["mid_checkpoint"],
        "gyre_trainer.publish": ["mid_publish", "mid_publish"],
        "gyre_trainer.process": ["mid_step"],
    }


def test_services_build_redis_clients_from_the_config():
    """`RedisConfig.client()` carries `redis.password`; a client made from the URL alone does not (a multi-run
    trainer did that and could not read a password-protected Redis)."""
    wrong = [f"{m}" for s in SERVICES for m, p in modules(s).items() if "Redis.from_url" in p.read_text()]
    assert wrong == []
