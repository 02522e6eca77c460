"""Review 8: a FencedModel whose default manager is built on Django's plain Manager
(``MyQuerySet.as_manager()``, ``models.Manager.from_queryset(...)``) gives its related
managers (``account.parcel_set``) no refusal of ``add(bulk=True)`` / ``set()``, which
write the rows with no token; a plain QuerySet under a FencedManager does not refuse
``update()``. The system check distlocks.W006 names the model and the fix."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import models
from django.test.utils import isolate_apps

from distlocks.checks import check_fenced_managers
from distlocks.models import FencedManager, FencedModel, FencedQuerySet


class MyFencedQuerySet(FencedQuerySet):
    def active(self) -> Any:
        return self.filter(pk__gt=0)


class PlainQuerySet(models.QuerySet):
    pass


MANAGERS = {
    "as_manager": (lambda: MyFencedQuerySet.as_manager(), True),
    "Manager.from_queryset": (lambda: models.Manager.from_queryset(MyFencedQuerySet)(), True),
    "plain Manager": (lambda: models.Manager(), True),
    "FencedManager over a plain QuerySet": (
        lambda: FencedManager.from_queryset(PlainQuerySet)(),
        True,
    ),
    "FencedManager.from_queryset": (lambda: FencedManager.from_queryset(MyFencedQuerySet)(), False),
    "inherited objects": (None, False),
}


@pytest.mark.parametrize("kind", list(MANAGERS))
def test_a_default_manager_that_does_not_fence_is_reported(kind: str) -> None:
    build, reported = MANAGERS[kind]
    with isolate_apps("tests.testapp") as apps:
        meta = type("Meta", (), {"app_label": "testapp"})
        body: dict[str, Any] = {"__module__": __name__, "Meta": meta}
        if build is not None:
            body["objects"] = build()
        name = "Review8" + "".join(ch for ch in kind.title() if ch.isalpha())
        model = type(name, (FencedModel,), body)
        found = [m for m in check_fenced_managers(apps.get_app_configs()) if m.obj is model]
    if not reported:
        assert found == []
        return
    assert [m.id for m in found] == ["distlocks.W006"]
    hint = found[0].hint or ""
    assert model._meta.label in hint and "FencedManager.from_queryset(" in hint


def test_the_test_project_has_none() -> None:
    assert check_fenced_managers() == []
