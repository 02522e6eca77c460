"""A lock's page and its force-release confirmation at 1280 px, in a real browser, with
the longest name distlocks accepts (200 characters, no space to break at) and a holder
detail of one long unbroken word: both pages fit the window (no sideways scrolling), for
a superuser and for a view-only operator. Before, the detail table and the confirmation's
heading grew to the width of the longest value: 2,000 to 2,700 px wide at 1280."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlencode

import pytest

from distlocks import lock
from distlocks.locks import holder_extra
from tests.test_browser import browser_page  # noqa: F401 - the fixture
from tests.test_browser_layout import _log_in
from tests.test_livelocks_admin import _staff

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

WIDTH = 1280


@pytest.fixture
def long_lease() -> Iterator[Any]:
    name = (uuid.uuid4().hex + "x" * 200)[:200]
    reset = holder_extra.set({"note": "y" * 300})
    try:
        lease = lock(name, backend="redis", ttl=60).acquire()
    finally:
        holder_extra.reset(reset)
    yield lease
    lease.release()


def _page_width(page: Any, url: str) -> int:
    page.goto(url)
    page.wait_for_selector("#content-main")
    return int(page.evaluate("() => document.documentElement.scrollWidth"))


@pytest.mark.parametrize("who", ["superuser", "viewer"])
def test_a_long_name_and_detail_fit_the_window(
    who: str,
    browser_page: Any,  # noqa: F811 - the fixture
    live_server: Any,
    django_user_model: Any,
    long_lease: Any,
) -> None:
    if who == "superuser":
        django_user_model.objects.create_superuser("ops", password="s3cret-pw")
        username, password = "ops", "s3cret-pw"
    else:
        _staff(django_user_model, "viewer", "view_livelock")
        username, password = "viewer", "pw"
    page = browser_page
    page.set_viewport_size({"width": WIDTH, "height": 900})
    _log_in(page, live_server, username, password)
    query = urlencode({"backend": "redis", "name": long_lease.name})
    base = f"{live_server.url}/admin/distlocks/livelock"

    assert _page_width(page, f"{base}/lock/?{query}") <= WIDTH + 1
    # The whole name and the whole detail are still on the page, wrapped, not cut.
    assert long_lease.name in page.inner_text("#distlocks-lock")
    assert "y" * 300 in page.inner_text("#distlocks-extra").replace("\n", "")
    if who == "superuser":
        assert _page_width(page, f"{base}/release/?{query}") <= WIDTH + 1
        assert long_lease.name in page.inner_text("#content").replace("\n", "")
    else:
        assert page.locator("#distlocks-force-release").count() == 0
