"""The audit trail of force releases: one entry of the admin's action history
(``LogEntry``) per holder evicted, whether from the admin page or from
``manage.py distlocks release``.

A release from the command line is recorded under the user named with ``--user``, or
else under a service account, ``distlocks-command-line`` (inactive, with no usable
password: nobody can sign in as it), with the operating-system user who ran the
command in the entry's message.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from django.apps import apps

from distlocks.redaction import escape_control

if TYPE_CHECKING:
    from django.contrib.admin.models import LogEntry

    from distlocks.livelocks import ForceReleased

logger = logging.getLogger(__name__)

#: What the action history needs; a project without them (no admin site) still gets
#: every force release on this module's logger, and the command says where it went.
HISTORY_APPS = ("django.contrib.admin", "django.contrib.auth", "django.contrib.contenttypes")


def history_available() -> bool:
    """Whether the admin's action history (``LogEntry``) can record a release."""
    return all(apps.is_installed(app) for app in HISTORY_APPS)


def missing_apps() -> list[str]:
    """The apps of :data:`HISTORY_APPS` that are not installed."""
    return [app for app in HISTORY_APPS if not apps.is_installed(app)]


#: The account command-line force releases are recorded under, without ``--user``.
COMMAND_LINE_USERNAME = "distlocks-command-line"

#: Between the parts of a permit's LogEntry object id (never in a lock name).
SEPARATOR = "\x1f"


def command_line_user(username: str | None = None) -> Any:
    """The user a command-line force release is recorded under: ``username`` (which
    must exist: LookupError otherwise), or the service account, created on first use."""
    from django.contrib.auth import get_user_model

    model = get_user_model()
    manager = model._default_manager
    if username:
        try:
            return manager.get_by_natural_key(username)
        except model.DoesNotExist as exc:
            raise LookupError(
                f"There is no user {username!r} to record the release under."
            ) from exc
    field = model.USERNAME_FIELD
    user = manager.filter(**{field: COMMAND_LINE_USERNAME}).first()
    if user is None:
        user = model(**{field: COMMAND_LINE_USERNAME})
        if hasattr(user, "is_active"):
            user.is_active = False
        user.set_unusable_password()
        user.save()
    return user


def log_force_release(done: ForceReleased, user: Any, note: str = "") -> LogEntry | None:
    """Record ``done`` in the action history under ``user``; nothing when no holder was
    evicted (nothing happened, so there is nothing to audit). Every release recorded is
    also logged (INFO) on ``distlocks.audit``; without the admin's apps (no history to
    write to) it is logged only, as a WARNING, and None is returned."""
    from distlocks import livelocks

    if not done.released:
        return None
    before = done.before
    holder = (
        f"{before.holder}, owner {before.info.owner}, fencing token {before.info.fencing_token}"
        if before
        else "no holder"
    )
    if before and before.celery_task_id:
        holder += f", Celery task {before.celery_task_id}"
    object_id = f"{done.alias}:{done.name}"
    object_repr = f"{done.name} ({done.alias})"
    what = "Force-released"
    if done.kind != livelocks.LOCK:
        object_id += f"{SEPARATOR}{done.kind}{SEPARATOR}{done.owner}"
        object_repr = f"{done.name} ({done.alias}, {done.kind} of {done.owner})"
        what = f"Force-released a {livelocks.describe_kind(done.kind)}"
    counter = "" if done.counter is None else f"; fencing counter now {done.counter}"
    if done.counter is None and done.kind != livelocks.SEMAPHORE:
        counter = "; fencing counter now unknown"
    message = f"{what} (was held): {holder}{counter}."
    if note:
        message += f" {note}"
    if not history_available():
        logger.warning(
            "%s: %s (not in the admin's action history: %s not installed)",
            escape_control(object_repr),
            escape_control(message),
            ", ".join(missing_apps()),
        )
        return None
    from django.contrib.admin.models import DELETION, LogEntry
    from django.contrib.contenttypes.models import ContentType

    logger.info("%s: %s", escape_control(object_repr), escape_control(message))
    return LogEntry.objects.create(
        user_id=user.pk,
        content_type_id=ContentType.objects.get_for_model(
            livelocks_model(), for_concrete_model=False
        ).pk,
        object_id=object_id,
        object_repr=escape_control(object_repr)[:200],
        action_flag=DELETION,
        change_message=escape_control(message),
    )


def livelocks_model() -> Any:
    from distlocks.models import LiveLock

    return LiveLock
