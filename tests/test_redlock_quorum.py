"""The Redlock quorum's arithmetic (distlocks.backends.redlock.quorum), free of I/O, as
properties over every number of masters and every split of their answers: no server
is needed to know what a round's answers decide."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from distlocks.backends.redlock.quorum import _ms, drift, quorum, spare, verdict

MASTERS = st.integers(min_value=1, max_value=101)


@given(MASTERS, st.data())
def test_any_two_quorums_share_a_master(masters: int, data: st.DataObject) -> None:
    """Why one lock at a time: two quorums of the same masters always overlap, so a
    second grant needs a master that still holds (or has ended) the first."""
    first = data.draw(st.sets(st.integers(0, masters - 1), min_size=quorum(masters)))
    second = data.draw(st.sets(st.integers(0, masters - 1), min_size=quorum(masters)))
    assert first & second
    assert quorum(masters) <= masters


@given(MASTERS)
def test_spare_is_how_many_may_fail_with_a_quorum_left(masters: int) -> None:
    assert masters - spare(masters) >= quorum(masters)
    assert masters - (spare(masters) + 1) < quorum(masters)


@given(MASTERS, st.data())
def test_a_verdict_is_given_only_when_the_unanswered_cannot_change_it(
    masters: int, data: st.DataObject
) -> None:
    yes = data.draw(st.integers(0, masters), label="yes")
    no = data.draw(st.integers(0, masters - yes), label="no")
    unanswered = masters - yes - no
    outcome = verdict(yes, no, masters)
    if outcome is True:
        assert yes >= quorum(masters)
        assert no + unanswered < quorum(masters)  # the others cannot make it lost
    elif outcome is False:
        assert yes + unanswered < quorum(masters)  # the others cannot confirm it
    else:
        # Undecided: the masters that did not answer could go either way.
        assert yes + unanswered >= quorum(masters)
        assert no + unanswered > spare(masters)


@given(
    st.floats(min_value=0, max_value=1e6, allow_nan=False),
    st.floats(min_value=0, max_value=1e6, allow_nan=False),
    st.floats(min_value=0, max_value=1, exclude_max=True),
    st.floats(min_value=0, max_value=10),
)
def test_the_drift_allowance_grows_with_the_ttl(
    ttl: float, longer: float, factor: float, margin: float
) -> None:
    assert drift(ttl, factor, margin) >= margin
    assert drift(ttl + longer, factor, margin) >= drift(ttl, factor, margin)
    assert drift(ttl, factor, margin) == ttl * factor + margin


@given(st.floats(min_value=0, max_value=1e9, allow_nan=False))
def test_milliseconds_are_never_zero(seconds: float) -> None:
    """A master told 0 ms would drop the key at once (PEXPIRE 0)."""
    assert _ms(seconds) >= 1
    assert abs(_ms(seconds) - seconds * 1000) <= max(0.5, 1 - seconds * 1000)
