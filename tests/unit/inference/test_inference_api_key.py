"""`ServerKey`: the previous key's grace after a rotation, the periodic re-read that retires it, unreadable files."""

from __future__ import annotations

from gyre_inference.api_key import ServerKey


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_previous_key_is_accepted_for_the_grace_only_and_a_fixed_key_is_never_reread():
    clock, file = Clock(), {"key": "old"}
    key = ServerKey("old", lambda: file["key"], grace_s=60, reread_s=5, clock=clock)
    assert key.accepts("Bearer old") and not key.accepts("Bearer new") and not key.accepts("old")
    file["key"] = "new"
    clock.now = 1.0  # before the periodic re-read: only a request with another key reads the file
    assert key.accepts("Bearer old")
    assert key.accepts("Bearer new") and key.accepts("Bearer old")
    clock.now = 60.9
    assert key.accepts("Bearer old")
    clock.now = 61.1
    assert not key.accepts("Bearer old") and key.accepts("Bearer new")

    fixed = ServerKey("only")
    assert fixed.accepts("Bearer only") and not fixed.accepts("Bearer other")


def test_the_periodic_reread_starts_the_grace_without_the_new_key_being_presented():
    clock, file = Clock(), {"key": "old"}
    key = ServerKey("old", lambda: file["key"], grace_s=60, reread_s=5, clock=clock)
    file["key"] = "new"
    clock.now = 6.0
    assert key.accepts("Bearer old")  # this request re-reads: rotated, "old" in its grace
    clock.now = 70.0
    assert not key.accepts("Bearer old")


def test_an_unreadable_file_keeps_the_key_in_force(caplog):
    def gone():
        raise ValueError("api_key_file = '/secrets/api-key': cannot read the file (No such file or directory)")

    key = ServerKey("old", gone, reread_s=0)
    for _ in range(3):
        assert key.accepts("Bearer old") and not key.accepts("Bearer x")
    assert [r.getMessage() for r in caplog.records].count(
        "auth.api_key: api_key_file = '/secrets/api-key': cannot read the file (No such file or directory); "
        "still asking for the key read before") == 1  # fmt: skip
