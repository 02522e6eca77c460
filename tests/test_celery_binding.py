"""The arguments a task's key is made from: bound to its signature, defaults applied,
exactly as ``inspect.Signature.bind`` + ``apply_defaults`` bind them, for any
signature and any call (the run path binds plain signatures itself, faster)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from distlocks.contrib.celery import _bound, _plain_params, single_execution
from tests.celery_app import app

P = inspect.Parameter
NAMES = ["a", "b", "c", "d"]
KINDS = [P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY]


@st.composite
def signatures(draw: st.DrawFn) -> inspect.Signature:
    """Signatures of up to four parameters: mostly plain ones (as most tasks have),
    sometimes positional-only, keyword-only, ``*args`` or ``**kwargs``; defaults on
    a tail of the positional ones and on any keyword-only one."""
    names = draw(st.lists(st.sampled_from(NAMES), unique=True, max_size=4))
    plain = draw(st.booleans())
    kinds = sorted(
        (P.POSITIONAL_OR_KEYWORD if plain else draw(st.sampled_from(KINDS)) for _ in names),
        key=lambda kind: kind.value,
    )
    params: list[P] = []
    defaults = False
    for name, kind in zip(names, kinds, strict=True):
        if kind is P.KEYWORD_ONLY:
            default = draw(st.sampled_from([P.empty, 0, "x"]))
        else:
            defaults = defaults or draw(st.booleans())
            default = draw(st.integers(0, 9)) if defaults else P.empty
        params.append(P(name, kind, default=default))
    if not plain and draw(st.booleans()):
        at = sum(p.kind is not P.KEYWORD_ONLY for p in params)
        params.insert(at, P("rest", P.VAR_POSITIONAL))
    if not plain and draw(st.booleans()):
        params.append(P("options", P.VAR_KEYWORD))
    return inspect.Signature(params)


calls = st.tuples(
    st.lists(st.integers(0, 9), max_size=5).map(tuple),
    st.dictionaries(st.sampled_from([*NAMES, "e", "rest"]), st.integers(0, 9), max_size=4),
)


def _reference(signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return TypeError
    bound.apply_defaults()
    return dict(bound.arguments)


@given(signatures(), calls)
def test_bound_is_what_signature_bind_gives(
    signature: inspect.Signature, call: tuple[tuple[Any, ...], dict[str, Any]]
) -> None:
    args, kwargs = call
    expected = _reference(signature, args, kwargs)
    try:
        got: Any = _bound(signature, _plain_params(signature), args, kwargs)
    except TypeError:
        got = TypeError
    assert got == expected
    if isinstance(got, dict):
        assert list(got) == list(expected)  # the parameters' order too


@single_execution(app=app, name="binding.keyed")
def keyed(account: int, amount: int = 5, note: str = "") -> None:
    pass


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [((1,), {}), ((1, 5), {}), ((), {"account": 1}), ((1,), {"amount": 5, "note": ""})],
)
def test_calls_that_bind_alike_make_one_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    assert keyed.lock_name(args, kwargs) == keyed.lock_name((1, 5, ""))


@pytest.mark.parametrize(
    ("args", "kwargs", "says"),
    [
        ((), {}, "missing a required argument: 'account'"),
        ((1, 2, 3, 4), {}, "too many positional arguments"),
        ((1,), {"account": 2}, "multiple values for argument 'account'"),
        ((1,), {"amout": 2}, "unexpected keyword argument 'amout'"),
    ],
)
def test_arguments_that_do_not_fit_are_refused_with_the_reason(
    args: tuple[Any, ...], kwargs: dict[str, Any], says: str
) -> None:
    with pytest.raises(TypeError, match=f"binding.keyed.*{says}"):
        keyed.lock_name(args, kwargs)
