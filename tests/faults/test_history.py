"""The history checker itself, fed hand-made histories: it must report each kind
of violation (so the scenarios that rely on it can fail), and accept the
histories a correct fenced lock produces, including its expected takeovers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.faults.history import KINDS, check, load

LOCK = "counter"


def acquire(proc: str, token: int, t0: float, t1: float, lease: float | None = 1.0) -> dict:
    return {"kind": "acquire", "proc": proc, "lock": LOCK, "token": token,
            "t0": t0, "t1": t1, "lease": lease}  # fmt: skip


def write(proc: str, token: int, t0: float, t1: float, *, accepted: bool = True,
          op: str = "increment", value: int | None = None) -> dict:  # fmt: skip
    return {"kind": "write", "proc": proc, "lock": LOCK, "token": token, "t0": t0, "t1": t1,
            "op": op, "accepted": accepted, "value": value}  # fmt: skip


def release(proc: str, token: int, t0: float, t1: float, ok: bool | None = True) -> dict:
    return {"kind": "release", "proc": proc, "lock": LOCK, "token": token,
            "t0": t0, "t1": t1, "ok": ok}  # fmt: skip


def renew(proc: str, token: int, t0: float, t1: float) -> dict:
    return {"kind": "renew", "proc": proc, "lock": LOCK, "token": token, "t0": t0, "t1": t1}


def lost(proc: str, token: int, t: float) -> dict:
    return {"kind": "lost", "proc": proc, "lock": LOCK, "token": token, "t": t}


def fault(what: str, t0: float, t1: float, ends_leases: bool = True) -> dict:
    return {"kind": "fault", "what": what, "t0": t0, "t1": t1, "ends_leases": ends_leases}


def holder(proc: str, token: int, start: float, value: int) -> list[dict]:
    """A well-behaved round: acquire, claim, increment, release, 0.1 s in all."""
    return [
        acquire(proc, token, start, start + 0.01),
        write(proc, token, start + 0.02, start + 0.03, op="claim"),
        write(proc, token, start + 0.04, start + 0.05, value=value),
        release(proc, token, start + 0.06, start + 0.07),
    ]


def takeover_after_a_pause() -> list[dict]:
    """A pauses past its lease; B gets the lock and claims the row; A's late write is
    rejected; A's release finds the lock gone and A learns it lost it."""
    return [
        acquire("a", 10, 0.0, 0.01),
        write("a", 10, 0.02, 0.03, op="claim"),
        # ...A is paused here for 3 s; its 1 s lease runs out at 1.0 at the latest.
        acquire("b", 11, 1.1, 1.2),
        write("b", 11, 1.21, 1.22, op="claim"),
        write("b", 11, 1.23, 1.24, value=1),
        write("a", 10, 3.0, 3.01, accepted=False, value=1),
        release("a", 10, 3.02, 3.03, ok=False),
        lost("a", 10, 3.03),
        release("b", 11, 1.3, 1.31),
    ]


def test_clean_history_has_no_violation() -> None:
    events = holder("a", 1, 0.0, 1) + holder("b", 2, 0.2, 2) + holder("a", 3, 0.4, 3)
    report = check(events, final=3)
    assert report.violations == []
    assert (report.acquisitions, report.increments, report.ops) == (3, 3, 12)
    assert report.takeovers == 0


def test_expired_lease_takeover_is_allowed_and_counted() -> None:
    report = check(takeover_after_a_pause(), final=1)
    assert report.violations == []
    assert report.takeovers == 1
    assert report.rejected_writes == 1


def test_overlap_within_the_lease_is_reported() -> None:
    events = takeover_after_a_pause()
    events[2] = acquire("b", 11, 0.5, 0.6)  # granted before A's lease could end
    assert check(events, final=1).kinds == {"overlap"}


def test_overlap_after_a_renewal_is_reported() -> None:
    # Granted after the original lease, but within the one a renewal extended.
    events = [*takeover_after_a_pause(), renew("a", 10, 0.4, 0.41)]
    report = check(events, final=1)
    assert report.kinds == {"overlap"}
    assert "valid until 1.395" in str(report.violations[0])


def test_overlap_before_a_successful_release_is_reported() -> None:
    events = holder("a", 1, 0.0, 1)
    events[-1] = release("a", 1, 5.0, 5.01, ok=True)  # A held it all along
    events += holder("b", 2, 2.0, 2)
    assert check(events, final=2).kinds == {"overlap"}


def test_overlap_on_a_lease_without_expiry_is_reported() -> None:
    # PostgreSQL: no lease length; a renewal confirmed the lock at 2.0 or later.
    events = [
        acquire("a", 1, 0.0, 0.01, lease=None),
        renew("a", 1, 2.0, 2.01),
        acquire("b", 2, 1.0, 1.1, lease=None),
    ]
    assert check(events).kinds == {"overlap"}


def test_a_fault_that_ends_leases_excuses_the_overlap() -> None:
    events = takeover_after_a_pause()
    events[2] = acquire("b", 11, 0.5, 0.6)
    events.append(fault("redis restart", 0.3, 0.4))
    assert check(events, final=1).violations == []
    # A fault that does not end leases (added latency, say) excuses nothing.
    events[-1] = fault("latency", 0.3, 0.4, ends_leases=False)
    assert check(events, final=1).kinds == {"overlap"}


def test_lower_token_after_a_grant_is_reported() -> None:
    events = [*holder("a", 5, 0.0, 1), acquire("b", 4, 0.2, 0.21)]
    assert check(events, final=1).kinds == {"token-order"}


def test_same_token_twice_is_reported() -> None:
    events = holder("a", 5, 0.0, 1) + holder("b", 5, 0.2, 2)
    assert "token-reuse" in check(events, final=2).kinds
    # Also when the two grants may have been concurrent, or by one process.
    concurrent = [acquire("a", 7, 0.0, 1.0), acquire("b", 7, 0.5, 0.6)]
    assert "token-reuse" in check(concurrent).kinds
    again = [acquire("a", 7, 0.0, 0.1), acquire("a", 7, 3.0, 3.1)]
    assert check(again).kinds == {"token-reuse"}


def test_stale_write_accepted_is_reported() -> None:
    events = takeover_after_a_pause()
    events[5] = write("a", 10, 3.0, 3.01, accepted=True, value=2)
    report = check(events, final=2)
    assert report.kinds == {"stale-write"}
    assert "token 10 was accepted after" in str(report.violations[0])


def test_lost_update_by_count_is_reported() -> None:
    events = holder("a", 1, 0.0, 1) + holder("b", 2, 0.2, 2)
    assert check(events, final=1).kinds == {"lost-update"}
    assert check(events, final=2).violations == []


def test_lost_update_by_duplicate_values_is_reported() -> None:
    events = holder("a", 1, 0.0, 1) + holder("b", 2, 0.2, 1)
    report = check(events)  # no final value: the duplicate alone gives it away
    assert report.kinds == {"lost-update"}
    assert "both wrote 1" in str(report.violations[0])


@pytest.mark.parametrize(
    "event",
    [
        {"kind": "acquire", "proc": "a", "lock": LOCK, "token": 1, "t0": 0.0},
        acquire("a", 1, 1.0, 0.5),
        write("a", 99, 0.0, 0.1),  # a lease never granted
        lost("z", 1, 0.3),
        {"kind": "fault", "what": "kill", "t0": 2.0, "t1": 1.0},
    ],
)
def test_malformed_events_are_reported(event: dict[str, Any]) -> None:
    events = [acquire("a", 1, 0.0, 0.01), event]
    assert "malformed" in check(events).kinds


def test_every_kind_can_be_reported() -> None:
    """Taken together, the bad histories above reach every kind the checker knows."""
    bad = [
        [*takeover_after_a_pause()[:2], acquire("b", 11, 0.5, 0.6)],
        holder("a", 5, 0.0, 1) + holder("b", 4, 0.2, 2),
        [acquire("a", 7, 0.0, 1.0), acquire("b", 7, 0.5, 0.6)],
        [
            *holder("a", 2, 0.0, 1),
            acquire("b", 1, -1.0, -0.9),
            write("b", 1, 1.0, 1.1, accepted=True, value=2),
        ],
        holder("a", 1, 0.0, 1) + holder("b", 2, 0.2, 1),
        [write("a", 1, 0.0, 0.1)],
    ]
    found = set().union(*(check(events).kinds for events in bad))
    assert found == set(KINDS)


def test_load_merges_logs_and_skips_a_line_cut_by_a_kill(tmp_path: Path) -> None:
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text("".join(json.dumps(e) + "\n" for e in holder("a", 1, 0.0, 1)))
    second.write_text(json.dumps(acquire("b", 2, 0.2, 0.21)) + "\n" + '{"kind": "wri')
    events = load([first, second, tmp_path / "never-written.jsonl"])
    assert len(events) == 5
    assert check(events).violations == []
