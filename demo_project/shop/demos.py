"""The demonstrations behind the shop pages, kept apart from the views.

Every function here uses only the public distlocks API (``lock``, ``lock_many``,
``get_backend``, the ``Lease`` attributes, ``FencedModel`` and the exceptions) and
returns plain dataclasses that the views keep in the session and the templates show.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.db import connection, connections, transaction
from django.utils import timezone

from demo_project.shop.models import Account, Charge, Invoice, PlainAccount
from distlocks import Lock, get_backend, lock, lock_many
from distlocks.backends.base import LockInfo
from distlocks.exceptions import LockError, LockLost, LockNotAcquired, StaleFencingToken
from distlocks.fencing import unfenced
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


# -- fenced writes: the paused holder ------------------------------------------------

#: Lease of holder A: short, and never renewed, so that its pause outlasts it.
PAUSE_TTL = 1.0
#: Longest any party of the story waits for another (a bound, never a pacing sleep).
STORY_LIMIT = 15.0
#: The owner of the account rows that the story writes.
STORY_OWNER = "Ada Lovelace"
STORY_BALANCE = Decimal("100.00")
DEPOSIT_A = Decimal("10.00")
DEPOSIT_B = Decimal("50.00")
STALE = "StaleFencingToken"
SAVED = "saved"


@dataclass
class StoryStep:
    """One line of the paused-holder story."""

    who: str
    action: str
    fencing_token: int | None = None


@dataclass
class Story:
    """The paused-holder story, run once on a fenced or a plain account."""

    fenced: bool
    backend: str
    lock_name: str
    ttl: float
    steps: list[StoryStep] = field(default_factory=list)
    start_balance: str = ""
    final_balance: str = ""
    final_token: int | None = None
    a_token: int | None = None
    b_token: int | None = None
    #: ``STALE``, ``SAVED``, or the error that stopped the story.
    a_outcome: str = ""
    offered: int | None = None
    stored: int | None = None
    #: How long A was paused, and whether its lease was still valid when it woke.
    paused_for: float = 0.0
    held_after_pause: bool | None = None
    b_waited: float = 0.0
    #: Whether the row ends with B's deposit in it.
    b_update_kept: bool = False


def story_account(model: type[Account] | type[PlainAccount]) -> Account | PlainAccount:
    """The account row the story writes (created on first use)."""
    row = model.objects.filter(owner=STORY_OWNER).order_by("pk").first()
    if row is None:
        # Setup, not a lock holder's write: no token to offer yet (it starts at 0).
        with unfenced():
            row = model.objects.create(owner=STORY_OWNER, balance=STORY_BALANCE)
    return row


def _row_lock(row: Account | PlainAccount, **kwargs: Any) -> Lock:
    """The row's lock: ``fenced_lock()`` for a fenced row, the same scheme by hand
    for a plain one."""
    if isinstance(row, Account):
        return row.fenced_lock(**kwargs)
    return lock(row.lock_name, **kwargs)


def paused_holder(backend: str = "default", *, fenced: bool = True) -> Story:
    """Holder A takes the row's lock (``PAUSE_TTL``, ``auto_renew=False``), reads the
    balance and pauses; B gets the lock once A's lease has run out, deposits and
    saves; then A wakes up and saves its own deposit with its old token.

    On the fenced account A's save raises ``StaleFencingToken`` and B's deposit
    stays; on the plain account A's save goes through and B's deposit is lost.
    """
    model = Account if fenced else PlainAccount
    row = story_account(model)
    ttl = PAUSE_TTL
    name = _row_lock(row, backend=backend).name
    story = Story(fenced=fenced, backend=backend, lock_name=name, ttl=ttl)
    paused, wake = threading.Event(), threading.Event()

    def step(who: str, action: str, token: int | None = None) -> None:
        story.steps.append(StoryStep(who, action, token))

    def holder_a() -> None:
        try:
            lease = _row_lock(
                row, backend=backend, ttl=ttl, timeout=STORY_LIMIT, auto_renew=False
            ).acquire()
            story.a_token = token = lease.fencing_token
            mine = model.objects.get(pk=row.pk)
            story.start_balance = str(mine.balance)
            lease.ensure_held()  # the last local check: the lease is valid here
            step(
                "A",
                f"takes {name!r} ({ttl:g} s lease, not renewed), reads {mine.balance}, "
                f"checks ensure_held(): fine",
                token,
            )
            began = time.monotonic()
            paused.set()
            # The pause: a GC pause, a stalled disk or network. It ends when B is done,
            # which cannot happen before A's lease has run out on the server.
            wake.wait(STORY_LIMIT)
            story.paused_for = round(time.monotonic() - began, 2)
            story.held_after_pause = lease.held()
            mine.balance += DEPOSIT_A
            try:
                if fenced:
                    # The token read before the pause: the write that was already on its
                    # way when the lease ran out.
                    mine.save(fencing_token=token)
                else:
                    mine.save()
                story.a_outcome = SAVED
            except StaleFencingToken as exc:
                story.a_outcome = STALE
                story.offered, story.stored = exc.offered, exc.stored
            with contextlib.suppress(LockError):
                lease.release()  # a no-op on the server: the lease is no longer A's
        except Exception as exc:  # shown on the page rather than lost in a thread
            story.a_outcome = f"{type(exc).__name__}: {exc}"
        finally:
            paused.set()
            connections.close_all()

    thread = threading.Thread(target=holder_a, name="holder-A")
    thread.start()
    try:
        paused.wait(STORY_LIMIT)
        if story.a_outcome:  # A failed before its pause
            return story
        began = time.monotonic()
        # B waits in the lock's queue; it gets the lock when A's lease runs out.
        with _row_lock(row, backend=backend, ttl=10, timeout=ttl + STORY_LIMIT) as lease:
            story.b_waited = round(time.monotonic() - began, 2)
            story.b_token = lease.fencing_token
            theirs = model.objects.get(pk=row.pk)
            read = theirs.balance
            theirs.balance += DEPOSIT_B
            if fenced:
                theirs.save(fencing_token=lease)
            else:
                theirs.save()
            step(
                "B",
                f"waits {story.b_waited:g} s for the lock, gets it, reads {read}, "
                f"deposits {DEPOSIT_B}: saves {theirs.balance}",
                lease.fencing_token,
            )
    except LockError as exc:
        story.a_outcome = story.a_outcome or f"B failed: {type(exc).__name__}: {exc}"
    finally:
        wake.set()
        thread.join(STORY_LIMIT + ttl)

    after = model.objects.get(pk=row.pk)
    story.final_balance = str(after.balance)
    story.final_token = getattr(after, "fencing_token", None)
    expected_with_b = Decimal(story.start_balance or 0) + DEPOSIT_B
    story.b_update_kept = after.balance == expected_with_b
    still = "still valid" if story.held_after_pause else "no longer valid"
    if story.a_outcome == STALE:
        result = f"StaleFencingToken (offered {story.offered}, stored {story.stored})"
    elif story.a_outcome == SAVED:
        result = "saved: it overwrote B's write"
    else:
        result = story.a_outcome
    step(
        "A",
        f"wakes after {story.paused_for:g} s (its lease is {still}), deposits {DEPOSIT_A} "
        f"on the {story.start_balance} it read: {result}",
        story.a_token,
    )
    return story


@dataclass
class RawWrite:
    """A raw SQL UPDATE that tries to lower a fenced row's token."""

    sql: str
    outcome: str
    offered: int | None = None
    stored: int | None = None
    before: tuple[str, int] = ("", 0)
    after: tuple[str, int] = ("", 0)
    #: Tables of this database that carry the distlocks fencing trigger.
    trigger_tables: list[str] = field(default_factory=list)


def raw_sql_lowering() -> RawWrite:
    """``UPDATE ... SET fencing_token = <stored - 1>`` through a plain cursor: the
    PostgreSQL trigger refuses it, and distlocks reports StaleFencingToken."""
    row = story_account(Account)
    table = connection.ops.quote_name(Account._meta.db_table)
    lower = row.fencing_token - 1
    sql = f"UPDATE {table} SET balance = 0, fencing_token = {lower} WHERE id = {row.pk}"
    result = RawWrite(sql=sql, outcome="", before=(str(row.balance), row.fencing_token))
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(
                f"UPDATE {table} SET balance = 0, fencing_token = %s WHERE id = %s",
                [lower, row.pk],
            )
        result.outcome = "written"
    except StaleFencingToken as exc:
        result.outcome = STALE
        result.offered, result.stored = exc.offered, exc.stored
    row.refresh_from_db()
    result.after = (str(row.balance), row.fencing_token)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid"
            " WHERE t.tgname = 'distlocks_fencing' AND NOT t.tgisinternal ORDER BY 1"
        )
        result.trigger_tables = [table_name for (table_name,) in cursor.fetchall()]
    return result


SAMPLE_INVOICES = [
    ("Ada Lovelace", Decimal("120.00")),
    ("Grace Hopper", Decimal("75.50")),
    ("Edsger Dijkstra", Decimal("310.25")),
]


def create_sample_invoices() -> int:
    """Create a few unpaid invoices if there are none, and the accounts of the
    fenced-writes page; returns how many invoices were created."""
    story_account(Account)
    story_account(PlainAccount)
    if Invoice.objects.exists():
        return 0
    Invoice.objects.bulk_create(
        Invoice(customer=customer, amount=amount) for customer, amount in SAMPLE_INVOICES
    )
    return len(SAMPLE_INVOICES)
