"""The engine's default thread count follows the container's CPU quota, not the node's core count."""

from __future__ import annotations

import os

import pytest
from gyre_inference.cpus import cgroup_cpu_limit, default_engine_threads, usable_cpus

VISIBLE = len(os.sched_getaffinity(0))


def test_cgroup_v2_quota(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit(tmp_path) == 1.5
    assert usable_cpus(tmp_path) == min(VISIBLE, 2)  # 1.5 CPUs of quota can keep 2 threads busy in turns


def test_cgroup_v1_quota(tmp_path):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(tmp_path) == 1.0 and usable_cpus(tmp_path) == 1


@pytest.mark.parametrize("content", ["max 100000\n", None])
def test_no_quota_means_the_cpus_this_process_may_run_on(tmp_path, content):
    if content is not None:
        (tmp_path / "cpu.max").write_text(content)
    assert cgroup_cpu_limit(tmp_path) is None and usable_cpus(tmp_path) == VISIBLE


def test_v1_unlimited_and_garbage_fall_back_to_affinity(tmp_path):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cpus(tmp_path) == VISIBLE
    (tmp_path / "cpu.max").write_text("lots\n")
    assert usable_cpus(tmp_path) == VISIBLE


def test_the_default_leaves_a_core_for_the_http_loop(tmp_path):
    (tmp_path / "cpu.max").write_text("64000000 100000\n")  # 640 CPUs of quota: affinity decides
    assert default_engine_threads(tmp_path) == max(1, VISIBLE - 1)
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # half a CPU: still one thread
    assert default_engine_threads(tmp_path) == 1
