"""`gyre.steps.StepEntries`: the one `step_{s}` helper of the weights, trainer-checkpoint and progress stores."""

from __future__ import annotations

import pytest
from gyre.steps import StepEntries, check_step


def test_folders_count_once_complete_and_are_retired_whole(tmp_path):
    entries = StepEntries(tmp_path, marker="DONE")
    for step in (1, 2, 3, 10):
        entries.path(step).mkdir()
        (entries.path(step) / "DONE").write_text("")
    (tmp_path / "step_4").mkdir()  # incomplete: no marker yet
    (tmp_path / ".tmp-step_5-x").mkdir()  # being written
    (tmp_path / "step_x").mkdir()
    assert entries.steps() == [1, 2, 3, 10] and entries.latest() == 10  # numeric order, not text order
    assert entries.discard_after(2) == [3, 10] and entries.steps() == [1, 2]
    assert entries.keep_only({2}) == [1] and entries.steps() == [2]
    assert not any(p.name.startswith(".tmp-delete") for p in tmp_path.iterdir())  # retired, then deleted
    assert (tmp_path / "step_4").is_dir()  # only complete entries are ever removed by retention


def test_files_with_a_suffix(tmp_path):
    entries = StepEntries(tmp_path / "progress", suffix=".json")
    assert entries.steps() == [] and entries.latest() is None  # no folder yet
    entries.root.mkdir()
    for step in (3, 1, 2):
        entries.path(step).write_text("{}")
    (entries.root / "step_9.json.tmp").write_text("")
    assert entries.steps() == [1, 2, 3] and entries.path(2).name == "step_2.json"
    assert entries.keep_only([2, 3]) == [1] and entries.steps() == [2, 3]


def test_bad_steps_and_shapes_are_refused(tmp_path):
    for bad in (-1, True, 1.0, "3"):
        with pytest.raises(ValueError, match="non-negative int"):
            check_step(bad)
    with pytest.raises(ValueError, match="folders with a marker"):
        StepEntries(tmp_path)
    with pytest.raises(ValueError, match="folders with a marker"):
        StepEntries(tmp_path, marker="DONE", suffix=".json")
