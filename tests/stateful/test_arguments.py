"""Property tests of every public argument, on every backend of the contract suite.

The rule is the stateful machines' one, applied to single calls with drawn arguments:
a call either works (and then cleans up after itself on the server) or raises the
documented ``ValueError``/``TypeError`` (or a ``LockError``); a refused call writes
nothing: no lock, no permit, no fencing counter. Which values are valid is decided here
by an oracle written from the documented bounds (``docs/safety.md``), not by calling
the library's own checks, so a check that lets a bad value through, or refuses a good
one, fails the test.

Names, ``ttl``, ``timeout``, ``max_hold``, the boolean flags, ``extend()``, semaphore
``limit`` and Celery run-lock keys are drawn; the Celery key must also be the same when
computed from the arguments as sent and as a worker decodes them from the message.
"""

from __future__ import annotations

import datetime as dt
import math
import uuid
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import HealthCheck, given, note
from hypothesis import strategies as st
from kombu.serialization import dumps, loads

from distlocks import get_backend, lock, semaphore
from distlocks.exceptions import LockError, LockLost
from distlocks.validation import MAX_NAME_LENGTH, MAX_SEMAPHORE_LIMIT, MAX_TIMEOUT, MAX_TTL
from tests.stateful.conftest import profile

# Each example makes a few round trips to a real server; the fixtures only name an
# alias (the server is the session's), so reusing them across examples is right.
_SHARED_FIXTURE = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]


def examples(bounded: int) -> Any:
    """The stateful profile with ``bounded`` examples in ``make test`` (the fuzz profile
    keeps its own, larger count)."""
    settings = profile(suppress_health_check=_SHARED_FIXTURE)
    if settings.max_examples > 100:  # fuzz
        return settings
    return profile(max_examples=bounded, suppress_health_check=_SHARED_FIXTURE)


_counter = iter(range(10**9))


def fresh(prefix: str) -> str:
    """A lock name no other example or run has used."""
    return f"prop:{prefix}:{uuid.uuid4().hex[:10]}:{next(_counter)}"


def untouched(alias: str, name: str) -> None:
    """Nothing of ``name`` is on the server: no holder and no fencing counter."""
    backend = get_backend(alias)
    assert backend.inspect(name) is None, f"{name!r} is held after a refused call"
    assert backend.fencing_counter(name) == 0, f"{name!r} got a counter from a refused call"


# -- the oracle ------------------------------------------------------------------------


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def finite_at_most(value: Any, bound: float) -> bool:
    if isinstance(value, int):
        return value <= bound
    return math.isfinite(value) and value <= bound


def valid_ttl(value: Any) -> bool:
    return is_number(value) and finite_at_most(value, MAX_TTL) and value >= 0.01


def valid_timeout(value: Any) -> bool:
    if value is None:
        return True
    return is_number(value) and finite_at_most(value, MAX_TIMEOUT) and value >= 0


def valid_name(value: Any) -> bool:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME_LENGTH:
        return False
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
        return False
    return not any(0xD800 <= ord(ch) <= 0xDFFF for ch in value)


def refused(exc: BaseException) -> bool:
    """Whether ``exc`` is one of the documented ways to refuse a bad argument."""
    return isinstance(exc, ValueError | TypeError) and not isinstance(exc, LockError)


# -- strategies ------------------------------------------------------------------------

huge_ints = st.sampled_from([10**17, 2**63 - 1, 2**63, 2**64, 10**400, -(10**400)])
bound_edges = st.sampled_from(
    [MAX_TTL, MAX_TTL + 1, MAX_TTL + 1e-6, MAX_TTL - 0.5, 0.01, 0.00999, 0, -0.0, -1, 1e-300]
)
seconds = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=0.01, max_value=120),
    st.integers(min_value=-(2**70), max_value=2**70),
    huge_ints,
    bound_edges,
    st.booleans(),
    st.sampled_from(["5", b"5", Decimal("5"), [5], 5j]),
)
# Mostly short positive ttls that a test can hold and release quickly.
ttls = st.one_of(seconds, st.floats(min_value=1, max_value=60))
flags = st.one_of(st.booleans(), st.sampled_from(["no", "yes", 0, 1, None, "", 1.0]))
# Every code point: controls, NUL, lone surrogates, and the characters that mean
# something to a key scheme ({, }, #, /, :, ., *, ?, [).
all_chars = st.characters(codec=None, categories=None)
special = st.sampled_from([*"{}#/:.*?[]\\ %'\"\x00\x7f\u2028", "\ud800", "\udfff"])
# The characters above that a valid name may hold.
key_chars = st.sampled_from(list("{}#/:.*?[]\\ %'\"\u2028-_"))
names = st.one_of(
    st.text(st.one_of(all_chars, special), min_size=0, max_size=12),
    st.text(st.one_of(all_chars, special), min_size=MAX_NAME_LENGTH - 2, max_size=202),
    st.sampled_from([".", "..", "/", "//", "#", "{}", "{x}", "x}{", "zk/../y", " ", "a" * 200]),
    st.sampled_from([None, 5, b"bytes", ["x"]]),
)


# -- lock() ----------------------------------------------------------------------------


@examples(25)
@given(name=names)
def test_any_name_is_taken_or_refused_cleanly(alias: str, name: Any) -> None:
    """A valid name is locked, listed under its own name and freed; an invalid one is a
    ValueError/TypeError at the call."""
    note(f"name={name!r}")
    if not valid_name(name):
        with pytest.raises((ValueError, TypeError)) as info:
            lock(name, backend=alias, ttl=10, timeout=0).acquire()
        assert refused(info.value)
        return
    # A unique prefix keeps examples apart; the drawn text is still the name's tail,
    # and a long drawn name stays as it is (the prefix would push it over the limit).
    full = name if len(name) > 150 else fresh("n") + name
    backend = get_backend(alias)
    counter = backend.fencing_counter(full)
    lease = lock(full, backend=alias, ttl=10, timeout=0, auto_renew=False).acquire()
    try:
        assert lease.fencing_token > counter
        info = backend.inspect(full)
        assert info is not None and info.name == full and info.owner == lease.owner
        other = lock(full, backend=alias, ttl=10, timeout=0)
        with pytest.raises(LockError):
            other.acquire()
    finally:
        assert lease.release() is True
    assert backend.inspect(full) is None
    assert backend.fencing_counter(full) >= lease.fencing_token


@examples(15)
@given(
    tails=st.lists(st.text(key_chars, min_size=1, max_size=6), min_size=2, max_size=4, unique=True)
)
def test_distinct_names_never_share_a_lock(alias: str, tails: list[str]) -> None:
    """Names made of the characters a key scheme gives meaning to are all held at once,
    each with its own counter: no two of them map to one lock."""
    # One prefix for all: the names differ only in the drawn characters.
    prefix = fresh("d")
    names_ = [f"{prefix}{tail}" for tail in tails]
    leases = []
    try:
        for each in names_:
            leases.append(lock(each, backend=alias, ttl=10, timeout=0, auto_renew=False).acquire())
        backend = get_backend(alias)
        for each, lease in zip(names_, leases, strict=True):
            info = backend.inspect(each)
            assert info is not None and info.owner == lease.owner, f"{each!r} not its own"
    finally:
        for lease in leases:
            lease.release()


@examples(30)
@given(ttl=ttls, timeout=st.one_of(st.none(), seconds), max_hold=st.one_of(st.none(), seconds))
def test_ttl_timeout_and_max_hold_are_bounded(
    alias: str, ttl: Any, timeout: Any, max_hold: Any
) -> None:
    """Out of bounds or of the wrong type: refused at the call, nothing written. In
    bounds: the lease is taken, ends where the ttl says, and is freed."""
    note(f"ttl={ttl!r} timeout={timeout!r} max_hold={max_hold!r}")
    name = fresh("t")
    good = valid_ttl(ttl) and valid_timeout(timeout) and (max_hold is None or valid_ttl(max_hold))
    if not good:
        with pytest.raises((ValueError, TypeError)) as info:
            lock(name, backend=alias, ttl=ttl, timeout=timeout, max_hold=max_hold).acquire()
        assert refused(info.value), repr(info.value)
        untouched(alias, name)
        return
    # Valid: taken at once (the name is free, so the timeout is never waited out).
    lease = lock(name, backend=alias, ttl=ttl, timeout=timeout, max_hold=max_hold).acquire()
    try:
        if lease.expires_at is not None:
            left = (lease.expires_at - lease.acquired_at).total_seconds()
            assert left <= ttl + 1, f"expires {left} s after the grant, ttl {ttl}"
    finally:
        try:
            lease.release()
        except LockLost:
            # A lease of a few milliseconds may be over before the release: that is
            # reported, as it must be, and the server frees it by itself.
            assert ttl < 1
    if ttl >= 1:
        assert get_backend(alias).inspect(name) is None


@examples(20)
@given(auto_renew=flags, reentrant=flags, fair=flags)
def test_flags_are_booleans(alias: str, auto_renew: Any, reentrant: Any, fair: Any) -> None:
    name = fresh("f")
    kwargs = {"auto_renew": auto_renew, "reentrant": reentrant, "fair": fair}
    if not all(isinstance(v, bool) for v in kwargs.values()):
        with pytest.raises(TypeError):
            lock(name, backend=alias, ttl=10, timeout=0, **kwargs).acquire()
        untouched(alias, name)
        return
    with lock(name, backend=alias, ttl=10, timeout=0, **kwargs) as lease:
        assert lease.held()
    assert get_backend(alias).inspect(name) is None


@examples(25)
@given(ttl=st.one_of(st.none(), seconds))
def test_extend_is_bounded_and_keeps_the_lease_on_refusal(alias: str, ttl: Any) -> None:
    """A refused extend() changes nothing: the lease is still held, with its old expiry."""
    note(f"extend({ttl!r})")
    name = fresh("e")
    lease = lock(name, backend=alias, ttl=30, timeout=0, auto_renew=False).acquire()
    try:
        before = get_backend(alias).inspect(name)
        if ttl is not None and not valid_ttl(ttl):
            with pytest.raises((ValueError, TypeError)) as info:
                lease.extend(ttl)
            assert refused(info.value)
            assert lease.held()
            after = get_backend(alias).inspect(name)
            assert after is not None and after.owner == lease.owner
            assert after.fencing_token == before.fencing_token
            if before.expires_at is not None:
                # Not lengthened (a backend that derives the date from the time left
                # may shift it by the microseconds between the two reads).
                assert after.expires_at is not None
                assert after.expires_at <= before.expires_at + dt.timedelta(seconds=0.5)
            return
        if ttl is not None and ttl < 1:
            return  # a lease cut to milliseconds is not worth racing against
        lease.extend(ttl)
        assert lease.held()
    finally:
        lease.release()


# -- semaphore(limit=...) ---------------------------------------------------------------

limits = st.one_of(
    st.integers(min_value=-5, max_value=8),
    st.sampled_from([MAX_SEMAPHORE_LIMIT, MAX_SEMAPHORE_LIMIT + 1, 10**6, 10**9, 2**63, 10**400]),
    st.sampled_from([True, False, 2.0, 2.5, "3", None, float("inf"), float("nan")]),
)


@pytest.fixture(
    # pg needs the test database even when this is the only test run (-k semaphore).
    params=["locmem", "redis", pytest.param("pg", marks=pytest.mark.django_db), "zk"]
)
def permit_alias(request: pytest.FixtureRequest) -> str:
    if request.param == "pg":
        request.getfixturevalue("pg_ready")
    elif request.param == "zk":
        request.getfixturevalue("zk_ready")
    return str(request.param)


@examples(25)
@given(limit=limits)
def test_semaphore_limit_is_bounded(permit_alias: str, limit: Any) -> None:
    note(f"limit={limit!r}")
    name = fresh("s")
    valid = isinstance(limit, int) and not isinstance(limit, bool)
    valid = valid and 1 <= limit <= MAX_SEMAPHORE_LIMIT
    backend = get_backend(permit_alias)
    if not valid:
        with pytest.raises((ValueError, TypeError)) as info:
            semaphore(name, limit=limit, backend=permit_alias, ttl=10, timeout=0).acquire()
        assert refused(info.value)
        assert not [i for i in backend.iter_locks() if i.name == name]
        return
    taken = []
    try:
        for _ in range(min(limit, 3)):
            taken.append(
                semaphore(name, limit=limit, backend=permit_alias, ttl=10, timeout=0).acquire()
            )
        if limit <= 3:
            with pytest.raises(LockError):
                semaphore(name, limit=limit, backend=permit_alias, ttl=10, timeout=0).acquire()
    finally:
        for permit in taken:
            permit.release()
    assert not [i for i in backend.iter_locks() if i.name == name]


# -- Celery run-lock keys --------------------------------------------------------------

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(st.characters(codec="utf-8"), max_size=20),
)
message_values = st.recursive(
    st.one_of(
        json_scalars,
        st.decimals(allow_nan=False, allow_infinity=False, places=3),
        st.uuids(),
        st.dates(),
        st.datetimes(timezones=st.just(dt.UTC)),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.dictionaries(st.text(max_size=6), inner, max_size=4),
    ),
    max_leaves=12,
)
odd_values = st.one_of(
    st.sampled_from([object(), b"raw", 3j, float("nan"), float("inf"), {1.5j: 1}, {(1,): 2}]),
    st.builds(lambda: {"k": {object()}}),
)


def _keyed_task() -> Any:
    from distlocks.contrib.celery import single_execution
    from tests.celery_app import app

    # One task object for every example (registering tasks per example would grow
    # the app's registry without bound).
    task = app.tasks.get("props.keyed")
    if task is None:

        @single_execution(app=app, name="props.keyed")
        def keyed(account: Any, payload: Any = None, *, note: Any = "") -> None: ...

        task = keyed
    return task


@examples(60)
@given(account=message_values, payload=message_values)
def test_celery_key_is_the_same_sent_and_received(account: Any, payload: Any) -> None:
    """The key made from the arguments when a task is published equals the key the
    worker makes from the decoded message, and it is a valid lock name."""
    task = _keyed_task()
    sent = task.lock_name((account,), {"payload": payload})
    content_type, encoding, body = dumps(((account,), {"payload": payload}), serializer="json")
    args, kwargs = loads(body, content_type, encoding)
    assert task.lock_name(args, kwargs) == sent
    assert valid_name(sent)


@examples(30)
@given(value=st.one_of(odd_values, message_values))
def test_celery_key_of_any_value_is_a_name_or_a_clear_error(value: Any) -> None:
    task = _keyed_task()
    error: Exception | None = None
    try:
        name = task.lock_name((value,), {})
    except (TypeError, ValueError) as exc:
        error = exc
    if error is not None:
        # Refused at the call, naming the task (and so what to change).
        assert "task 'props.keyed'" in str(error), str(error)
    else:
        assert valid_name(name)
