"""Prometheus metrics after real lock operations on real servers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings
from prometheus_client import CollectorRegistry

from distlocks import livelocks, lock
from distlocks.exceptions import LockBackendUnavailable, LockLost, LockNotAcquired

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def registry() -> Iterator[CollectorRegistry]:
    from distlocks import metrics

    metrics.uninstall()
    fresh = CollectorRegistry()
    metrics.install(fresh)
    yield fresh
    metrics.uninstall()


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_acquisitions_waits_and_holds(registry: CollectorRegistry, name: str) -> None:
    def now() -> dict[str, float]:
        acq, wait, hold = (
            "distlocks_acquisitions_total",
            "distlocks_acquire_wait_seconds",
            "distlocks_hold_seconds",
        )
        return {
            "acquired": value(registry, acq, backend="redis", result="acquired"),
            "busy": value(registry, acq, backend="redis", result="not_acquired"),
            "waits": value(registry, f"{wait}_count", backend="redis", result="not_acquired"),
            "waited": value(registry, f"{wait}_sum", backend="redis", result="not_acquired"),
            "holds": value(registry, f"{hold}_count", backend="redis", outcome="released"),
        }

    before = now()
    with lock(name, backend="redis", ttl=30):
        with pytest.raises(LockNotAcquired):
            lock(name, backend="redis", timeout=0).acquire()
        with pytest.raises(LockNotAcquired):
            lock(name, backend="redis", timeout=0.2).acquire()
    after = now()
    assert after["acquired"] == before["acquired"] + 1
    assert after["busy"] == before["busy"] + 2
    assert after["waits"] == before["waits"] + 2
    # The second attempt waited out its whole timeout.
    assert after["waited"] - before["waited"] >= 0.2
    assert after["holds"] == before["holds"] + 1


def test_errors_lost_leases_and_force_releases(registry: CollectorRegistry, name: str) -> None:
    down = {
        "BACKEND": "distlocks.backends.redis.RedisBackend",
        "LOCATION": f"redis://127.0.0.1:{_closed_port()}/0",
    }
    with override_settings(DISTLOCKS_BACKENDS={**settings.DISTLOCKS_BACKENDS, "down": down}):
        with pytest.raises(LockBackendUnavailable):
            lock(name, backend="down", timeout=0).acquire()
    assert value(registry, "distlocks_acquisitions_total", backend="down", result="error") == 1
    assert value(registry, "distlocks_acquire_wait_seconds_count", backend="down", result="error")

    lease = lock(name, backend="locmem", ttl=30).acquire()
    livelocks.force_release("locmem", name, via="command")
    with pytest.raises(LockLost):
        lease.extend()
    assert value(registry, "distlocks_force_releases_total", backend="locmem", via="command") == 1
    assert value(registry, "distlocks_leases_lost_total", backend="locmem") == 1
    assert value(registry, "distlocks_hold_seconds_count", backend="locmem", outcome="lost") == 1


@pytest.mark.django_db
def test_fencing_rejections(registry: CollectorRegistry, pg_ready: None) -> None:
    from distlocks.exceptions import StaleFencingToken
    from tests.testapp.models import Account

    row = Account(owner="x", balance=1)
    row.save(fencing_token=10)
    row.balance = 2
    with pytest.raises(StaleFencingToken):
        row.save(fencing_token=5)
    assert value(registry, "distlocks_fencing_rejections_total", model="testapp.Account") == 1


def test_live_locks_collector(registry: CollectorRegistry, name: str) -> None:
    def live(backend: str, status: str) -> float:
        return value(registry, "distlocks_live_locks", backend=backend, status=status)

    before = live("locmem", "ok")
    leases = [lock(f"{name}:{i}", backend="locmem", ttl=30).acquire() for i in range(3)]
    try:
        assert live("locmem", "ok") == before + 3
        assert value(registry, "distlocks_backend_up", backend="locmem") == 1
        assert value(registry, "distlocks_oldest_lock_age_seconds", backend="locmem") > 0
        with override_settings(DISTLOCKS_STUCK_AFTER=0.000001):
            assert live("locmem", "stuck") >= 3
        down = {
            "BACKEND": "distlocks.backends.redis.RedisBackend",
            "LOCATION": f"redis://127.0.0.1:{_closed_port()}/0",
        }
        with override_settings(DISTLOCKS_BACKENDS={**settings.DISTLOCKS_BACKENDS, "down": down}):
            assert value(registry, "distlocks_backend_up", backend="down") == 0
            assert value(registry, "distlocks_backend_up", backend="locmem") == 1
    finally:
        for lease in leases:
            lease.release()
    assert live("locmem", "ok") == before


def test_renewal_lateness_and_turns(registry: CollectorRegistry, name: str) -> None:
    """Renewals a lease really went through show up as lateness quantiles and turns."""
    from distlocks import renewal
    from tests.waiting import wait_for

    def turns() -> float:
        return value(registry, "distlocks_renewal_turns_total", backend="redis")

    before = turns()
    with lock(name, backend="redis", ttl=0.6) as lease:  # renewed every 0.2 s
        wait_for(lambda: turns() >= before + 3, what="three renewal turns", limit=30)
        assert lease.held()
    p50 = value(registry, "distlocks_renewal_lateness_seconds", backend="redis", quantile="0.5")
    p99 = value(registry, "distlocks_renewal_lateness_seconds", backend="redis", quantile="0.99")
    assert 0.0 <= p50 <= p99
    # The registry reads the renewer itself (another test's lease may add turns since).
    assert before + 3 <= turns() <= renewal.lateness()["redis"]["turns"]


def test_enabled_by_the_setting_in_ready(rf: Any) -> None:
    from django.apps import apps

    from distlocks import metrics

    metrics.uninstall()
    try:
        with override_settings(DISTLOCKS_METRICS=False):
            apps.get_app_config("distlocks").ready()
        assert metrics.installed() is None
        with override_settings(DISTLOCKS_METRICS=True):
            apps.get_app_config("distlocks").ready()
        assert metrics.installed() is not None
        with lock("metrics-ready-test", backend="locmem"):
            pass
        body = metrics.metrics_view(rf.get("/metrics")).content.decode()
        assert 'distlocks_acquisitions_total{backend="locmem",result="acquired"}' in body
        assert 'distlocks_backend_up{backend="locmem"} 1.0' in body
    finally:
        metrics.uninstall()


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings"},
    )


def test_distlocks_works_without_prometheus_client() -> None:
    blocked = """
        import sys
        sys.modules["prometheus_client"] = None  # as if not installed
        import django
        from django.conf import settings
        import tests.settings as mod
        overrides = {k: getattr(mod, k) for k in dir(mod) if k.isupper()}
        overrides["DISTLOCKS_METRICS"] = {metrics}
        settings.configure(**overrides)
        try:
            django.setup()
        except Exception as exc:
            print(type(exc).__name__, exc)
        else:
            import distlocks, distlocks.admin, distlocks.livelocks
            from django.core.management import call_command
            call_command("distlocks", "list", "--backend", "locmem")
            print("ok")
    """
    off = _python(blocked.replace("{metrics}", "False"))
    assert off.returncode == 0, off.stderr
    assert off.stdout.strip().endswith("ok")
    on = _python(blocked.replace("{metrics}", "True"))
    assert "ImproperlyConfigured" in on.stdout, on.stdout + on.stderr
    assert "pip install 'distlocks[prometheus]'" in on.stdout
