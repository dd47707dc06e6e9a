"""`gyre_trainer.torchrun` turns torchrun's SignalException into exit 0 only when every local worker reported 0."""

from __future__ import annotations

import json

import pytest
from gyre_trainer.torchrun import STATUS_ENV, clean_stop, report_exit


def reported(tmp_path, monkeypatch, codes: dict[int, int], local_world_size: int) -> bool:
    monkeypatch.setenv(STATUS_ENV, str(tmp_path))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world_size))
    for rank, code in codes.items():
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        report_exit(code)
    return clean_stop(tmp_path)


@pytest.mark.parametrize(
    ("codes", "clean"),
    [
        ({0: 0, 1: 0}, True),
        ({0: 0, 1: 1}, False),  # a worker failed
        ({0: 0}, False),  # a worker never reported: killed at the shutdown timeout, or not started yet
        ({}, False),  # the signal came before any worker ran (the rendezvous)
    ],
)
def test_a_stop_is_clean_only_when_every_local_worker_exited_0(tmp_path, monkeypatch, codes, clean):
    assert reported(tmp_path, monkeypatch, codes, 2) is clean


def test_outside_the_launcher_a_worker_reports_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(STATUS_ENV, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    report_exit(0)
    assert list(tmp_path.iterdir()) == []


def test_an_unreadable_status_is_not_clean(tmp_path):
    (tmp_path / "local_rank_0.json").write_text("{")
    assert not clean_stop(tmp_path)
    (tmp_path / "local_rank_0.json").write_text(json.dumps({"code": 0, "local_world_size": 1}))
    assert clean_stop(tmp_path)
