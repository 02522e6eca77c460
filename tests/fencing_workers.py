"""Worker processes of the lost-update workload on a database alias of their own
(SQLite, MariaDB): tests/workers.py's writers, reading and writing through ``using``.

Spawned, not forked: each sets Django up itself from the environment, which names
the servers and the SQLite file of the test session.
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from pathlib import Path
from typing import Any

from tests.workers import setup_django


def fenced_increments(
    model_label: str, pk: int, alias: str, name: str, rounds: int, log_path: str, using: str
) -> None:
    """Read, pause, write +1 under the lock; log "ok" or "stale" per write."""
    try:
        _fenced_increments(model_label, pk, alias, name, rounds, log_path, using)
    except BaseException:
        # The test reads why a worker failed from here (its stderr is not captured).
        errors = Path(log_path).with_name(f"error-{os.getpid()}")
        errors.write_text(traceback.format_exc())
        raise


def _fenced_increments(
    model_label: str, pk: int, alias: str, name: str, rounds: int, log_path: str, using: str
) -> None:
    setup_django()
    from django.apps import apps

    from distlocks import lock
    from distlocks.exceptions import StaleFencingToken

    model = apps.get_model(model_label)
    log = Path(log_path)
    for _ in range(rounds):
        # A ttl no stall of a loaded machine outlasts (renewed meanwhile): only the paused
        # holder's lease is meant to run out; one of these lost inside the block would
        # raise LockLost and end the worker with a lost increment.
        with lock(name, backend=alias, ttl=30, timeout=60) as lease:
            row = model.objects.using(using).get(pk=pk)
            value = row.value
            time.sleep(0.01)
            row.value = value + 1
            try:
                row.save(using=using, fencing_token=lease)
                outcome = "ok"
            except StaleFencingToken:
                outcome = "stale"
        with log.open("a") as fh:
            fh.write(outcome + "\n")


def paused_writer(
    model_label: str, pk: int, alias: str, name: str, work_dir: str, using: str, raw: bool
) -> None:
    """Take the lock, read the row, announce it is about to write, and wait for the
    test to let it go (the test SIGSTOPs it past its TTL first). Then write the row
    back with its old token: through save(), or with ``raw`` through plain SQL that
    bypasses the save path (only the database's trigger can refuse that one)."""
    setup_django()
    from django.apps import apps
    from django.db import connections

    from distlocks import lock
    from distlocks.exceptions import LockLost, StaleFencingToken

    model = apps.get_model(model_label)
    work = Path(work_dir)
    lease = lock(name, backend=alias, ttl=0.5, timeout=30).acquire()
    row = model.objects.using(using).get(pk=pk)
    row.value += 1
    lease.ensure_held()
    token = lease.fencing_token
    (work / "ready").write_text(str(token))
    while not (work / "go").exists():
        time.sleep(0.002)
    try:
        if raw:
            connection = connections[using]
            quote = connection.ops.quote_name
            with connection.cursor() as cursor:
                cursor.execute(
                    f"UPDATE {quote(model._meta.db_table)} SET {quote('value')} = %s,"
                    f" {quote('fencing_token')} = %s WHERE {quote('id')} = %s",
                    [row.value, token, pk],
                )
        else:
            row.save(using=using, fencing_token=token)
        outcome = "ok"
    except StaleFencingToken as exc:
        outcome = f"stale {exc.offered} {exc.stored}"
    with contextlib.suppress(LockLost):
        lease.release()
    (work / "outcome").write_text(outcome)


def _failure(work: Path, proc: Any) -> str:
    """Why worker ``proc`` failed: its traceback if it wrote one."""
    errors = work / f"error-{proc.pid}"
    detail = errors.read_text() if errors.exists() else "no traceback written"
    return f"worker exit code {proc.exitcode}: {detail}"


def run_workload(
    model: Any, name: str, work: Path, using: str, *, raw: bool = False
) -> dict[str, object]:
    """The lost-update workload of tests/test_fencing.py on database ``using``: a holder
    is paused past its TTL while three processes take the lock in turn and increment
    the row (8 times each); then it resumes and writes its stale value."""
    import multiprocessing
    import signal

    from distlocks.fencing import unfenced

    with unfenced():
        row = model.objects.using(using).create(value=0)
    label = model._meta.label
    ctx = multiprocessing.get_context("spawn")
    victim = ctx.Process(
        target=paused_writer, args=(label, row.pk, "redis", name, str(work), using, raw)
    )
    victim.start()
    deadline = time.monotonic() + 30
    while not (work / "ready").exists() or not (work / "ready").read_text():
        assert time.monotonic() < deadline, "the paused holder never got the lock"
        time.sleep(0.005)
    os.kill(victim.pid, signal.SIGSTOP)  # type: ignore[arg-type]
    log = work / "log"
    others = [
        ctx.Process(
            target=fenced_increments, args=(label, row.pk, "redis", name, 8, str(log), using)
        )
        for _ in range(3)
    ]
    try:
        for proc in others:
            proc.start()
        # Let the others get the expired lock and write a few times before resuming.
        while not log.exists() or len(log.read_text().split()) < 6:
            assert time.monotonic() < deadline + 30, "the other writers made no progress"
            time.sleep(0.01)
    finally:
        (work / "go").write_text("")
        os.kill(victim.pid, signal.SIGCONT)  # type: ignore[arg-type]
    victim.join(30)
    for proc in others:
        proc.join(120)
        assert proc.exitcode == 0, _failure(work, proc)
    outcomes = log.read_text().split()
    victim_outcome = (work / "outcome").read_text()
    successes = outcomes.count("ok") + (victim_outcome == "ok")
    return {
        "final": model.objects.using(using).get(pk=row.pk).value,
        "successes": successes,
        "victim": victim_outcome,
        "stale_others": outcomes.count("stale"),
    }
