"""Review 8 of the ZooKeeper tokens (the fence node's version): the end of the 32-bit
version, on a real server.

A node's version is a Java int that ZooKeeper increments with no check: the write after
2**31 - 1 makes -2**31, and a conditional write at version -1 is no condition at all
(-1 means "any version"). Tokens read as ``ctime * 1000 + version`` then fell by 2**32 at
the 2**31st grant of a name (a hot lock at 100 grants a second gets there in eight
months), and a paused old holder's writes were accepted again. Two billion writes are too
many for a test: the server is stopped, its snapshot edited with ZooKeeper's own classes
(compiled here with javac; skipped without it) to put the fence node's version just
below a boundary, and started again."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from distlocks import get_backend, lock, rwlock
from distlocks.exceptions import LockError, LockNotAcquired
from distlocks.handler import backends
from distlocks.testing.zookeeper_server import ZOOKEEPER_JAR, ZooKeeperServer, zookeeper_missing

pytestmark = [
    pytest.mark.skipif(bool(zookeeper_missing()), reason=zookeeper_missing()),
    pytest.mark.skipif(
        shutil.which("javac") is None, reason="javac (a JDK) edits the ZooKeeper snapshot"
    ),
]

BACKEND = "distlocks.backends.zookeeper.ZooKeeperBackend"
ALIAS = "zkver"

SET_VERSION = """
import java.io.File;
import java.util.concurrent.ConcurrentHashMap;
import org.apache.zookeeper.server.DataNode;
import org.apache.zookeeper.server.DataTree;
import org.apache.zookeeper.server.persistence.FileTxnSnapLog;

public class SetVersion {
    public static void main(String[] args) throws Exception {
        File dir = new File(args[0]);
        FileTxnSnapLog log = new FileTxnSnapLog(dir, dir);
        DataTree tree = new DataTree();
        ConcurrentHashMap<Long, Integer> sessions = new ConcurrentHashMap<>();
        log.restore(tree, sessions, (header, record, digest) -> { });
        DataNode node = tree.getNode(args[1]);
        synchronized (node) {
            node.stat.setVersion(Integer.parseInt(args[2]));
        }
        log.save(tree, sessions, true);
        log.close();
    }
}
"""


def _classpath(extra: Path | None = None) -> str:
    jars = [ZOOKEEPER_JAR, *ZOOKEEPER_JAR.parent.glob("zookeeper-jute*.jar")]
    jars += [*ZOOKEEPER_JAR.parent.glob("slf4j-api*.jar")]
    return ":".join([str(extra)] * bool(extra) + [str(jar) for jar in jars])


@pytest.fixture(scope="module")
def set_version(tmp_path_factory: pytest.TempPathFactory) -> Path:
    build = tmp_path_factory.mktemp("setversion")
    (build / "SetVersion.java").write_text(SET_VERSION)
    subprocess.run(
        ["javac", "-cp", _classpath(), "-d", str(build), str(build / "SetVersion.java")],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return build


@pytest.fixture
def zk_server() -> Iterator[ZooKeeperServer]:
    server = ZooKeeperServer().start()
    yield server
    server.close()


def edit_version(server: ZooKeeperServer, build: Path, path: str, version: int) -> None:
    """Stop the server, set ``path``'s version in its data, start it on its port."""
    backends.reset()  # no client reconnecting into the restart
    port = server.port
    server.kill()
    subprocess.run(
        ["java", "-cp", _classpath(build), "SetVersion", str(server.base_dir / "data"), path,
         str(version)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    server.start(port=port)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lock", "write"])
@pytest.mark.parametrize("start", [2**31 - 3, -4])
def test_tokens_never_fall_at_the_end_of_the_fence_nodes_version(
    settings: Any, zk_server: ZooKeeperServer, set_version: Path, kind: str, start: int
) -> None:
    """Grants across the version's wrap (2**31 - 1 to -2**31) and up to -1 (where a
    conditional write is none): each token above the one before, or the grant refused
    with an error that says what to do; never a lower token, and the counter agrees."""
    settings.DISTLOCKS_BACKENDS = {
        **settings.DISTLOCKS_BACKENDS,
        ALIAS: {"BACKEND": BACKEND, "LOCATION": zk_server.location,
                "OPTIONS": {"session_timeout": 10, "connect_timeout": 10}},
    }  # fmt: skip
    name = f"review8:versions:{uuid.uuid4().hex[:8]}"

    def grant() -> int:
        if kind == "lock":
            with lock(name, backend=ALIAS, ttl=10, timeout=30, auto_renew=False) as lease:
                return lease.fencing_token
        with rwlock(name, backend=ALIAS).write(ttl=10, timeout=30, auto_renew=False) as lease:
            return lease.fencing_token

    first = grant()
    backend = get_backend(ALIAS)
    path = backend.lock_path(name) if kind == "lock" else backend.permit_dir("write", name)
    edit_version(zk_server, set_version, path, start)
    backend = get_backend(ALIAS)
    counter = backend.fencing_counter if kind == "lock" else backend.permit_counter
    tokens = [first]
    refused = []
    for _ in range(5):
        try:
            tokens.append(grant())
        except LockNotAcquired:
            raise  # not a refusal: the lock is free (a failure of this test)
        except LockError as exc:
            refused.append(str(exc))
            continue
        assert counter(name) == tokens[-1]
    assert tokens == sorted(set(tokens)), tokens
    if start < 0:
        # -4: grants write -3, -2 and -1; then -1 is listed: refused from there on.
        assert len(tokens) == 4 and len(refused) == 2, (tokens, refused)
        assert "delete" in refused[0] and path in refused[0], refused[0]
    else:
        assert not refused, refused
