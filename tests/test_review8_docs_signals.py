"""docs/operations.md's Signals section, run as written: its receiver block connects to
``lock_lost`` and logs a lease that ran out, with the arguments the section names."""

from __future__ import annotations

import logging
import re
import uuid
from pathlib import Path

import pytest

from distlocks import lock, signals
from tests.waiting import wait_for

OPERATIONS = Path(__file__).resolve().parents[1] / "docs" / "operations.md"


def test_the_receiver_block_runs_and_hears_a_loss(caplog: pytest.LogCaptureFixture) -> None:
    section = OPERATIONS.read_text().split("\n## Signals\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"^```python\n(.*?)^```", section, re.S | re.M)
    namespace: dict[str, object] = {"__name__": "docs_operations_signals"}
    exec(compile(block, str(OPERATIONS), "exec"), namespace)
    receiver = namespace["page_someone"]
    try:
        name = f"docs-signals-{uuid.uuid4().hex}"
        with caplog.at_level(logging.ERROR, logger="locks"):
            lease = lock(name, backend="locmem", ttl=0.3, auto_renew=False).acquire()

            # Without renewal the loss is found at the holder's next look at the lease.
            def told() -> bool:
                if lease.held():
                    return False
                return any(r.name == "locks" and name in r.getMessage() for r in caplog.records)

            wait_for(
                told,
                limit=30,
                what="the receiver's log line",
            )
        (record,) = [r for r in caplog.records if r.name == "locks"]
        assert str(lease.fencing_token) in record.getMessage()
        assert "ran out" in record.getMessage()  # the reason, as the section says
    finally:
        signals.lock_lost.disconnect(receiver)
