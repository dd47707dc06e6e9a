"""The committed gRPC code under libs/gyre/v1 must match proto/gyre/v1 (run `make proto` if not)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_up_to_date(tmp_path):
    env_py = sys.executable
    subprocess.run(
        ["bash", str(ROOT / "scripts/gen_proto.sh"), str(tmp_path)],
        check=True,
        cwd=ROOT,
        env={"PY": env_py, "PATH": "/usr/bin:/bin"},
    )
    committed = ROOT / "libs/gyre/v1"
    fresh = tmp_path / "gyre/v1"
    names = sorted(p.name for p in fresh.iterdir() if p.suffix in (".py", ".pyi"))
    assert names == sorted(p.name for p in committed.iterdir() if p.suffix in (".py", ".pyi"))
    for name in names:
        assert (fresh / name).read_text() == (committed / name).read_text(), f"{name} is stale: run `make proto`"


def test_services_and_methods_exist():
    from gyre.v1 import inference_pb2, orchestrator_pb2, trainer_pb2

    methods = {
        inference_pb2: ("InferenceControl", {"UpdateWeights", "ReloadWeights", "GetStatus"}),
        orchestrator_pb2: ("Orchestrator", {"NotifyWeights", "GetStatus"}),
        trainer_pb2: ("Trainer", {"GetStatus"}),
    }
    for module, (service, expected) in methods.items():
        desc = module.DESCRIPTOR.services_by_name[service]
        assert {m.name for m in desc.methods} == expected
        assert desc.full_name.startswith("gyre.v1.")
