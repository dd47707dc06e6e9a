"""A rewind (`resume_step = N`) is done once per service: a Kubernetes pod keeps its resume_step when it restarts."""

from __future__ import annotations

from gyre.runstate import forget_rewinds, mark_rewound, pending_rewind


def test_a_service_rewinds_once_per_request(tmp_path):
    folder = tmp_path / "checkpoints" / "trainer"
    assert pending_rewind(folder, 3) == 3  # never rewound: rewind
    mark_rewound(folder, 3)
    assert pending_rewind(folder, 3) is None  # restarted with the same step: resume where the run stands
    assert pending_rewind(folder, 2) == 2  # another step: a new rewind
    assert pending_rewind(folder, 3) is None  # (asking does not forget)
    for automatic in (None, -1):  # a start without a rewind forgets it: the same step set again rewinds again
        mark_rewound(folder, 3)
        assert pending_rewind(folder, automatic) == automatic
        assert pending_rewind(folder, 3) == 3
    mark_rewound(folder, 0)  # the base model is a step like any other
    assert pending_rewind(folder, 0) is None
    (folder / "rewound").write_text("junk")  # unreadable: rewind rather than go on from a state nobody asked for
    assert pending_rewind(folder, 0) == 0

    # `gyre rl --ckpt.resume-step N` is a new request each time: the launcher forgets both services' rewinds
    orchestrator = tmp_path / "checkpoints" / "orchestrator"
    mark_rewound(folder, 3)
    mark_rewound(orchestrator, 3)
    forget_rewinds(tmp_path)
    assert pending_rewind(folder, 3) == 3 and pending_rewind(orchestrator, 3) == 3
