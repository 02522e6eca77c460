"""The class named in ``BACKEND``: :class:`EtcdBackend`, the etcd modules of this package
put together (see the package's docstring for which holds what)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from distlocks.backends.etcd.config import config_problems
from distlocks.backends.etcd.listing import EtcdListing


class EtcdBackend(EtcdListing):
    """Locks on an etcd v3 cluster, through its JSON gateway.

    ``LOCATION``: an endpoint URL (``"http://etcd1:2379"``), several separated by commas,
    or a list of them; ``https://`` for TLS; ``user:password@`` for etcd's own auth.
    ``OPTIONS``: ``connect_timeout`` and ``socket_timeout`` (seconds), ``prefix`` (of
    every key), ``user`` and ``password`` (instead of the URL), ``ca_file``,
    ``cert_file``, ``key_file``, ``verify`` (TLS), ``token_floor`` (the least base of a
    name's tokens; see docs/backend-etcd.md).

    The contract's methods come from the classes below it, one concern each: the lock
    recipe (:mod:`.lock_acquire`, :mod:`.lock_held`), permits (:mod:`.permit_acquire`,
    :mod:`.permit_held`), listing (:mod:`.listing`), on the watches, the gateway's
    requests and the transport (:mod:`.watch`, :mod:`.gateway`, :mod:`.transport`).
    """

    config_keys: ClassVar[frozenset[str]] = frozenset({"LOCATION", "OPTIONS"})
    wakes_on_release: ClassVar[bool] = True
    expires_on_server: ClassVar[bool] = True

    @classmethod
    def validate_config(cls, alias: str, config: Mapping[str, Any]) -> list[str]:
        return [*super().validate_config(alias, config), *config_problems(config)]
