"""The live-locks table on an ordinary screen, in a real browser: at 1280 and 1920 px
wide it fits the window (no sideways scrolling, the last column visible), and a long
lock name is cut short with its full value on hover.

Set ``DISTLOCKS_LAYOUT_SHOTS`` to a directory to also save a screenshot per width."""

from __future__ import annotations

import os
from typing import Any

import pytest

from distlocks import livelocks, lock
from distlocks.locks import holder_extra
from tests.test_browser import browser_page  # noqa: F401 - the fixture

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

LONG = "reports:" + "quarterly-export-for-the-northern-region-" * 4 + "end"


def _log_in(page: Any, live_server: Any, username: str, password: str) -> None:
    page.goto(f"{live_server.url}/admin/login/?next=/admin/")
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("input[type=submit]")
    page.wait_for_selector("#site-name")


@pytest.fixture
def staged(name: str, pg_ready: None) -> Any:
    leases = []
    reset = holder_extra.set({"celery_task_id": "5f1c9a2e-7b7d-4f0e-9a51-6c2d1e0b8f43"})
    try:
        leases.append(lock(f"{LONG}:{name}"[:200], backend="redis", ttl=60).acquire())
        leases.append(lock(f"invoice:{name}", backend="pg", ttl=60).acquire())
    finally:
        holder_extra.reset(reset)
    leases.append(lock(f"short:{name}", backend="locmem", ttl=60).acquire())
    yield leases
    for lease in leases:
        lease.release()


@pytest.mark.parametrize(("width", "height"), [(1280, 800), (1920, 1080)])
def test_the_table_fits_the_window(
    width: int,
    height: int,
    browser_page: Any,  # noqa: F811 - the fixture
    live_server: Any,
    django_user_model: Any,
    staged: list[Any],
) -> None:
    django_user_model.objects.create_superuser("ops", password="s3cret-pw")
    livelocks.snapshots.clear()
    page = browser_page
    page.set_viewport_size({"width": width, "height": height})
    _log_in(page, live_server, "ops", "s3cret-pw")
    page.goto(f"{live_server.url}/admin/distlocks/livelock/?refresh=0")
    page.wait_for_selector("table#result_list")

    shots = os.environ.get("DISTLOCKS_LAYOUT_SHOTS")  # a directory, to look at the page
    if shots:
        page.screenshot(path=f"{shots}/livelocks-{width}.png", full_page=True)

    long_name = staged[0].name
    row = page.locator(f'tr[data-lock-name="{long_name}"]')
    assert row.count() == 1
    # No sideways scrolling: the table is no wider than its container and the window.
    overflow = page.evaluate(
        """() => {
            const box = document.querySelector('#changelist .results');
            const table = document.querySelector('#result_list');
            return {box: box.clientWidth, table: table.scrollWidth,
                    page: document.documentElement.scrollWidth, window: window.innerWidth};
        }"""
    )
    assert overflow["table"] <= overflow["box"] + 1, overflow
    assert overflow["page"] <= overflow["window"] + 1, overflow
    # What an operator decides on is on screen at every width: status, holder, how
    # long it has been held, when it expires, its token and its waiters.
    for cell in (
        "td.field-status",
        "td.field-holder",
        "td.field-held",
        "td.field-expires",
        "td.field-token",
        "td.field-waiters",
    ):
        box = row.locator(cell).bounding_box()
        assert box is not None and box["width"] > 0, (cell, box, width)
        assert box["x"] + box["width"] <= width, (cell, box, width)
    # The long name is cut short on the page, with its full value on hover.
    link = row.locator("th.field-name a")
    assert link.get_attribute("title") == long_name
    truncated = link.evaluate("el => el.scrollWidth > el.clientWidth")
    assert truncated


CONTRAST = """el => {
    const rgb = s => s.match(/[0-9.]+/g).slice(0, 3).map(Number);
    const lum = ([r, g, b]) => {
        const f = c => {
            c /= 255;
            return c <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4;
        };
        return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b);
    };
    const style = getComputedStyle(el);
    const a = lum(rgb(style.color)), b = lum(rgb(style.backgroundColor));
    return {ratio: (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05),
            color: style.color, background: style.backgroundColor};
}"""


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_the_force_release_button_is_readable(
    scheme: str,
    browser_page: Any,  # noqa: F811 - the fixture
    live_server: Any,
    django_user_model: Any,
    staged: list[Any],
) -> None:
    """Styled as Django's own delete button, with a contrast of at least 4.5:1 (WCAG AA)
    between its text and its background, in the light and the dark theme."""
    django_user_model.objects.create_superuser("ops", password="s3cret-pw")
    page = browser_page
    page.emulate_media(color_scheme=scheme)
    _log_in(page, live_server, "ops", "s3cret-pw")
    lease = staged[0]
    page.goto(f"{live_server.url}/admin/distlocks/livelock/lock/?backend=redis&name={lease.name}")
    button = page.locator("#distlocks-force-release")
    button.wait_for()
    seen = button.evaluate(CONTRAST)
    assert seen["ratio"] >= 4.5, seen
    assert seen["background"] not in ("rgba(0, 0, 0, 0)", "transparent"), seen


def test_a_backend_that_cannot_list_is_a_readable_banner_at_1280(
    browser_page: Any,  # noqa: F811 - the fixture
    live_server: Any,
    django_user_model: Any,
    staged: list[Any],
    tmp_path: Any,
) -> None:
    """A view-only operator at 1280 px, with one backend configured that cannot list its
    locks: the page says so in one warning line that is on screen, wraps inside the
    window, shows no secret of that backend's LOCATION, and the listed backends' locks
    are still in the table below it."""
    from django.conf import settings
    from django.test import override_settings

    from tests.test_livelocks_admin import _staff

    _staff(django_user_model, "viewer", "view_livelock")
    secret = "hunter2-sqlite"
    minimal = {
        "BACKEND": "tests.thirdparty.sqlite_locks.MinimalSQLiteBackend",
        "LOCATION": f"sqlite://admin:{secret}@{tmp_path}/locks.sqlite3",
    }
    page = browser_page
    page.set_viewport_size({"width": 1280, "height": 800})
    with override_settings(DISTLOCKS_BACKENDS={**settings.DISTLOCKS_BACKENDS, "ledger": minimal}):
        try:
            livelocks.snapshots.clear()
            _log_in(page, live_server, "viewer", "pw")
            page.goto(f"{live_server.url}/admin/distlocks/livelock/?refresh=0")
            page.wait_for_selector("table#result_list")
            shots = os.environ.get("DISTLOCKS_LAYOUT_SHOTS")
            if shots:
                page.screenshot(path=f"{shots}/livelocks-unlisted-1280.png", full_page=True)
            banner = page.locator("#distlocks-backend-errors li", has_text="ledger")
            assert banner.count() == 1
            text = banner.inner_text()
            assert "cannot list" in text and secret not in page.content(), text
            box = banner.bounding_box()
            assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= 1280, box
            assert box["y"] + box["height"] <= 800, box  # seen without scrolling
            wide = page.evaluate("() => document.documentElement.scrollWidth")
            assert wide <= 1281, wide
            # The backends that can list still show their locks under the warning (the
            # Redis one: changing DISTLOCKS_BACKENDS reset the backends, and the
            # PostgreSQL lock ended with its pooled connection).
            assert page.locator(f'tr[data-lock-name="{staged[0].name}"]').count() == 1
        finally:
            livelocks.snapshots.clear()
