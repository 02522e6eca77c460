"""Review 8: characters that change how text reads, in what the admin shows.

Bidi controls (U+202E, U+200F, U+2066...), zero-width and other format characters, and
the fillers that draw nothing, in a lock name or a holder's details, were written raw
into the admin's HTML (repr() and the logs escape them): an operator could be shown a
name that reads as another one. Every page of the live locks (list, lock, force-release
confirmation), the messages and the admin's action history must show them escaped,
while the confirmation form still releases the lock by its real name.
"""

from __future__ import annotations

import html
import re
import threading
from typing import Any

import pytest
from django.test import Client
from hypothesis import HealthCheck, given
from hypothesis import settings as examples
from hypothesis import strategies as st

from distlocks import lock
from distlocks.locks import holder_extra
from distlocks.redaction import escape_control
from tests.test_livelocks_admin import LIST_URL, LOCK_URL, RELEASE_URL, _staff

pytestmark = pytest.mark.django_db

#: Characters that draw nothing, or reorder what follows, and are not ASCII controls
#: (which lock names refuse): format characters (bidi controls, zero-width ones, the
#: byte-order mark), line and paragraph separators, C1 controls, and the "default
#: ignorable" letters and marks that render as nothing (fillers, variation selectors).
INVISIBLE = st.one_of(
    st.characters(categories=("Cf", "Zl", "Zp")),
    st.characters(min_codepoint=0x80, max_codepoint=0x9F),
    st.sampled_from(
        list(
            "\u115f\u1160\u3164\uffa0\u034f\u17b4\u180b\ufe0f\U000e0100"
            "\u202e\u200f\u2066\u2069\u200b\ufeff"
        )
    ),
)


@pytest.fixture
def releaser(django_user_model: Any) -> Client:
    client = Client()
    client.force_login(
        _staff(django_user_model, "releaser8", "view_livelock", "force_release_livelock")
    )
    return client


_HIDDEN = re.compile(r'(<input type="hidden" name="[^"]*" value=")([^"]*)(")')


def _raw(page: str, chars: set[str]) -> set[str]:
    """The characters of ``chars`` written raw in ``page``. A hidden field (never
    drawn) may hold a C1 control raw: HTML has no reference for those."""

    def drop_c1(match: re.Match[str]) -> str:
        value = "".join(ch for ch in match[2] if not 0x80 <= ord(ch) <= 0x9F)
        return match[1] + value + match[3]

    return {ch for ch in chars if ch in _HIDDEN.sub(drop_c1, page)}


@examples(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    hidden=st.lists(INVISIBLE, min_size=1, max_size=4),
    where=st.sampled_from(["name", "task", "thread", "all"]),
)
def test_no_page_shows_them_raw(releaser: Client, name: str, hidden: list[str], where: str) -> None:
    chars = set(hidden)
    text = "".join(hidden)
    evil = f"{name}-a{text}b" if where in ("name", "all") else name
    extra = {"celery_task_id": f"task{text}"} if where in ("task", "all") else {}
    thread = threading.current_thread()
    before = thread.name
    reset = holder_extra.set(extra)
    try:
        if where in ("thread", "all"):
            thread.name = f"worker{text}"
        lease = lock(evil, backend="locmem", ttl=30).acquire()
    finally:
        thread.name = before
        holder_extra.reset(reset)
    try:
        pages = {
            "list": releaser.get(LIST_URL, {"q": name, "fresh": "1"}),
            "lock": releaser.get(LOCK_URL, {"backend": "locmem", "name": evil}),
            "confirm": releaser.get(RELEASE_URL, {"backend": "locmem", "name": evil}),
        }
        for page, response in pages.items():
            assert response.status_code == 200, page
            shown = response.content.decode()
            assert not _raw(shown, chars), (page, _raw(shown, chars))
            if page != "confirm" or where != "task":  # no task id on that page
                # What was hidden is shown, escaped.
                assert escape_control(text) in html.unescape(shown), page
        # The confirmation form still names the lock by its real name.
        form = pages["confirm"].content.decode()
        field = re.search(r'name="name" value="([^"]*)"', form)
        assert field is not None and html.unescape(field.group(1)) == evil
        csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form)
        assert csrf is not None
        done = releaser.post(
            RELEASE_URL,
            {
                "backend": "locmem",
                "name": html.unescape(field.group(1)),
                "fencing_token": str(lease.fencing_token),
                "csrfmiddlewaretoken": csrf.group(1),
            },
        )
        assert done.status_code == 302
        after = releaser.get(done["Location"]).content.decode()
        assert "was force-released" in after
        assert not _raw(after, chars), ("message", _raw(after, chars))
        history = releaser.get("/admin/").content.decode()
        assert not _raw(history, chars), ("history", _raw(history, chars))
        # A message naming the lock that is no longer held.
        gone = releaser.get(LOCK_URL, {"backend": "locmem", "name": evil}, follow=True)
        assert not _raw(gone.content.decode(), chars), "not-held message"
    finally:
        lease.release()
