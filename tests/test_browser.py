"""The live-locks page in a real browser (headless Chromium driven by Playwright).

A live server runs the admin; another OS process holds a lock; the browser signs in,
finds that lock on the page, and force-releases it through the confirmation page.
The other process must then learn that it lost the lease, and its token be stale.

Set ``DISTLOCKS_SCREENSHOT=docs/assets/livelocks.png`` to also stage a page with locks
in every status and save a screenshot of it there (used for the documentation).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from distlocks import get_backend, livelocks, lock
from distlocks.locks import holder_extra
from tests.test_livelocks_admin import ChildHolder
from tests.waiting import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

#: Flags for a headless Chromium that must not reach the network on its own.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")


def find_chromium() -> str | None:
    """``DISTLOCKS_TEST_CHROMIUM``, else a Chromium at a usual path or on PATH."""
    names = [os.environ.get("DISTLOCKS_TEST_CHROMIUM", ""), *CANDIDATES]
    names += [shutil.which(n) or "" for n in ("chromium", "chromium-browser", "google-chrome")]
    return next((n for n in names if n and os.access(n, os.X_OK)), None)


@pytest.fixture
def browser_page(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    executable = find_chromium()
    if executable is None:
        pytest.skip(
            "No Chromium found (looked at DISTLOCKS_TEST_CHROMIUM, "
            f"{', '.join(CANDIDATES)} and PATH): install Debian's chromium package "
            "(`make test` does so when run as root) to run the browser test."
        )
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("Playwright is not installed: pip install -e '.[dev]'.")
    admin_static = Path(__import__("django.contrib.admin").contrib.admin.__file__).parent / "static"

    def serve_static(route: Any) -> None:
        # The test settings have no staticfiles app: the admin's CSS comes from disk.
        relative = re.sub(r"^.*?/static/", "", route.request.url.split("?")[0])
        file = admin_static / relative
        if file.is_file():
            route.fulfill(path=str(file))
        else:
            route.fulfill(status=404)

    # Playwright's sync API keeps an event loop in this thread; the test's own ORM
    # calls are still plain synchronous code (Django's documented escape hatch).
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1920, "height": 900})
            page.set_default_timeout(60_000)
            page.route(re.compile(r".*/static/.*"), serve_static)
            yield page
        finally:
            browser.close()
            # Connections the test opened while the loop ran: close them here, where
            # that is still allowed, so none outlives the test database.
            from django.db import connections

            connections.close_all()


@pytest.fixture
def scene(settings: Any, pg_ready: None) -> Iterator[list[Any]]:
    """Only with DISTLOCKS_SCREENSHOT: locks on every backend for the picture. The
    "stuck" one is taken first, well before the others (and the worker)."""
    leases: list[Any] = []
    if os.environ.get("DISTLOCKS_SCREENSHOT"):
        reset = holder_extra.set({"celery_task_id": "5f1c9a2e-7b7d-4f0e-9a51-6c2d1e0b8f43"})
        try:
            leases.append(lock("reports:nightly-export", backend="pg", ttl=60).acquire())
        finally:
            holder_extra.reset(reset)
        wait_for(lambda: (_held("pg", "reports:nightly-export") or 0) > 4, 30, "an old lock")
        leases.append(lock("invoice:1042", backend="redis", ttl=30).acquire())
        leases.append(lock("payments.charge:order-5531", backend="locmem", ttl=30).acquire())
        leases.append(lock("search-index:rebuild", backend="pg", ttl=1, auto_renew=False).acquire())
    yield leases
    for lease in leases:
        lease.release()


def _held(alias: str, name: str) -> float | None:
    found = livelocks.inspect(alias, name)
    return found.held_for if found else None


def _status(alias: str, name: str) -> str:
    found = livelocks.inspect(alias, name)
    return found.status if found else ""


def _finish_scene(settings: Any, leases: list[Any]) -> None:
    """Bring the staged locks to their statuses just before the picture."""
    leases.append(lock("inventory:sku-88213", backend="redis", ttl=12, auto_renew=False).acquire())
    wait_for(lambda: _status("redis", "inventory:sku-88213") == livelocks.EXPIRING, 30, "expiring")
    wait_for(lambda: _status("pg", "search-index:rebuild") == livelocks.ORPHANED, 30, "orphaned")
    # Only the lock taken long before the others is held longer than this.
    settings.DISTLOCKS_STUCK_AFTER = (_held("pg", "reports:nightly-export") or 0) - 3


@pytest.fixture
def holder_process(tmp_path: Path, pg_ready: None, name: str) -> Iterator[ChildHolder]:
    work = tmp_path / "child"
    work.mkdir()
    child = ChildHolder("redis", f"{name}:worker", work, ttl=2.0)
    yield child.start()
    child.stop()


def test_force_release_in_a_real_browser(
    browser_page: Any,
    live_server: Any,
    django_user_model: Any,
    settings: Any,
    scene: list[Any],
    holder_process: ChildHolder,
) -> None:
    django_user_model.objects.create_superuser("ops", password="s3cret-pw")
    livelocks.snapshots.clear()  # nothing read by earlier tests
    page = browser_page
    child = holder_process
    page.goto(f"{live_server.url}/admin/login/?next=/admin/")
    page.fill("#id_username", "ops")
    page.fill("#id_password", "s3cret-pw")
    page.click("input[type=submit]")
    page.wait_for_selector("#site-name")
    target = os.environ.get("DISTLOCKS_SCREENSHOT")
    if target:
        _finish_scene(settings, scene)
    # The admin's navigation sidebar, closed: more room for the table.
    page.evaluate("localStorage.setItem('django.admin.navSidebarIsOpen', 'false')")
    page.goto(f"{live_server.url}/admin/distlocks/livelock/?refresh=0")
    page.wait_for_selector("table#result_list")
    assert page.title().startswith("Live locks")
    if target:
        page.screenshot(path=target, full_page=True)

    row = page.locator(f'tr[data-lock-name="{child.name}"]')
    assert f"pid {child.pid}" in row.locator("td.field-holder").inner_text()
    assert row.locator("td.field-task").inner_text() == child.task_id
    assert row.locator("td.field-token").inner_text() == str(child.token)
    row.locator("th.field-name a").click()
    page.wait_for_selector("#distlocks-force-release")
    assert child.task_id in page.inner_text("#content-main")
    page.click("#distlocks-force-release")
    page.wait_for_selector("#distlocks-release-form")
    assert str(child.token) in page.inner_text("#content-main")
    page.click("#distlocks-release-form input[type=submit]")
    page.wait_for_selector("ul.messagelist li.success")
    assert "was force-released" in page.inner_text("ul.messagelist li.success")
    assert page.locator(f'tr[data-lock-name="{child.name}"]').count() == 0

    # The other process learns at its next renewal that its lease is gone...
    wait_for(lambda: child.lost_reason() is not None, 30, "the holder process to lose its lease")
    assert "no longer had it" in (child.lost_reason() or "")
    # ...and its fencing token is stale: the counter moved past it.
    assert get_backend("redis").fencing_counter(child.name) > child.token
    still = get_backend("redis").inspect(child.name)
    assert still is None or still.fencing_token > child.token
