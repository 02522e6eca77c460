"""The operator keeps their place: the search, filters, order and page of the live-locks
list follow them to a lock's page, to its force release and back to the list."""

from __future__ import annotations

import html
import re
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from django.test import Client

from distlocks import get_backend, lock
from tests.test_livelocks_admin import _staff

pytestmark = pytest.mark.django_db

LIST_URL = "/admin/distlocks/livelock/"


@pytest.fixture
def releaser(django_user_model: Any) -> Client:
    client = Client()
    client.force_login(
        _staff(django_user_model, "keeper", "view_livelock", "force_release_livelock")
    )
    return client


def _links(html: str, view: str) -> list[str]:
    return [u.replace("&amp;", "&") for u in re.findall(rf'href="([^"]*/{view}/\?[^"]*)"', html)]


def test_force_release_returns_to_the_same_search_and_filters(releaser: Client, name: str) -> None:
    lease = lock(f"{name}:kept-place", backend="redis", ttl=30).acquire()
    try:
        wanted = {"q": f"{name}:kept", "status": "ok", "backend": "redis", "o": "-held"}
        listing = releaser.get(LIST_URL, {**wanted, "refresh": "0"})
        assert listing.status_code == 200
        (row_url,) = _links(listing.content.decode(), "lock")
        carried = parse_qs(parse_qs(urlsplit(row_url).query)["_changelist_filters"][0])
        assert {k: v[0] for k, v in carried.items() if k in wanted} == wanted

        page = releaser.get(row_url)
        assert page.status_code == 200
        text = page.content.decode()
        (release_url,) = _links(text, "release")
        back = re.search(r'href="([^"]*)" class="closelink"', text)
        assert back is not None
        assert parse_qs(urlsplit(back.group(1).replace("&amp;", "&")).query)["q"] == [wanted["q"]]

        confirm = releaser.get(release_url)
        form = confirm.content.decode()
        hidden = {
            k: html.unescape(v)
            for k, v in re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', form)
        }
        assert "_changelist_filters" in hidden
        done = releaser.post(release_url.split("?")[0], hidden)
        assert done.status_code == 302
        landed = urlsplit(done["Location"])
        assert landed.path == LIST_URL
        assert {k: v[0] for k, v in parse_qs(landed.query).items() if k in wanted} == wanted
        assert get_backend("redis").inspect(f"{name}:kept-place") is None  # it was freed
    finally:
        lease.release()


@pytest.mark.parametrize(
    "hostile",
    [
        "next=https://evil.example/&q=x",
        "q=x&_changelist_filters=q%3Dy",
        "//evil.example",
        "q=" + "a" * 5000,
    ],
)
def test_only_known_list_parameters_are_carried_back(
    releaser: Client, name: str, hostile: str
) -> None:
    response = releaser.get(
        "/admin/distlocks/livelock/lock/",
        {"backend": "redis", "name": f"{name}:never-held", "_changelist_filters": hostile},
    )
    assert response.status_code == 302
    target = urlsplit(response["Location"])
    assert target.netloc == "" and target.path == LIST_URL
    assert set(parse_qs(target.query)) <= {"q", "status", "backend", "o", "p", "refresh"}
    assert "evil" not in response["Location"]
    assert len(response["Location"]) < 2100
