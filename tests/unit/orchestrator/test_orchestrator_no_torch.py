"""The orchestrator image has no torch: importing every orchestrator module must not pull it in."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gyre_orchestrator

# every module of the package, found (a hand-kept list had fallen seven modules behind)
MODULES = sorted(p.stem for p in Path(gyre_orchestrator.__file__).parent.glob("*.py") if p.stem != "__init__")


def test_orchestrator_modules_never_import_torch():
    code = (
        "import sys\n"
        + "".join(f"import gyre_orchestrator.{m}\n" for m in MODULES)
        + "import gyre.envs, gyre.envs.registry\n"
        + "from gyre.envs import load_environment\n"
        + "for name in ('reverse_text', 'arithmetic', 'alphabet_sort', 'calculator'): load_environment(name)\n"
        + "heavy = sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules)\n"
        + "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""
