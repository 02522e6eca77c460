"""The ``renewal`` workload: one process holds many short leases and must lose none.

Each distlocks backend row takes ``leases`` leases with ``ttl=2`` one after another,
holds them all for ``hold`` seconds while the process's renewer keeps them alive, and
then checks each. The samples are the renewals' lateness (how long after its due time
each renewal turn ran), so the table's median and p99 are lateness; ``ops`` is the
number of leases still held at the end. The parameters record the leases lost, the
server round trips the renewals took, and the CPU the process used while holding.

PostgreSQL's count is bounded by its pool: a session-mode lease pins one server
connection for as long as it is held (an advisory lock belongs to a session), so one
process holds at most ``OPTIONS["pool_size"]`` leases, within the server's
``max_connections``. The row raises the pool for the run and says so.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

from bench.base import Implementation, Measurement, RunOptions, Workload, workload

TTL = 2.0


@workload
class Renewal(Workload):
    name = "renewal"
    title = "Many leases held by one process (ttl=2 s), renewed in the background"
    metric = "latency"
    unit = "renewal turn (lateness)"
    description = (
        "One process takes N leases with ttl=2 s and holds them all for a while; the "
        "renewer must keep every one. Samples are how late each renewal turn ran against "
        "its schedule (a turn renews every lease due together); 'ops' is the leases "
        "still held at the end. Lost leases, the server round trips of the renewals and "
        "the CPU the process used while holding are in the parameters."
    )
    #: Leases per backend row (PostgreSQL: bounded by the pool, see the module doc).
    SIZES: ClassVar[dict[str, int]] = {"distlocks": 10_000, "distlocks-pg": 250}

    def __init__(self, options: RunOptions) -> None:
        super().__init__(options)
        self.hold = 1.5 if options.quick else 30.0  # quick: still two renewal turns (ttl/3)
        self.scale = 0.02 if options.quick else 1.0
        self.details: dict[str, dict[str, Any]] = {}

    @classmethod
    def supports(cls, impl: type[Implementation]) -> bool:
        return impl.name in cls.SIZES

    def params(self) -> dict[str, Any]:
        return {"rounds": self.rounds, "ttl_s": TTL, "hold_s": self.hold, **self.details}

    def warm_up(self, impl: Implementation) -> None:
        pass  # the leases are taken before the timed hold; nothing to warm

    def measure(self, impl: Implementation, round_no: int) -> Measurement:
        from distlocks import lock, renewal
        from distlocks.handler import backends

        alias = getattr(impl, "alias", "default")
        count = max(10, int(self.SIZES[impl.name] * self.scale))
        backend = backends[alias]
        restore = None
        if alias != "default":
            # One pinned connection per lease: the pool must hold them all.
            restore = dict(backend.options)
            backend.options["pool_size"] = count + 5
            backend.close()
        prefix = f"bench:{impl.name}:renewal:{round_no}:"
        leases = []
        taking = time.monotonic()
        try:
            for i in range(count):
                leases.append(lock(f"{prefix}{i}", backend=alias, ttl=TTL, timeout=0).acquire())
            took = time.monotonic() - taking
            renewer = renewal.renewer(alias)
            renewer.late.clear()
            turns = renewer.turns
            calls = _server_calls(impl, alias)
            cpu = time.process_time()
            started = time.monotonic()
            time.sleep(self.hold)  # the measured thing is what happens meanwhile
            seconds = time.monotonic() - started
            cpu = time.process_time() - cpu
            after = _server_calls(impl, alias)
            calls = None if calls is None or after is None else after - calls
            turns = renewer.turns - turns
            late = list(renewer.late)
            held = sum(1 for lease in leases if lease.held())
        finally:
            for lease in leases:
                lease.release()
            if restore is not None:
                backend.options.clear()
                backend.options.update(restore)
                backend.close()
        self.details[impl.name] = {
            "leases": count,
            "taken_in_s": round(took, 2),
            "lost": count - held,
            "renewal_turns": turns,
            "server_calls_while_holding": calls,
            # Renewals due meanwhile: every lease every ttl/3.
            "server_calls_per_lease_renewal": (
                None if calls is None else round(calls / (count * seconds / (TTL / 3)), 4)
            ),
            "cpu_fraction_of_a_core": round(cpu / seconds, 3),
        }
        return Measurement([int(x * 1e9) for x in late], held, seconds)


def _server_calls(impl: Implementation, alias: str) -> int | None:
    """Scripts the Redis server has run so far, to count the renewals' round trips.
    None on PostgreSQL: each lease is confirmed on its own pinned connection, one
    statement per lease per renewal (nothing to batch: the connections differ)."""
    from distlocks.handler import backends

    if impl.name != "distlocks":
        return None
    stats = backends[alias].client.info("commandstats")
    return sum(int(v.get("calls", 0)) for k, v in stats.items() if k.startswith("cmdstat_eval"))
