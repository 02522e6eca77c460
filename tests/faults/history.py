"""A checker for the histories recorded by the fault-injection scenarios.

Every process of a scenario appends events (JSON objects) to a log of its own;
the scenario merges the logs and hands them to :func:`check`, which reports
every way the history breaks the promises of a fenced lock. Times are
``time.monotonic()`` readings, which on Linux are CLOCK_MONOTONIC: one clock for
every process of the machine, so events of different processes compare.

A remote operation is recorded with the time just before the request was sent
(``t0``) and just after the reply came (``t1``): it took effect on the server at
some instant in between. The checker only reports what the history proves, so
a violation is never a matter of interpretation.

Events (``kind`` and its fields; every event of a holder names ``proc``,
``lock`` and the lease's ``token``):

``acquire``  granted: ``t0``, ``t1``, ``lease`` (seconds the server keeps the lock
             without renewal; None where it has no expiry, e.g. PostgreSQL)
``renew``    a renewal the server confirmed: ``t0``, ``t1``
``write``    a fenced write: ``t0``, ``t1``, ``op`` ("claim" or "increment"),
             ``accepted`` (bool), ``value`` (what an increment wrote)
``release``  ``t0``, ``t1``, ``ok`` (True: the server freed it; False: it no
             longer had it; None: unknown, e.g. the server could not be reached)
``lost``     the holder learned it lost the lease: ``t``
``fault``    injected by the test: ``what``, ``t0``, ``t1``, ``ends_leases`` (True
             when it may end leases without their holders' doing, such as a
             Redis restart that loses its data or a terminated PostgreSQL session)

Other kinds (attempts, errors, markers) are allowed and ignored.

Violation kinds:

``overlap``       a lock granted while another lease of it was certainly still
                  valid on the server (not expired, released or ended by a fault)
``token-order``   a later acquisition got a token not above an earlier one's
``token-reuse``   two acquisitions of one lock got the same token
``stale-write``   the storage accepted a write whose token was below that of a
                  write it had accepted before
``lost-update``   the counter does not equal the number of accepted increments,
                  or two accepted increments wrote the same value
``malformed``     an event that is incomplete, ends before it starts, or refers
                  to a lease the history never granted
"""

from __future__ import annotations

import itertools
import json
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Taken off every lease length: servers count expiry in whole milliseconds from a
#: clock read when the request is processed, on a clock other than CLOCK_MONOTONIC.
CLOCK_SLACK = 0.005

KINDS = ("overlap", "token-order", "token-reuse", "stale-write", "lost-update", "malformed")

_TIMED = {"acquire", "renew", "write", "release"}
_OF_A_LEASE = {"renew", "write", "release", "lost"}
_REQUIRED = {
    "acquire": ("proc", "lock", "token", "t0", "t1"),
    "renew": ("proc", "lock", "token", "t0", "t1"),
    "write": ("proc", "lock", "token", "t0", "t1", "op", "accepted"),
    "release": ("proc", "lock", "token", "t0", "t1"),
    "lost": ("proc", "lock", "token", "t"),
    "fault": ("what", "t0", "t1"),
}


@dataclass(frozen=True)
class Violation:
    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"


@dataclass
class Report:
    """What :func:`check` found, with counts that tell whether the faults bit."""

    violations: list[Violation] = field(default_factory=list)
    #: Remote operations recorded (acquisitions, renewals, writes, releases).
    ops: int = 0
    acquisitions: int = 0
    accepted_writes: int = 0
    rejected_writes: int = 0
    increments: int = 0
    #: Acquisitions granted while an earlier holder of the lock still acted as one
    #: afterwards (a write or a release started after the grant): the situations
    #: fencing exists for.
    takeovers: int = 0
    faults: int = 0

    @property
    def kinds(self) -> set[str]:
        return {v.kind for v in self.violations}

    def summary(self) -> str:
        return (
            f"ops={self.ops} faults={self.faults} violations={len(self.violations)} "
            f"acquisitions={self.acquisitions} accepted={self.accepted_writes} "
            f"rejected={self.rejected_writes} takeovers={self.takeovers}"
        )


@dataclass
class _Lease:
    """One acquisition and what its holder did with it."""

    acquire: Mapping[str, Any]
    renewals: list[Mapping[str, Any]] = field(default_factory=list)
    writes: list[Mapping[str, Any]] = field(default_factory=list)
    releases: list[Mapping[str, Any]] = field(default_factory=list)

    @property
    def label(self) -> str:
        a = self.acquire
        return f"{a['proc']}#{a['token']}"

    def certainly_held_until(self, faults: list[Mapping[str, Any]]) -> float:
        """The latest instant at which the server certainly still had this lease.

        Each confirmation (the grant, a renewal, a release that freed it) reached
        the server at or after its ``t0`` and found the lease there; since nothing
        but this acquisition can create a lease with its owner, the lease existed
        from the grant up to that arrival. After the grant or a renewal it lasts
        ``lease`` seconds more, unless a fault that ends leases comes first. A
        release ends it at its arrival, which may be as early as its ``t0``.
        """
        lease = self.acquire.get("lease")
        ends = self.acquire["t1"]
        for c in [self.acquire, *self.renewals]:
            if lease is not None:
                until = c["t0"] + lease - CLOCK_SLACK
                for f in faults:
                    if f["t1"] > c["t0"]:  # the fault may have struck after the arrival
                        until = min(until, max(c["t0"], f["t0"]))
                ends = max(ends, until)
            if c is not self.acquire:
                ends = max(ends, c["t0"])
        for r in self.releases:
            # A release that freed the lease found it there on arrival: held until then.
            ends = r["t0"] if r.get("ok") is True else min(ends, r["t0"])
        return ends

    def last_act(self) -> float:
        """When the holder last started acting as the holder (a write or release)."""
        starts = [w["t0"] for w in self.writes] + [r["t0"] for r in self.releases]
        return max(starts, default=-math.inf)


def load(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """The events of several JSON-lines logs (a line cut short by a kill is skipped)."""
    events: list[dict[str, Any]] = []
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
    return events


def _malformed(event: Mapping[str, Any]) -> str | None:
    kind = event.get("kind")
    missing = [key for key in _REQUIRED.get(str(kind), ()) if key not in event]
    if missing:
        return f"{kind} event lacks {', '.join(missing)}: {dict(event)}"
    if (kind in _TIMED or kind == "fault") and event["t1"] < event["t0"]:
        return f"{kind} event ends before it starts: {dict(event)}"
    return None


def check(events: Iterable[Mapping[str, Any]], *, final: int | None = None) -> Report:
    """Check a merged history; ``final`` is the counter's value read at the end
    (None: skip the lost-update comparison, e.g. when the scenario has no counter)."""
    report = Report()
    bad = report.violations.append
    leases: dict[tuple[str, str, int], _Lease] = {}
    by_lock: dict[str, list[_Lease]] = defaultdict(list)
    faults: list[Mapping[str, Any]] = []
    ending_faults: list[Mapping[str, Any]] = []
    later: list[Mapping[str, Any]] = []
    for event in events:
        problem = _malformed(event)
        if problem:
            bad(Violation("malformed", problem))
            continue
        kind = event.get("kind")
        if kind in _TIMED:
            report.ops += 1
        if kind == "fault":
            report.faults += 1
            faults.append(event)
            if event.get("ends_leases"):
                ending_faults.append(event)
        elif kind == "acquire":
            key = (event["proc"], event["lock"], event["token"])
            if key in leases:
                bad(Violation("token-reuse", f"{event['proc']} got token {key[2]} twice"))
                continue
            leases[key] = _Lease(event)
            by_lock[event["lock"]].append(leases[key])
            report.acquisitions += 1
        elif kind in _OF_A_LEASE:
            later.append(event)
    for event in later:
        lease = leases.get((event["proc"], event["lock"], event["token"]))
        if lease is None:
            bad(Violation("malformed", f"{event['kind']} of a lease never granted: {event}"))
            continue
        if event["kind"] == "renew":
            lease.renewals.append(event)
        elif event["kind"] == "write":
            lease.writes.append(event)
        elif event["kind"] == "release":
            lease.releases.append(event)

    for lock_leases in by_lock.values():
        _check_grants(lock_leases, ending_faults, report)
        _check_writes(lock_leases, report)
    _check_counter(leases.values(), final, report)
    return report


def _check_grants(leases: list[_Lease], faults: list[Mapping[str, Any]], report: Report) -> None:
    bad = report.violations.append
    held_until = {id(x): x.certainly_held_until(faults) for x in leases}
    for x, y in itertools.permutations(leases, 2):
        ax, ay = x.acquire, y.acquire
        if id(x) < id(y) and ax["token"] == ay["token"]:
            bad(Violation("token-reuse", f"{x.label} and {y.label} share token {ax['token']}"))
        if ax["t1"] >= ay["t0"]:
            continue  # y was not certainly granted after x
        if ay["token"] <= ax["token"]:
            bad(
                Violation(
                    "token-order",
                    f"{y.label} was granted after {x.label} with a token not above it",
                )
            )
        if ay["t1"] <= held_until[id(x)]:
            bad(
                Violation(
                    "overlap",
                    f"{y.label} was granted at [{ay['t0']:.3f}, {ay['t1']:.3f}] while "
                    f"{x.label} was still valid until {held_until[id(x)]:.3f}",
                )
            )
        if x.last_act() > ay["t1"]:
            report.takeovers += 1


def _check_writes(leases: list[_Lease], report: Report) -> None:
    """The storage never accepts a token below one it accepted before."""
    writes = [w for lease in leases for w in lease.writes]
    accepted = [w for w in writes if w["accepted"]]
    report.accepted_writes += len(accepted)
    report.rejected_writes += len(writes) - len(accepted)
    for a, b in itertools.permutations(accepted, 2):
        if a["t1"] < b["t0"] and b["token"] < a["token"]:
            report.violations.append(
                Violation(
                    "stale-write",
                    f"{b['proc']}'s write with token {b['token']} was accepted after "
                    f"{a['proc']}'s with token {a['token']}",
                )
            )


def _check_counter(leases: Iterable[_Lease], final: int | None, report: Report) -> None:
    increments = [
        w for lease in leases for w in lease.writes if w["op"] == "increment" and w["accepted"]
    ]
    report.increments = len(increments)
    seen: dict[Any, str] = {}
    for w in increments:
        if w.get("value") is None:
            continue
        if w["value"] in seen:
            report.violations.append(
                Violation(
                    "lost-update",
                    f"{w['proc']} (token {w['token']}) and {seen[w['value']]} both wrote "
                    f"{w['value']}: one increment overwrote the other",
                )
            )
        seen[w["value"]] = f"{w['proc']} (token {w['token']})"
    if final is not None and final != len(increments):
        report.violations.append(
            Violation(
                "lost-update",
                f"the counter is {final} after {len(increments)} accepted increments",
            )
        )
