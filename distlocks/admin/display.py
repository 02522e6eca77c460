"""How the admin shows text a lock holder chose (lock names, thread names, extra
details): with bidi controls and characters that draw nothing escaped, so that no
name reads as another one. The pages use the ``distlocks_admin`` template filters;
messages go through :class:`VisibleMessages`."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest

from distlocks.redaction import escape_control


class VisibleMessages:
    """A ``ModelAdmin`` mixin: every message shown to the user is escaped as the pages
    are (``\\u202e`` for U+202E); a message with nothing to escape is unchanged."""

    def message_user(self, request: HttpRequest, message: Any, *args: Any, **kwargs: Any) -> None:
        super().message_user(request, escape_control(message), *args, **kwargs)  # type: ignore[misc]
