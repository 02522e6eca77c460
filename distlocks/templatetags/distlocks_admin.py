"""Filters of the live-locks admin pages (``{% load distlocks_admin %}``).

Lock names, holders' thread names and extra details are chosen by whoever takes a
lock. Bidi controls and characters that draw nothing would make one of them read as
another on the page, so every such value is shown through :func:`visible`; a form
field that must send the real value back uses :func:`form_value`.
"""

from __future__ import annotations

from typing import Any

from django import template
from django.utils.html import conditional_escape
from django.utils.safestring import SafeString, mark_safe

from distlocks.redaction import escape_control

register = template.Library()


@register.filter
def visible(value: Any) -> Any:
    """A text with its invisible and reordering characters shown as ``\\u202e``-style
    escapes (HTML escaping still follows); any other value as it is."""
    return escape_control(value) if isinstance(value, str) else value


@register.filter
def form_value(value: Any) -> SafeString:
    """``value`` for a hidden field's ``value="..."``: HTML-escaped, and its invisible
    characters written as character references, which the browser sends back as
    they were, and which no reader of the page's source mistakes for nothing. C1
    controls (U+0080 to U+009F) stay as they are: HTML reads their references as
    Windows-1252 letters ("&#x80;" is "€"), and a hidden field is never drawn."""
    text = str(conditional_escape(value))
    if escape_control(text) == text:
        return mark_safe(text)
    return mark_safe("".join(_reference(ch) for ch in text))


def _reference(ch: str) -> str:
    if escape_control(ch) == ch or 0x80 <= ord(ch) <= 0x9F:
        return ch
    return f"&#x{ord(ch):x};"
