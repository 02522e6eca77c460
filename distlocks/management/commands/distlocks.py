"""``manage.py distlocks``: list, inspect and force-release live locks.

::

    manage.py distlocks list [--backend ALIAS] [--status STATUS] [--json]
    manage.py distlocks inspect NAME [--backend ALIAS] [--kind KIND [--owner OWNER]] [--json]
    manage.py distlocks release NAME --backend ALIAS [--kind KIND --owner OWNER] [--yes] [--user U]

``--kind semaphore|read|write`` names the permits of a semaphore or read-write lock
instead of the plain lock ``NAME``; several holders share one name, so releasing one
takes its ``--owner`` (the owner id ``inspect`` and ``list --json`` show).

Exit codes: 0 done; 1 an error (unknown backend or lock, a backend that cannot be
read, a release not confirmed). ``list`` still prints what it could read. A backend
that cannot list its locks (no ``Listing`` capability) is named on stderr; ``list``
fails only when no backend asked for can list. ``inspect`` reads one lock of any
backend.
"""

from __future__ import annotations

import getpass
import json
import os
import sys
from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from distlocks import audit, livelocks
from distlocks.backends.capabilities import NotSupported, Permits, require
from distlocks.redaction import escape_control, redact

_TABLE = [
    ("NAME", lambda x: x.name),
    ("KIND", lambda x: x.kind),
    ("BACKEND", lambda x: x.backend),
    ("STATUS", lambda x: x.status),
    ("HOLDER", lambda x: x.holder),
    ("TASK", lambda x: x.celery_task_id or "-"),
    ("PG PID", lambda x: x.backend_pid or "-"),
    ("HELD", lambda x: livelocks.format_seconds(x.held_for) or "-"),
    ("EXPIRES", lambda x: livelocks.format_seconds(x.expires_in) or "never"),
    ("TOKEN", lambda x: x.info.fencing_token),
    ("RENEWALS", lambda x: x.info.renewals),
    ("WAITERS", lambda x: "-" if x.info.waiters is None else x.info.waiters),
]


class Command(BaseCommand):
    help = "List, inspect and force-release the live locks of the distlocks backends."

    def add_arguments(self, parser: ArgumentParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True, metavar="{list,inspect,release}")
        listing = sub.add_parser("list", help="the live locks of every (or one) backend")
        listing.add_argument("--backend", help="only this DISTLOCKS_BACKENDS alias")
        listing.add_argument("--status", choices=livelocks.STATUSES, help="only this status")
        listing.add_argument("--json", action="store_true", help="one JSON list on stdout")
        inspect = sub.add_parser("inspect", help="one lock (or the permits of a name), in detail")
        inspect.add_argument("name")
        inspect.add_argument("--backend", help="look only here (default: every backend)")
        self._permit_arguments(inspect, "only the permit of this owner id")
        inspect.add_argument("--json", action="store_true")
        release = sub.add_parser(
            "release",
            help="free a lock whoever holds it (or evict one permit's holder), advancing "
            "its fencing counter",
        )
        release.add_argument("name")
        release.add_argument("--backend", required=True, help="the DISTLOCKS_BACKENDS alias")
        self._permit_arguments(release, "the owner id of the permit to evict (required)")
        release.add_argument("--yes", action="store_true", help="do not ask for confirmation")
        release.add_argument(
            "--user",
            help="record the release in the admin's action history under this user "
            f"(default: the {audit.COMMAND_LINE_USERNAME!r} service account)",
        )

    @staticmethod
    def _permit_arguments(parser: ArgumentParser, owner_help: str) -> None:
        parser.add_argument(
            "--kind",
            choices=livelocks.KINDS,
            default=livelocks.LOCK,
            help="a permit of a semaphore or read-write lock instead of a lock",
        )
        parser.add_argument("--owner", default="", help=owner_help)

    def handle(self, *args: Any, **options: Any) -> None:
        action = options["action"]
        if action == "list":
            self.list_locks(options)
        elif action == "inspect":
            self.inspect_lock(options)
        else:
            self.release_lock(options)

    # -- helpers ----------------------------------------------------------------------

    def _aliases(self, alias: str | None) -> list[str]:
        known = livelocks.configured_aliases()
        if not known:
            raise CommandError(
                "DISTLOCKS_BACKENDS defines no usable backend (run manage.py check)."
            )
        if alias is None:
            return known
        if alias not in known:
            raise CommandError(
                f"Unknown backend {alias!r}; DISTLOCKS_BACKENDS defines "
                f"{', '.join(repr(a) for a in known)}."
            )
        return [alias]

    def _json(self, value: Any) -> None:
        self.stdout.write(json.dumps(value, indent=2, default=str))

    # -- list -------------------------------------------------------------------------

    def list_locks(self, options: dict[str, Any]) -> None:
        aliases = self._aliases(options["backend"])
        snapshot = livelocks.collect(aliases)
        if len(snapshot.unlisted) == len(aliases):
            # Nothing was listed: "No live locks." would not be true.
            raise CommandError(" ".join(snapshot.unlisted.values()))
        items = list(snapshot.select(status=options["status"] or "", order="name").rows)
        if options["json"]:
            self._json([item.as_dict() for item in items])
        elif items:
            cells = [[escape_control(get(item)) for _, get in _TABLE] for item in items]
            widths = [
                max(len(head), *(len(row[i]) for row in cells))
                for i, (head, _) in enumerate(_TABLE)
            ]
            lines = [[head for head, _ in _TABLE], *cells]
            for line in lines:
                self.stdout.write(
                    "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
                )
        else:
            self.stdout.write("No live locks.")
        for alias in snapshot.truncated:
            self.stderr.write(f"Backend {alias!r}: more locks than one listing reads; truncated.")
        for answer in snapshot.unlisted.values():  # a backend that cannot list
            self.stderr.write(answer)
        for notes in snapshot.notes.values():  # what a backend said of its listing
            for note in notes:
                self.stderr.write(note)
        if snapshot.errors:
            for alias, error in snapshot.errors.items():
                self.stderr.write(
                    f"Backend {alias!r} cannot be read: {escape_control(redact(error))}"
                )
            raise CommandError(
                f"{len(snapshot.errors)} backend(s) could not be read; their locks are missing."
            )

    # -- inspect ----------------------------------------------------------------------

    def _found(self, alias: str, name: str, kind: str, owner: str) -> list[livelocks.LiveLock]:
        """The lock ``name`` on ``alias``; or its permits of ``kind`` (``owner``'s only,
        when given)."""
        if kind == livelocks.LOCK:
            item = livelocks.inspect(alias, name)
            return [] if item is None else [item]
        holders = require(livelocks.get(alias), Permits, kind).permit_holders(kind, name)
        return [
            livelocks.LiveLock(info, *livelocks.classify(info))
            for info in holders
            if info.extra.get("kind") == kind and (not owner or info.owner == owner)
        ]

    def inspect_lock(self, options: dict[str, Any]) -> None:
        name, kind, owner = options["name"], options["kind"], options["owner"]
        if kind == livelocks.LOCK and owner:
            raise CommandError(
                "--owner names one holder of a semaphore or read-write lock: add --kind "
                "semaphore, read or write (a lock has a single holder)."
            )
        found: list[livelocks.LiveLock] = []
        failed: list[str] = []
        for alias in self._aliases(options["backend"]):
            try:
                found += self._found(alias, name, kind, owner)
            except NotSupported as exc:
                if options["backend"]:  # asked for there: the one answer
                    raise CommandError(escape_control(str(exc))) from exc
                # Among every backend, one without these permits holds none of them.
            except Exception as exc:  # reported, with the backend's error
                failed.append(alias)
                self.stderr.write(
                    f"Backend {alias!r} cannot be read: {livelocks.describe_error(exc)}"
                )
        if not found:
            where = f"backend {options['backend']!r}" if options["backend"] else "any backend"
            more = f" ({len(failed)} backend(s) could not be read)" if failed else ""
            what = "live lock" if kind == livelocks.LOCK else livelocks.describe_kind(kind)
            raise CommandError(f"No {what} {name!r} on {where}{more}.")
        if options["json"]:
            self._json([item.as_dict() for item in found])
            return
        for item in found:
            data = item.as_dict()
            extra = data.pop("extra")
            width = max(len(key) for key in data)
            self.stdout.write(f"{item.name} on {item.backend}:")
            for key, value in data.items():
                shown = "-" if value in (None, "", []) else escape_control(value)
                self.stdout.write(f"  {key.ljust(width)}  {shown}")
            for key, value in sorted(extra.items()):
                label = escape_control("extra." + str(key)).ljust(width)
                self.stdout.write(f"  {label}  {escape_control(value)}")

    # -- release ----------------------------------------------------------------------

    def release_lock(self, options: dict[str, Any]) -> None:
        name, alias = options["name"], options["backend"]
        self._aliases(alias)
        try:
            kind, owner = livelocks.check_ref(options["kind"], options["owner"])
        except ValueError as exc:
            raise CommandError(f"{exc} (--kind, --owner)") from exc
        what = "Lock" if kind == livelocks.LOCK else f"The {livelocks.describe_kind(kind)}"
        which = f"{what} {name!r}" + (f" of owner {owner}" if owner else "")
        try:
            item = livelocks.inspect(alias, name, kind, owner)
        except NotSupported as exc:  # a permit on a backend without them
            raise CommandError(escape_control(str(exc))) from exc
        except Exception as exc:  # reported, with the backend's error
            raise CommandError(
                f"Backend {alias!r} cannot be read: {livelocks.describe_error(exc)}"
            ) from exc
        if item is None:
            raise CommandError(f"No live {which[0].lower()}{which[1:]} on backend {alias!r}: "
                               f"nothing to release.")  # fmt: skip
        if not options["yes"]:
            self.stdout.write(
                escape_control(
                    f"{which} on backend {alias!r} is held by {item.holder} "
                    f"(owner {item.info.owner}, fencing token {item.info.fencing_token}, "
                    f"status {item.status}{': ' + item.reason if item.reason else ''})."
                )
            )
            question = (
                "Force-release it? The holder's fenced writes will be rejected. [y/N] "
                if kind == livelocks.LOCK
                else "Evict this holder? The other holders keep theirs. [y/N] "
            )
            self.stdout.write(question, ending="")
            self.stdout.flush()
            answer = sys.stdin.readline()  # "" at end of input: not confirmed
            if answer.strip().lower() not in ("y", "yes"):
                raise CommandError("Not released (not confirmed; pass --yes to skip the question).")
        recorded_as: Any = None
        if audit.history_available():
            try:
                # Who the admin's action history will name: known before anything is done.
                recorded_as = audit.command_line_user(options.get("user"))
            except LookupError as exc:
                raise CommandError(f"{exc} Nothing was released (--user).") from exc
        elif options.get("user"):
            raise CommandError(
                f"--user names who the admin's action history records, and this project has "
                f"none ({', '.join(audit.missing_apps())} not installed). Nothing was "
                f"released; leave --user out (the release is then logged on distlocks.audit)."
            )
        try:
            done = livelocks.force_release(
                alias,
                name,
                kind=kind,
                owner=owner,
                expected_token=item.info.fencing_token,
                user=_os_user(),
                via="command",
            )
        except livelocks.TokenChanged as exc:
            raise CommandError(
                f"{which} on backend {alias!r} changed hands meanwhile; nothing was "
                f"released. Inspect it again."
            ) from exc
        except Exception as exc:  # reported, with the backend's error
            raise CommandError(
                f"Could not force-release {name!r} on backend {alias!r}: "
                f"{livelocks.describe_error(exc)}"
            ) from exc
        if not done.released:
            raise CommandError(f"{which} on backend {alias!r} was released meanwhile.")
        audit.log_force_release(done, recorded_as, note=f"From the command line, by {_os_user()}.")
        counter = "" if done.counter is None else f"; fencing counter now {done.counter}"
        self.stdout.write(
            self.style.SUCCESS(
                escape_control(
                    f"Released {name!r} on backend {alias!r} (was held by {item.holder}, "
                    f"token {item.info.fencing_token}{', owner ' + owner if owner else ''})"
                    f"{counter}; "
                    + (
                        f"recorded in the admin's history as {recorded_as}."
                        if recorded_as is not None
                        else "logged on distlocks.audit (no admin action history in this project)."
                    )
                )
            )
        )


def _os_user() -> str:
    """Who ran the command, for the log line and the signal."""
    try:
        return f"{getpass.getuser()} (manage.py, pid {os.getpid()})"
    except Exception:  # no user name in this environment
        return f"manage.py, pid {os.getpid()}"
