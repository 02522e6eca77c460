from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import call_command


@pytest.mark.django_db
def test_no_missing_migrations() -> None:
    out = StringIO()
    call_command("makemigrations", "distlocks", "--check", "--dry-run", stdout=out)
    assert "No changes detected" in out.getvalue()
