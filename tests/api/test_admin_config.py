"""The configuration in the admin: an edit the schema or the service refuses is reported as refused only."""

from __future__ import annotations

import pytest
from django.contrib.messages import get_messages

from apps.core.errors import ModelSwitchFailed
from apps.models.models import ConfigValue

pytestmark = pytest.mark.django_db


def change(admin_client, row: ConfigValue, value: str):
    return admin_client.post(f"/admin/ignis_models/configvalue/{row.pk}/change/", {"value": value}, follow=True)


def texts(resp) -> list[str]:
    return [str(m) for m in get_messages(resp.wsgi_request)]


def test_a_value_the_schema_refuses_is_a_form_error(admin_client):
    row = ConfigValue.objects.create(key="server.deadline", value=600.0)
    resp = change(admin_client, row, '"soon"')
    assert resp.status_code == 200
    assert "server.deadline must be a number" in resp.content.decode()
    assert not any("successfully" in t for t in texts(resp))
    row.refresh_from_db()
    assert row.value == 600.0 and not row.saved


def test_a_refusal_by_the_service_is_not_also_a_success(admin_client, monkeypatch):
    async def refuse(*, patch):
        raise ModelSwitchFailed("The reload this patch needs did not land (failed): no RAM; nothing changed.")

    monkeypatch.setattr("apps.models.config_service.config_update", refuse)
    row = ConfigValue.objects.create(key="model.max_context", value=8192)
    resp = change(admin_client, row, "4096")
    said = texts(resp)
    assert any("did not land" in t for t in said), said
    assert not any("successfully" in t for t in said), said
    row.refresh_from_db()
    assert row.value == 8192
