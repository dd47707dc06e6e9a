"""A stand-alone `gyre sft` re-run on a folder holding an SFT (finished, or stopped half way with checkpoints) with
other data or training settings: refused before anything loads, naming every changed key and the way out, as `gyre
rl` refuses for its warm-up. It resumed the old checkpoint (or said "already finished") and silently mixed two
configs into one result."""

from __future__ import annotations

import pytest
from gyre.events import read_events
from gyre_trainer import sft
from gyre_trainer.sft_checks import RESULT_MARKER

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("isolated_torch_state")]

COMMON = {"device": "cpu", "data.env": "reverse_text", "data.num-examples": 40, "data.seq-len": 64,
          "data.batch-size": 4, "data.micro-batch-size": 2, "ckpt.interval": 1}  # fmt: skip


def args(model, out, **extra) -> list[str]:
    opts = {"model.name": model, "output-dir": out, **COMMON, **extra}
    return [x for key, value in opts.items() for x in (f"--{key}", str(value))]


def steps(out) -> int:
    return len(read_events(out / "events" / sft.SFT_STEPS))


def test_a_rerun_with_other_settings_is_refused_naming_the_keys(tiny_model, tmp_path, capsys):
    assert sft.main(args(tiny_model, tmp_path, **{"max-steps": 2})) == 0
    marker = (tmp_path / "sft" / RESULT_MARKER).read_text()
    capsys.readouterr()
    other_data = {"data.env": "arithmetic", "data.seq-len": 128}
    for extra in ({"max-steps": 2}, {"max-steps": 3}):  # found finished; continued from its checkpoint
        assert sft.main(args(tiny_model, tmp_path, **extra, **other_data)) == 2
        err = capsys.readouterr().err
        assert (
            err.startswith("gyre sft: error: config key 'data.env': the SFT in ")
            and "'reverse_text', not 'arithmetic'" in err
            and "data.seq_len = 64, not 128" in err
        ), err
        assert "--ckpt.resume-step 0" in err and "--output-dir" in err and "Traceback" not in err
        assert steps(tmp_path) == 2 and (tmp_path / "sft" / RESULT_MARKER).read_text() == marker

    # stopped half way (no result yet, its checkpoints): resumed, so the same holds, but for how far it goes
    (tmp_path / "sft").rename(tmp_path / "first")
    assert sft.main(args(tiny_model, tmp_path, **{"max-steps": 3, "optim.lr": 0.5, "seed": 1})) == 2
    err = capsys.readouterr().err
    assert "config key 'optim.lr'" in err and "stopped half way" in err and "seed = 0, not 1" in err, err
    # free keys: how a step is computed is not what it computes (a smaller micro batch: the fix for an out-of-memory
    # error, which was refused the checkpoint it would resume from)
    free = {"log.level": "DEBUG", "data.micro-batch-size": 1, "model.attn-implementation": "eager", "device": "auto"}
    assert sft.main(args(tiny_model, tmp_path, **{"max-steps": 3, **free})) == 0
    assert steps(tmp_path) == 3

    # the way out: trained again from model.name with the new settings (which the next re-run compares with)
    assert sft.main(args(tiny_model, tmp_path, **{"max-steps": 1, "ckpt.resume-step": 0}, **other_data)) == 0
    capsys.readouterr()
    assert sft.main(args(tiny_model, tmp_path, **{"max-steps": 1}, **other_data)) == 0
    assert "already finished" in capsys.readouterr().out
