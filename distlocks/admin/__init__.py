"""Admin integration.

:class:`FencedModelAdmin`: edits of a fenced row in the Django admin take the
row's lock and save with its token, so an admin edit can neither interleave with
a worker holding that lock nor overwrite a newer holder's write.

:class:`LiveLockAdmin`: the page of live locks of every backend
(``/admin/distlocks/livelock/``), a page per lock, and a confirmed, audited force
release for holders of the ``distlocks.force_release_livelock`` permission.

Each lives in a module of its own (:mod:`distlocks.admin.fenced`,
:mod:`distlocks.admin.live_locks`); both are importable from here, as before the
split, and importing this package (as the admin's autodiscovery does) registers the
live-locks page.
"""

from __future__ import annotations

from distlocks.admin.fenced import FencedModelAdmin
from distlocks.admin.live_locks import LiveLockAdmin, logger

__all__ = ["FencedModelAdmin", "LiveLockAdmin", "logger"]
