"""The class named in ``BACKEND``: :class:`ZooKeeperBackend`, the modules of this
package put together (see the package's docstring for which holds what)."""

from __future__ import annotations

from typing import ClassVar

from distlocks.backends.zookeeper.listing import ZooKeeperListing


class ZooKeeperBackend(ZooKeeperListing):
    """Locks as ephemeral sequential nodes on a ZooKeeper ensemble (kazoo).

    ``LOCATION`` is a ZooKeeper connection string, ``"host:port,host:port/chroot"``.
    ``OPTIONS``: ``session_timeout`` (seconds asked for; the server bounds it),
    ``connect_timeout`` (how long a call waits for a connection before
    :class:`LockBackendUnavailable`), ``socket_timeout`` (bound of each request),
    ``prefix`` (the znode under which locks live), ``auth`` (a list of
    ``(scheme, credential)`` pairs, e.g. ``[("digest", "user:password")]``), and the
    TLS keys ``use_ssl``, ``verify_certs``, ``check_hostname``, ``ca``, ``certfile``, ``keyfile``,
    ``keyfile_password``.

    The contract's methods come from the classes below it, one concern each: the lock
    recipe (:mod:`.lock`), permits (:mod:`.permits`), listing (:mod:`.listing`), on
    the outages, the session and the configuration (:mod:`.outages`,
    :mod:`.session`, :mod:`.config`).
    """

    config_keys: ClassVar[frozenset[str]] = frozenset({"LOCATION", "OPTIONS"})
    wakes_on_release: ClassVar[bool] = True
    expires_on_server: ClassVar[bool] = False  # held until released or the session ends
