"""Where a ``single_execution`` task spends its time: ``python -m bench.profile_celery``.

A companion of the Celery workloads (:mod:`bench.celery_overhead`), for the
analysis in docs/benchmarks.md. On the same kind of throwaway Redis as
``python -m bench`` it:

1. counts the Redis commands of one task of each kind, run side (``apply()``)
   and enqueue side (``apply_async()``), from the server's ``INFO commandstats``
   (a count does not depend on the machine), and the round trips (requests sent,
   a pipeline being one) per run, per enqueue and per ``celery-cycle``;
2. times the pieces of a ``single_execution`` run, interleaved in blocks, wall
   clock and the client thread's CPU time per call: the key alone, the run lock's
   acquire + release alone (``Lock`` and ``finish_lease``, as the task does), the
   marker release the run does with ``unique_while``, and whole tasks; then splits
   each run and each cycle into the time spent inside the lock server's calls
   (packing, round trip, the scripts' server work) and the rest (Python, the
   broker), the rest also as its excess over a plain task's;
3. counts the Python function calls of one run of each kind (``cProfile``) and
   lists distlocks' functions by cumulative time;
4. splits a ``celery-cycle`` of each kind into its requests to Redis (a pipeline is
   one; scripts by name): per task, the wall time from the send to the last reply
   (medians, interleaved blocks), and the server's time for each command (its
   ``SLOWLOG``, every command logged: what the server spent, the round trip aside).

Nothing is asserted; the figures are printed.
"""

from __future__ import annotations

import argparse
import itertools
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

from bench.profile_save import _by_function, _calls_per_save, _timed

Layer = tuple[str, Callable[[], None]]
#: The profiler's own commands, and connection set-up.
_IGNORED = frozenset({"info", "config", "client", "hello"})


def _setup() -> list[Any]:
    """Start Redis and Django as ``python -m bench`` does; one instance per Celery row."""
    from bench.celery_overhead import CeleryTask
    from bench.registry import IMPLEMENTATIONS, Env, Implementation, load_registry
    from bench.run import _start

    load_registry()
    classes: list[type[Implementation]] = [
        cls for cls in IMPLEMENTATIONS.values() if issubclass(cls, CeleryTask)
    ]
    _start(classes)
    env = Env.from_environ()
    return [cls(env) for cls in classes]


def _numbered(call: Callable[..., Any], counter: Iterator[int]) -> Callable[[], None]:
    """``call(args=(n,))`` with a new ``n`` every time, so no call is a duplicate."""

    def numbered() -> None:
        call(args=(next(counter),))

    return numbered


def _once(call: Callable[..., Any]) -> Callable[[], None]:
    """``call(args=(1,))``: the same key every time, as a run-side loop may use."""

    def same() -> None:
        call(args=(1,))

    return same


def _commands(client: Any, call: Callable[[], None], count: int) -> dict[str, float]:
    """Redis commands per call of ``call`` (the server's own count)."""
    client.config_resetstat()
    for _ in range(count):
        call()
    stats = client.info("commandstats")
    per_call = {}
    for key, value in stats.items():
        command = key.removeprefix("cmdstat_")
        if command not in _IGNORED:
            per_call[command] = value["calls"] / count
    return dict(sorted(per_call.items()))


def _round_trips(call: Callable[[], None], count: int) -> float:
    """Requests this thread sends to Redis per call of ``call`` (the benchmark's locks
    and broker are one server). A pipeline of several commands is one request, one
    round trip; the server's command count cannot tell them apart."""
    import threading

    from redis.connection import AbstractConnection

    original = AbstractConnection.send_packed_command
    thread = threading.get_ident()
    sent = [0]

    def counted(conn: Any, command: Any, check_health: bool = True) -> None:
        if threading.get_ident() == thread:
            sent[0] += 1
        original(conn, command, check_health)

    call()  # connected, scripts loaded: what is counted is the steady state
    AbstractConnection.send_packed_command = counted  # type: ignore[method-assign]
    try:
        for _ in range(count):
            call()
    finally:
        AbstractConnection.send_packed_command = original  # type: ignore[method-assign]
    return sent[0] / count


#: A request's commands: each a RESP array (``*<n>``), the first after a CRLF or at
#: the start; a script's SHA-1 follows ``EVALSHA`` as a 40-byte bulk string.
_COMMAND = re.compile(rb"(?:^|\r\n)\*\d+\r\n\$\d+\r\n([A-Za-z]+)\r\n(?:\$40\r\n([0-9a-f]{40}))?")


def _script_names() -> dict[str, str]:
    """SHA-1 -> name of the scripts a Celery task's calls run."""
    import hashlib

    from distlocks.backends.redis.scripts import SCRIPTS
    from distlocks.contrib import celery_redis

    names = {hashlib.sha1(text.encode()).hexdigest(): name for name, text in SCRIPTS.items()}
    names[celery_redis.ENQUEUE.sha] = "enqueue"
    names[celery_redis.FOLD.sha] = "fold"
    names[celery_redis.RUN_START.sha] = "run_start"
    return names


class _Requests:
    """Wall time of this thread's requests to Redis, from the send to the last reply,
    by what they carry ("EVALSHA acquire+EVALSHA release" for a pipeline of two)."""

    def __init__(self, names: dict[str, str]) -> None:
        import threading

        self.names = names
        self.label: str | None = None  # the implementation measured; None: not recorded
        self.walls: dict[str, dict[str, list[int]]] = {}
        self._pending: dict[int, tuple[str, int, int]] = {}
        self._thread = threading.get_ident()

    def __enter__(self) -> _Requests:
        import threading
        import time

        from redis.connection import AbstractConnection

        self._originals = (AbstractConnection.send_packed_command, AbstractConnection.read_response)
        send, read = self._originals

        def sent(conn: Any, command: Any, check_health: bool = True) -> None:
            if threading.get_ident() == self._thread and self.label is not None:
                data = command if isinstance(command, bytes) else b"".join(command)
                found = _COMMAND.findall(data)
                what = "+".join(
                    f"{name.decode().upper()} {self.names.get(sha.decode(), sha.decode()[:8])}"
                    if sha else name.decode().upper()
                    for name, sha in found
                )  # fmt: skip
                self._pending[id(conn)] = (what or "?", len(found) or 1, time.perf_counter_ns())
            send(conn, command, check_health)

        def replied(conn: Any, *args: Any, **kwargs: Any) -> Any:
            reply = read(conn, *args, **kwargs)
            pending = self._pending.get(id(conn))
            if pending is not None and threading.get_ident() == self._thread:
                what, left, began = pending
                if left > 1:
                    self._pending[id(conn)] = (what, left - 1, began)
                else:
                    del self._pending[id(conn)]
                    if self.label is not None:
                        by_what = self.walls.setdefault(self.label, {})
                        by_what.setdefault(what, []).append(time.perf_counter_ns() - began)
            return reply

        AbstractConnection.send_packed_command = sent  # type: ignore[method-assign]
        AbstractConnection.read_response = replied  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        from redis.connection import AbstractConnection

        send, read = self._originals
        AbstractConnection.send_packed_command = send  # type: ignore[method-assign]
        AbstractConnection.read_response = read  # type: ignore[method-assign]


def _server_times(client: Any, names: dict[str, str], into: dict[str, list[int]]) -> None:
    """The server's time (us) of each command in its SLOWLOG, by command (scripts by
    name), added to ``into``; the log is emptied."""
    for entry in client.slowlog_get(1_000_000):
        words = [w.decode() if isinstance(w, bytes) else str(w) for w in entry["command"].split()]
        if not words or words[0].upper() in ("SLOWLOG", "INFO", "CONFIG", "CLIENT", "HELLO"):
            continue
        what = words[0].upper()
        if what == "EVALSHA" and len(words) > 1:
            what += " " + names.get(words[1], words[1][:8])
        into.setdefault(what, []).append(int(entry["duration"]))
    client.slowlog_reset()


def _requests_of_cycles(
    impls: list[Any], client: Any, counter: Iterator[int], blocks: int, per_block: int
) -> None:
    """Print, per implementation, the requests of one ``celery-cycle``: how many per
    task, their median wall time, and the server's median time for each command."""
    import statistics

    from bench.celery_overhead import _purge

    names = _script_names()
    cycles = [(impl, _cycle(impl, counter)) for impl in impls]
    for _impl, cycle in cycles:  # warm-up: connected, scripts loaded
        for _ in range(20):
            cycle()
    server: dict[str, dict[str, list[int]]] = {impl.name: {} for impl in impls}
    slow = client.config_get("slowlog-log-slower-than")["slowlog-log-slower-than"]
    length = client.config_get("slowlog-max-len")["slowlog-max-len"]
    client.config_set("slowlog-log-slower-than", 0)
    client.config_set("slowlog-max-len", 100_000)
    try:
        with _Requests(names) as requests:
            for block in range(blocks):
                shift = block % len(cycles)
                for impl, cycle in cycles[shift:] + cycles[:shift]:
                    client.slowlog_reset()
                    requests.label = impl.name
                    for _ in range(per_block):
                        cycle()
                    requests.label = None
                    _server_times(client, names, server[impl.name])
    finally:
        client.config_set("slowlog-log-slower-than", slow)
        client.config_set("slowlog-max-len", length)
        for impl in impls:
            _purge(impl.app)
            impl.delete_markers()
    tasks = blocks * per_block
    for impl in impls:
        print(f"{impl.name}")
        walls = requests.walls.get(impl.name, {})
        total = 0.0
        for what, times in sorted(walls.items(), key=lambda item: -len(item[1])):
            median = statistics.median(times) / 1000
            total += median * len(times) / tasks
            print(f"    {len(times) / tasks:5.2f} x {what:46} {median:8.1f} us wall")
        print(f"    {'':5}   {'requests of a task, in all':46} {total:8.1f} us wall")
        for what, times in sorted(server[impl.name].items(), key=lambda item: -len(item[1])):
            count = len(times) / tasks
            print(f"    {count:5.2f} x {what:46} {statistics.median(times):8.1f} us on the server")


def _cycle(impl: Any, counter: Iterator[int]) -> Callable[[], None]:
    """Enqueue, fetch and run one task as ``celery-cycle`` does."""
    from celery.worker.request import Request

    from bench.celery_names import QUEUE

    app, task = impl.app, impl.task
    channel = app.connection_for_read().default_channel

    def cycle() -> None:
        task.apply_async(args=(next(counter),))
        message = channel.basic_get(QUEUE, no_ack=True)
        Request(message, app=app, task=task, hostname="distlocks-bench").execute()

    return cycle


class _InLockCalls:
    """Wall time this thread spends inside the lock server's calls (the pinned
    connection's scripts and the calls sent together): packing, the round trip and
    the server's work, as opposed to the rest of a task's time (Python, the broker)."""

    def __init__(self, backend: Any) -> None:
        import threading

        from distlocks.contrib import celery_redis

        self.total = 0
        self._thread = threading.get_ident()
        self._patched = [
            (type(backend), "_run_direct", type(backend)._run_direct),
            (celery_redis, "send_together", celery_redis.send_together),
        ]

    def __enter__(self) -> _InLockCalls:
        import threading
        import time

        for owner, attr, original in self._patched:

            def timed(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                if threading.get_ident() != self._thread:
                    return _original(*args, **kwargs)
                began = time.perf_counter_ns()
                try:
                    return _original(*args, **kwargs)
                finally:
                    self.total += time.perf_counter_ns() - began

            setattr(owner, attr, timed)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, attr, original in self._patched:
            setattr(owner, attr, original)


def _split(
    layers: list[Layer], backend: Any, blocks: int, per_block: int
) -> dict[str, tuple[float, float]]:
    """Median per call, over blocks rotated like :func:`_timed`'s: (wall us, of which
    inside the lock server's calls)."""
    import statistics
    import time

    walls: dict[str, list[float]] = {name: [] for name, _ in layers}
    inside: dict[str, list[float]] = {name: [] for name, _ in layers}
    for _name, call in layers:  # warm-up
        for _ in range(50):
            call()
    with _InLockCalls(backend) as calls:
        for block in range(blocks):
            shift = block % len(layers)
            for name, call in layers[shift:] + layers[:shift]:
                calls.total = 0
                began = time.perf_counter_ns()
                for _ in range(per_block):
                    call()
                walls[name].append((time.perf_counter_ns() - began) / per_block / 1000)
                inside[name].append(calls.total / per_block / 1000)
    return {
        name: (statistics.median(walls[name]), statistics.median(inside[name]))
        for name, _ in layers
    }


def _format(commands: dict[str, float]) -> str:
    return ", ".join(f"{name} {count:g}" for name, count in commands.items()) or "none"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_celery", description=__doc__)
    parser.add_argument("--blocks", type=int, default=20, help="interleaved blocks (20)")
    parser.add_argument("--per-block", type=int, default=200, help="calls per block (200)")
    parser.add_argument("--profiled", type=int, default=1000, help="runs profiled (1000)")
    parser.add_argument("--top", type=int, default=15, help="functions listed (15)")
    args = parser.parse_args(argv)

    from bench.celery_overhead import _purge

    impls = _setup()
    by_name = {impl.name: impl for impl in impls}
    client = impls[0].client
    counter = itertools.count()
    try:
        print("== Redis commands per task (INFO commandstats; the broker is the same server)\n")
        for impl in impls:
            if "celery-run" in impl.workloads:
                run = _commands(client, _numbered(impl.task.apply, counter), 200)
                print(f"{impl.name:22} run:     {_format(run)}")
            enqueue = _commands(client, _numbered(impl.task.apply_async, counter), 200)
            _purge(impl.app)
            impl.delete_markers()
            print(f"{impl.name:22} enqueue: {_format(enqueue)}")
            cycle = _commands(client, _cycle(impl, counter), 200)
            print(f"{impl.name:22} cycle:   {_format(cycle)}")
            # A script's commands are counted with it: the server's work per task is
            # about one unit per script and per command inside it.
            scripts = cycle.get("evalsha", 0.0)
            inside = sum(cycle.values()) - scripts
            print(f"{'':22}          {scripts:g} scripts, {inside:g} other commands (theirs too)")

        from distlocks import get_backend
        from distlocks.locks import Lock, finish_lease

        print("\n== Round trips to Redis per task (locks and broker: one server)\n")
        print(f"{'implementation':22} {'run':>10} {'enqueue':>10} {'cycle':>10}")
        for impl in impls:
            run = "-"
            if "celery-run" in impl.workloads:
                run = f"{_round_trips(_numbered(impl.task.apply, counter), 100):.2f}"
            enqueue = f"{_round_trips(_numbered(impl.task.apply_async, counter), 100):.2f}"
            _purge(impl.app)
            impl.delete_markers()
            cycle = f"{_round_trips(_cycle(impl, counter), 100):.2f}"
            print(f"{impl.name:22} {run:>10} {enqueue:>10} {cycle:>10}")

        single = by_name["celery-single"].task
        backend = get_backend("default")
        name = single.lock_name((1,))

        def run_lock() -> None:
            lease = Lock(name, backend="default", ttl=single._single.lease_ttl).acquire(timeout=0)
            finish_lease(lease, body_failed=False)

        def release_marker() -> None:
            backend.release_quietly(name + ":queued", "celery-task:none")

        def bump() -> None:
            pass

        from celery import Task

        from bench.celery_tasks import _trivial

        class PassThrough(Task):
            """A task class whose ``__call__`` only calls Celery's: the tracer then goes
            through ``Task.__call__`` (request stack) as it does for single_execution."""

            def __call__(self, *args: Any, **kwargs: Any) -> Any:
                return super().__call__(*args, **kwargs)

        app = by_name["celery-plain"].app
        pass_through = app.task(name="bench.celery.profile_pass_through", base=PassThrough)(
            _trivial
        )
        ttl = single._single.lease_ttl

        def locked_body(n: int) -> int:
            with Lock(name, backend="default", ttl=ttl, timeout=0):
                return n

        # The run lock written by hand: the same lock() cycle as "run lock" below, run
        # inside Celery's tracer. The cycle alone, in a tight loop, is no yardstick for
        # a task: the same calls cost more inside a task's apply() (measured 70-110 us
        # more), single_execution or not.
        hand_locked = app.task(name="bench.celery.profile_hand_locked")(locked_body)

        layers: list[Layer] = [
            ("plain task.apply()", _once(by_name["celery-plain"].task.apply)),
            ("plain task, pass-through __call__", _once(pass_through.apply)),
            ("plain task whose body takes lock()", _once(hand_locked.apply)),
            ("key: lock_name((n,))", lambda: single.lock_name((next(counter),))),
            ("run lock: Lock.acquire + finish_lease", run_lock),
            ("marker release at run start (release_quietly)", release_marker),
            ("single_execution task.apply()", _once(single.apply)),
            (
                "single_execution(unique_while) task.apply()",
                _once(by_name["celery-single-unique"].task.apply),
            ),
        ]
        sizes = f"{args.blocks} blocks of {args.per_block}, medians"
        print(f"\n== Run side, layer by layer ({sizes})\n")
        results = _timed(layers, args.blocks, args.per_block, bump)
        base_wall, base_cpu = results["plain task.apply()"]
        print(f"{'what runs':50} {'wall us':>9} {'client CPU us':>14} {'wall - plain':>13}")
        for title, (wall, cpu) in results.items():
            print(f"{title:50} {wall:9.1f} {cpu:14.1f} {wall - base_wall:13.1f}")
        print(f"(plain task.apply() client CPU: {base_cpu:.1f} us)")

        split_layers: list[Layer] = [
            (f"{impl.name} run", _numbered(impl.task.apply, counter))
            for impl in impls
            if "celery-run" in impl.workloads
        ] + [(f"{impl.name} cycle", _cycle(impl, counter)) for impl in impls]
        print(f"\n== Where the time goes: inside the lock server's calls or not ({sizes})\n")
        split = _split(split_layers, backend, args.blocks, args.per_block)
        for impl in impls:
            _purge(impl.app)
            impl.delete_markers()
        plain_run = split["celery-plain run"]
        plain_cycle = split["celery-plain cycle"]
        print(
            f"{'what runs':34} {'wall us':>9} {'in lock calls':>14} {'rest':>9} "
            f"{'rest - plain':>13}"
        )
        print("(the peers' own Redis calls are not distlocks' lock calls: they are in 'rest')")
        for title, (wall, lock_calls) in split.items():
            plain = plain_run if title.endswith(" run") else plain_cycle
            rest = wall - lock_calls
            print(
                f"{title:34} {wall:9.1f} {lock_calls:14.1f} {rest:9.1f} "
                f"{rest - (plain[0] - plain[1]):13.1f}"
            )

        enqueue_layers: list[Layer] = [
            (impl.name, _numbered(impl.task.apply_async, counter))
            for impl in impls
            if "celery-enqueue" in impl.workloads
        ]
        print(f"\n== Enqueue side ({sizes})\n")
        results = _timed(enqueue_layers, args.blocks, args.per_block, bump)
        for impl in impls:
            _purge(impl.app)
            impl.delete_markers()
        print(f"{'implementation':50} {'wall us':>9} {'client CPU us':>14}")
        for title, (wall, cpu) in results.items():
            print(f"{title:50} {wall:9.1f} {cpu:14.1f}")

        print(f"\n== Python function calls per run (cProfile, {args.profiled} runs)\n")
        for impl in impls:
            if "celery-run" not in impl.workloads:
                continue
            per_run, stats = _calls_per_save(_once(impl.task.apply), args.profiled)
            print(f"{impl.name:22} {per_run:7.0f} calls per run")
            if impl.name == "celery-single":
                functions = _by_function(stats, args.profiled)
                ours = [(key, value) for key, value in functions.items() if "distlocks/" in key]
                ours.sort(key=lambda item: -item[1][2])
                print("  distlocks functions by cumulative time (calls, own us, cumulative us):")
                for key, (calls, own, cumulative) in ours[: args.top]:
                    print(f"    {calls:5.1f} {own:7.1f} {cumulative:8.1f}  {key}")

        print(f"\n== The requests of a celery-cycle, by command ({sizes})\n")
        print("(wall: from the send to the last reply, a pipeline being one request; on the")
        print("server: its SLOWLOG, every command logged; a script's time has its commands in it)")
        _requests_of_cycles(impls, client, counter, args.blocks, args.per_block)
    finally:
        for impl in impls:
            impl.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
