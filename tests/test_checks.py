"""Each check ID is emitted exactly when its setting is wrong."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import override_settings

from distlocks.checks import check_settings

REDIS = {"BACKEND": "distlocks.backends.redis.RedisBackend", "LOCATION": "redis://127.0.0.1"}
PG = {"BACKEND": "distlocks.backends.postgres.PostgresBackend", "DATABASE": "default"}
LITE = {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}


def ids(**settings: Any) -> list[str]:
    settings.setdefault("DISTLOCKS_BACKENDS", {"default": REDIS})
    with override_settings(**settings):
        return [message.id for message in check_settings()]


def test_valid_settings_give_no_message() -> None:
    assert ids() == []


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"DISTLOCKS_BACKENDS": None}, ["distlocks.E001"]),
        ({"DISTLOCKS_BACKENDS": {"other": REDIS}}, ["distlocks.E001"]),
        ({"DISTLOCKS_BACKENDS": {"default": "redis://"}}, ["distlocks.E002"]),
        ({"DISTLOCKS_BACKENDS": {"default": {"LOCATION": "x"}}}, ["distlocks.E002"]),
        ({"DISTLOCKS_BACKENDS": {"default": {"BACKEND": "no.such.Backend"}}}, ["distlocks.E003"]),
        (
            {"DISTLOCKS_BACKENDS": {"default": {**REDIS, "LOCATION": "http://x"}}},
            ["distlocks.E004"],
        ),
        (
            {"DISTLOCKS_BACKENDS": {"default": {**REDIS, "CACHE": "redis", "TYPO": 1}}},
            ["distlocks.E004", "distlocks.E004"],
        ),
        ({"DISTLOCKS_DEFAULT_TTL": 0}, ["distlocks.E005"]),
        ({"DISTLOCKS_DEFAULT_TTL": "30"}, ["distlocks.E005"]),
        ({"DISTLOCKS_DEFAULT_TIMEOUT": -1}, ["distlocks.E006"]),
        ({"DISTLOCKS_DEFAULT_TIMEOUT": "10"}, ["distlocks.E006"]),
        ({"DISTLOCKS_KEY_PREFIX": ""}, ["distlocks.E007"]),
        ({"DISTLOCKS_KEY_PREFIX": "a}b"}, ["distlocks.E007"]),
        (
            {
                "DEBUG": False,
                "DISTLOCKS_BACKENDS": {
                    "default": {"BACKEND": "distlocks.backends.locmem.LocMemBackend"}
                },
            },
            ["distlocks.W001"],
        ),
        (
            {
                "DEBUG": True,
                "DISTLOCKS_BACKENDS": {
                    "default": {"BACKEND": "distlocks.backends.locmem.LocMemBackend"}
                },
            },
            [],
        ),
        ({"DISTLOCKS_DEFAULT_TIMEOUT": None}, []),
        ({"DISTLOCKS_STUCK_AFTER": 0}, ["distlocks.E011"]),
        ({"DISTLOCKS_STUCK_AFTER": "1h"}, ["distlocks.E011"]),
        ({"DISTLOCKS_STUCK_AFTER": 600}, []),
        ({"DISTLOCKS_METRICS": "yes"}, ["distlocks.E012"]),
        ({"DISTLOCKS_METRICS": True}, []),
        ({"DISTLOCKS_RELEASE_ON_COMMIT": "no"}, ["distlocks.E013"]),
        ({"DISTLOCKS_RELEASE_ON_COMMIT": False}, []),
        ({"DISTLOCKS_DEFAULT_TIMOUT": 5}, ["distlocks.W005"]),
        ({"DISTLOCKS_BACKENDS": {"default": PG}}, []),
        (
            {
                "DATABASES": {"default": LITE},
                "DISTLOCKS_BACKENDS": {"default": PG},
            },
            ["distlocks.E008"],
        ),
        (
            {"DISTLOCKS_BACKENDS": {"default": {**PG, "OPTIONS": {"pooler": "transaction"}}}},
            ["distlocks.E009"],
        ),
        (
            {
                "DISTLOCKS_BACKENDS": {
                    "default": {**PG, "OPTIONS": {"mode": "transaction", "pooler": "transaction"}}
                }
            },
            [],
        ),
    ],
)
def test_check_ids(settings: dict[str, Any], expected: list[str]) -> None:
    assert sorted(ids(**settings)) == sorted(expected)


def test_checks_are_registered_with_django() -> None:
    from django.core.checks import run_checks

    with override_settings(DISTLOCKS_DEFAULT_TTL=-5):
        found = [m.id for m in run_checks(tags=["distlocks"])]
    assert "distlocks.E005" in found


def test_every_id_is_covered() -> None:
    """The IDs in checks.py and the IDs this module tests are the same set."""
    import distlocks.checks as module

    defined = {
        f"distlocks.{name}" for name in dir(module) if name[:1] in "EW" and name[1:].isdigit()
    }
    tested = {i for _, expected in test_check_ids.pytestmark[0].args[1] for i in expected}
    # Model checks need models: tests/test_fencing.py::TestModelCheck covers E010;
    # admin and database checks too: tests/test_checks_fencing.py covers W003 and W004,
    # tests/test_review8_managers.py covers W006.
    tested |= {"distlocks.E010", "distlocks.W003", "distlocks.W004", "distlocks.W006"}
    assert defined == tested


@pytest.mark.parametrize(
    ("setting", "value", "check_id"),
    [
        ("DISTLOCKS_DEFAULT_TTL", 365 * 86400 + 1, "distlocks.E005"),
        ("DISTLOCKS_DEFAULT_TTL", 1e300, "distlocks.E005"),
        ("DISTLOCKS_DEFAULT_TIMEOUT", 365 * 86400 + 1, "distlocks.E006"),
        ("DISTLOCKS_DEFAULT_TIMEOUT", 10**400, "distlocks.E006"),
    ],
)
def test_defaults_beyond_the_bounds_are_errors_that_name_them(
    setting: str, value: object, check_id: str
) -> None:
    with override_settings(**{setting: value}):
        found = [m for m in check_settings() if m.id == check_id]
    assert found and "31,536,000" in found[0].msg
