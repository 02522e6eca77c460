"""Where a ZooKeeper hand-off spends its time, and how many requests it sends:
``python -m bench.profile_zk [--waiters N] [--handoffs N] [--rounds N]``.

A companion of the ``zk-handoff`` workload (:mod:`bench.zookeeper`), for the analysis
in docs/benchmarks.md. It starts a throwaway standalone ZooKeeper as ``python -m bench``
does, then runs the hand-off of that workload (``--waiters`` threads waiting on one
lock, one holding it 1 ms, a sample from the start of ``release()`` to the return of
the next acquire) with the benchmark's own ``zk-floor``, ``distlocks-zk`` and ``kazoo``
implementations, interleaved round by round (the order rotating each round), and
prints for each:

* the median hand-off and its ratio to the floor's of the same round;
* the requests sent per hand-off, by type (every request of the run, the queueing of
  the next waiter included, divided by the hand-offs), counted where kazoo queues them
  (``KazooClient._call``; pings do not go through it);
* the most frequent sequence of events inside a sample, with the median time from
  each event to the next: a request sent (by its type), its reply (``reply-...``, for
  listings and deletes), a watch notification read off the socket (``watch-read``)
  and its callback run on kazoo's event thread (``watch-run``), and ``granted``.

The threads of one implementation share one kazoo client (one session), as in the
benchmark. Nothing is asserted; the figures are printed. On a loaded machine compare
only the ratios of one run, over several runs.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from bench.base import ZOOKEEPER_ENV, Env, Implementation
from bench.workloads import TTL

#: Events inside one sample: (time in ns, what).
_Log = list[tuple[int, str]]


def _record(client: Any, log: _Log) -> None:
    """Log every request ``client`` sends, the replies of listings and deletes, and the
    watch notifications (read, then run), in ``log``. The requests go to the server
    unchanged."""
    call = client._call

    def logged_call(request: Any, async_object: Any) -> Any:
        kind = type(request).__name__
        log.append((time.perf_counter_ns(), kind))
        if kind.startswith(("GetChildren", "Delete")):
            settle = async_object.set

            def logged_set(value: Any = None, settle: Any = settle, kind: str = kind) -> None:
                log.append((time.perf_counter_ns(), f"reply-{kind}"))
                settle(value)

            async_object.set = logged_set
        return call(request, async_object)

    client._call = logged_call
    dispatch = client.handler.dispatch_callback

    def logged_dispatch(callback: Any) -> Any:
        if callback.type == "watch":
            log.append((time.perf_counter_ns(), "watch-read"))
            func = callback.func

            def run(*args: Any, func: Callable[..., Any] = func) -> Any:
                log.append((time.perf_counter_ns(), "watch-run"))
                return func(*args)

            callback = type(callback)(callback.type, run, callback.args)
        return dispatch(callback)

    client.handler.dispatch_callback = logged_dispatch


def _client_of(impl: Implementation) -> Any:
    client = getattr(impl, "client", None)
    if client is None:  # distlocks: the backend's own kazoo client
        from distlocks.handler import backends

        client = backends["zk"]._ready("profile", "hand-off")
    return client


def _hand_offs(impl: Implementation, name: str, waiters: int, count: int) -> list[tuple[int, int]]:
    """``count`` hand-offs among ``waiters + 1`` threads: (release started, granted)."""
    cond = threading.Condition()
    state: dict[str, Any] = {"released": None, "grants": 0, "done": False, "samples": []}
    errors: list[BaseException] = []

    def participant() -> None:
        try:
            impl.thread_start()
            while True:
                with cond:
                    if state["done"]:
                        return
                handle = impl.acquire_blocking(name, TTL, 10.0)
                granted = time.perf_counter_ns()
                if handle is None:
                    raise RuntimeError(f"{impl.name}: no grant within 10 s")
                with cond:
                    if state["released"] is not None and not state["done"]:
                        state["samples"].append((state["released"], granted))
                    state["released"] = None
                    state["grants"] += 1
                    grant = state["grants"]
                    state["done"] = state["done"] or len(state["samples"]) >= count
                    done = state["done"]
                    cond.notify_all()
                if done:
                    impl.release_contended(handle)
                    return
                time.sleep(0.05 if grant == 1 else 0.001)
                with cond:
                    state["released"] = time.perf_counter_ns()
                impl.release_contended(handle)
                with cond:
                    cond.wait_for(lambda grant=grant: state["grants"] > grant or state["done"])
        except BaseException as exc:
            errors.append(exc)
            with cond:
                state["done"] = True
                cond.notify_all()
        finally:
            impl.thread_done()

    threads = [threading.Thread(target=participant, daemon=True) for _ in range(waiters + 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    if errors:
        raise errors[0]
    return list(state["samples"])


def _stages(samples: list[tuple[int, int]], log: _Log) -> tuple[int, str]:
    """The most frequent sequence of events inside a sample, with median gaps (us)."""
    log = sorted(log)
    sequences: dict[tuple[str, ...], list[list[float]]] = collections.defaultdict(list)
    for began, granted in samples:
        events = [(t, what) for t, what in log if began <= t <= granted]
        events.append((granted, "granted"))
        gaps, before = [], began
        for t, _ in events:
            gaps.append((t - before) / 1000)
            before = t
        sequences[tuple(what for _, what in events)].append(gaps)
    kinds, rows = max(sequences.items(), key=lambda item: len(item[1]))
    medians = [statistics.median(column) for column in zip(*rows, strict=True)]
    text = " > ".join(f"{what} +{gap:.0f}" for what, gap in zip(kinds, medians, strict=True))
    return len(rows), text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_zk", description=__doc__)
    parser.add_argument("--waiters", type=int, default=16)
    parser.add_argument("--handoffs", type=int, default=200, help="per round")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)

    from bench.zookeeper import missing, start_server

    why = missing()
    if why:
        raise SystemExit(f"cannot run: {why}")
    server = start_server()
    try:
        os.environ[ZOOKEEPER_ENV] = server.location
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
        import django

        django.setup()
        from bench.zookeeper import DistlocksZk, KazooLock, ZkFloor

        env = Env.from_environ()
        impls: list[Implementation] = [ZkFloor(env), DistlocksZk(env), KazooLock(env)]
        logs: dict[str, _Log] = {impl.name: [] for impl in impls}
        for impl in impls:
            _hand_offs(impl, f"profile:{impl.name}:warm", args.waiters, 20)
            _record(_client_of(impl), logs[impl.name])
        medians: dict[str, list[float]] = collections.defaultdict(list)
        samples: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
        load = os.getloadavg()[0]
        for round_no in range(args.rounds):
            order = impls[round_no % len(impls) :] + impls[: round_no % len(impls)]
            for impl in order:
                got = _hand_offs(impl, f"profile:{impl.name}", args.waiters, args.handoffs)
                samples[impl.name].extend(got)
                medians[impl.name].append(statistics.median(b - a for a, b in got) / 1000)
        floor = medians[impls[0].name]
        print(
            f"{args.waiters} waiters, {args.rounds} rounds of {args.handoffs} hand-offs; "
            f"load average {load:.1f} -> {os.getloadavg()[0]:.1f}"
        )
        for impl in impls:
            mine = medians[impl.name]
            ratios = [m / f for m, f in zip(mine, floor, strict=True)]
            counted = collections.Counter(
                what for _, what in logs[impl.name] if not what.startswith(("reply-", "watch-"))
            )
            handoffs = len(samples[impl.name]) or 1
            per = ", ".join(f"{what} {n / handoffs:.2f}" for what, n in counted.most_common())
            print(
                f"{impl.name:13} median {statistics.median(mine):7.0f} us, x floor "
                f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}); "
                f"requests/hand-off {sum(counted.values()) / handoffs:.2f}: {per}"
            )
            seen, text = _stages(samples[impl.name], logs[impl.name])
            print(f"    {seen} of {handoffs}: {text}")
        for impl in impls:
            impl.close()
    finally:
        server.close()


if __name__ == "__main__":
    main()
