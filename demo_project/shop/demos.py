"""The demonstrations behind the shop pages, kept apart from the views.

Every function here uses only the public distlocks API (``lock``, ``lock_many``,
``get_backend``, the ``Lease`` attributes and the exceptions) and returns plain
dataclasses that the views keep in the session and the templates show.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal

from django.conf import settings
from django.db import connections, transaction
from django.utils import timezone

from demo_project.shop.models import Charge, Invoice
from distlocks import get_backend, lock, lock_many
from distlocks.backends.base import LockInfo
from distlocks.exceptions import LockError, LockLost, LockNotAcquired
from distlocks.lease import Lease

CHARGED = "charged"
BUSY = "LockNotAcquired"
ALREADY_PAID = "already paid"
FAILED = "error"

MAX_WORKERS = 16
#: The charge lock's lease, as in the docs' example.
CHARGE_TTL = 10.0
#: Longest a worker waits for the others at a rendezvous. Kept well under
#: CHARGE_TTL so that a holder never outlives its lease while it waits.
RENDEZVOUS_LIMIT = 5.0

FENCING_LOCK = "demo:fencing"
#: How long each crossing transfer holds its two locks (simulated work).
TRANSFER_WORK = 0.3


@dataclass
class Attempt:
    """What one worker thread of the charge race did."""

    worker: str
    outcome: str
    fencing_token: int | None = None
    detail: str = ""


class Rendezvous:
    """Lets each of ``parties`` threads wait until all of them have reached one point.

    Unlike ``threading.Barrier``, arriving does not block, so a thread can
    arrive and go on (the workers that find the lock busy) while another one
    waits for everybody (the holder, during its simulated payment call).
    """

    def __init__(self, parties: int) -> None:
        self.parties = parties
        self._arrived: set[str] = set()
        self._cond = threading.Condition()

    def arrive(self, who: str) -> None:
        """Record that ``who`` got there; arriving twice counts once."""
        with self._cond:
            self._arrived.add(who)
            self._cond.notify_all()

    def wait_for_all(self, timeout: float) -> bool:
        """Block until every party has arrived (True) or ``timeout`` ran out (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self._arrived) >= self.parties, timeout)


def _charge(
    invoice_id: int, rendezvous: Rendezvous, *, backend: str, lease: Lease | None
) -> Attempt:
    """Check the invoice, call the (simulated) payment gateway, record the charge.

    This is the classic check-then-act: it is only correct if nobody else runs
    it for the same invoice at the same time, which ``lease`` (when given) ensures.
    """
    worker = threading.current_thread().name
    token = None if lease is None else lease.fencing_token
    invoice = Invoice.objects.get(pk=invoice_id)
    rendezvous.arrive(worker)
    if invoice.paid_at is not None:
        return Attempt(worker, ALREADY_PAID, token, f"paid at {invoice.paid_at:%H:%M:%S}")
    # The simulated payment call lasts until every other worker has made its own
    # attempt, so the race happens on every click instead of by luck.
    rendezvous.wait_for_all(RENDEZVOUS_LIMIT)
    if lease is not None:
        # Last check before the side effect: never write once the lease is known lost.
        lease.ensure_held()
    with transaction.atomic():
        Charge.objects.create(
            invoice=invoice,
            amount=invoice.amount,
            worker=worker,
            backend=backend if token is not None else "",
            fencing_token=token,
        )
        Invoice.objects.filter(pk=invoice_id).update(paid_at=timezone.now())
    return Attempt(worker, CHARGED, token, f"{invoice.amount} charged")


def _charge_with_lock(invoice_id: int, rendezvous: Rendezvous, backend: str) -> Attempt:
    worker = threading.current_thread().name
    try:
        with lock(f"invoice:{invoice_id}", backend=backend, ttl=CHARGE_TTL, timeout=0) as lease:
            return _charge(invoice_id, rendezvous, backend=backend, lease=lease)
    except LockNotAcquired as exc:
        rendezvous.arrive(worker)
        return Attempt(worker, BUSY, None, str(exc))


def race_to_charge(
    invoice_id: int, *, workers: int = 8, backend: str = "default", use_lock: bool = True
) -> list[Attempt]:
    """Start ``workers`` threads at once, each trying to charge the invoice.

    With ``use_lock`` each one runs inside ``lock(f"invoice:{id}", ttl=10,
    timeout=0)``: one charges, the others get ``LockNotAcquired``. Without it,
    they all charge. Returns one :class:`Attempt` per worker, in worker order.
    """
    if not 2 <= workers <= MAX_WORKERS:
        raise ValueError(f"workers must be between 2 and {MAX_WORKERS}, not {workers}.")
    start = threading.Barrier(workers)
    rendezvous = Rendezvous(workers)
    attempts: dict[str, Attempt] = {}

    def work() -> None:
        worker = threading.current_thread().name
        try:
            start.wait(RENDEZVOUS_LIMIT)
            if use_lock:
                attempts[worker] = _charge_with_lock(invoice_id, rendezvous, backend)
            else:
                attempts[worker] = _charge(invoice_id, rendezvous, backend=backend, lease=None)
        except Exception as exc:  # shown on the page rather than lost in a thread
            attempts[worker] = Attempt(worker, FAILED, None, f"{type(exc).__name__}: {exc}")
        finally:
            # A worker that failed early must not keep the holder waiting.
            rendezvous.arrive(worker)
            # Each thread opened its own database connection.
            connections.close_all()

    threads = [
        threading.Thread(target=work, name=f"charge-worker-{n}") for n in range(1, workers + 1)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [attempts[thread.name] for thread in threads]


@dataclass
class Round:
    """One step of the fencing-token demonstration."""

    step: int
    action: str
    fencing_token: int
    note: str = ""


def fencing_rounds(backend: str = "default", rounds: int = 3) -> list[Round]:
    """Acquire and release one lock several times, then evict a holder, and record
    the fencing tokens: they only ever go up, and the eviction burns one."""
    steps: list[Round] = []
    for _ in range(rounds):
        with lock(FENCING_LOCK, backend=backend, ttl=10, timeout=5) as lease:
            steps.append(Round(len(steps) + 1, "acquired, then released", lease.fencing_token))

    evicted = lock(FENCING_LOCK, backend=backend, ttl=10, timeout=5).acquire()
    # What an operator's force-release does; the holder is not told.
    get_backend(backend).force_release(FENCING_LOCK)
    held_locally = evicted.held()
    freed = evicted.release()
    try:
        evicted.ensure_held()
        lost = "ensure_held() did not raise"
    except LockLost as exc:
        lost = f"ensure_held() raised LockLost: {exc}"
    steps.append(
        Round(
            len(steps) + 1,
            "acquired, then force-released by an operator",
            evicted.fencing_token,
            f"After the eviction held() still said {held_locally} (it is local knowledge, "
            f"no I/O); release() returned {freed}; {lost}",
        )
    )

    with lock(FENCING_LOCK, backend=backend, ttl=10, timeout=5) as lease:
        steps.append(
            Round(
                len(steps) + 1,
                "acquired, then released",
                lease.fencing_token,
                f"The force-release advanced the counter, so token {evicted.fencing_token} "
                f"is outdated even before anyone writes with {lease.fencing_token}.",
            )
        )
    return steps


@dataclass
class Transfer:
    """One of the two crossing transfers of the ``lock_many`` demonstration."""

    worker: str
    description: str
    outcome: str
    order: list[str] = field(default_factory=list)
    tokens: dict[str, int] = field(default_factory=dict)
    waited_ms: float = 0.0


def crossing_transfers(backend: str = "default", timeout: float = 5.0) -> list[Transfer]:
    """Run alice -> bob and bob -> alice at the same moment, each holding both
    account locks through ``lock_many``. Taking the locks in argument order could
    deadlock; ``lock_many`` sorts the names, so both finish."""
    pairs = [("alice", "bob"), ("bob", "alice")]
    start = threading.Barrier(len(pairs))
    results: dict[str, Transfer] = {}

    def transfer(source: str, target: str) -> None:
        worker = threading.current_thread().name
        description = f"{source} -> {target}"
        try:
            start.wait(RENDEZVOUS_LIMIT)
            began = time.monotonic()
            names = [f"account:{source}", f"account:{target}"]
            with lock_many(names, backend=backend, ttl=10, timeout=timeout) as leases:
                waited = time.monotonic() - began
                time.sleep(TRANSFER_WORK)  # the transfer itself (simulated)
                results[worker] = Transfer(
                    worker,
                    description,
                    "done",
                    order=list(leases),
                    tokens={name: lease.fencing_token for name, lease in leases.items()},
                    waited_ms=round(waited * 1000, 1),
                )
        except LockError as exc:
            results[worker] = Transfer(worker, description, f"{type(exc).__name__}: {exc}")

    threads = [
        threading.Thread(target=transfer, args=pair, name=f"transfer-{n}")
        for n, pair in enumerate(pairs, start=1)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [results[thread.name] for thread in threads]


@dataclass
class BackendLocks:
    """The live locks of one backend, or why they could not be listed."""

    alias: str
    backend_class: str
    locks: list[LockInfo]
    error: str = ""


def live_locks() -> list[BackendLocks]:
    """``get_backend(alias).iter_locks()`` for every configured backend."""
    listing = []
    for alias, config in settings.DISTLOCKS_BACKENDS.items():
        class_name = str(config.get("BACKEND", "")).rsplit(".", 1)[-1]
        try:
            infos = sorted(get_backend(alias).iter_locks(), key=lambda info: info.name)
        except LockError as exc:
            listing.append(BackendLocks(alias, class_name, [], str(exc)))
        else:
            listing.append(BackendLocks(alias, class_name, infos))
    return listing


def release_quietly(release: Callable[[], object]) -> None:
    """Run a lease's ``release`` from a timer thread, where an error has nowhere to go."""
    # On failure the lease ends by expiry; distlocks has already logged the cause.
    with contextlib.suppress(LockError):
        release()


SAMPLE_INVOICES = [
    ("Ada Lovelace", Decimal("120.00")),
    ("Grace Hopper", Decimal("75.50")),
    ("Edsger Dijkstra", Decimal("310.25")),
]


def create_sample_invoices() -> int:
    """Create a few unpaid invoices if there are none; returns how many were created."""
    if Invoice.objects.exists():
        return 0
    Invoice.objects.bulk_create(
        Invoice(customer=customer, amount=amount) for customer, amount in SAMPLE_INVOICES
    )
    return len(SAMPLE_INVOICES)
