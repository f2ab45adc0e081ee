"""Unknown routes are a JSON 404 for any method, never Django's HTML (nor a CSRF 403 for a POST);
GET /v1/models/{id} answers one model. Django's test client with CSRF enforced, as a browser-less
client meets it; no engine: the switch gate is stubbed."""

from __future__ import annotations

import json

import pytest
from django.test import Client

from apps.models import middleware
from tests.helpers import assert_openai_error


@pytest.fixture
def http(monkeypatch):
    async def nothing(**kw):
        return None

    monkeypatch.setattr(middleware, "switch_gate", nothing)
    return Client(enforce_csrf_checks=True)


# -- unknown routes ------------------------------------------------------------------------------------------

UNKNOWN = ["/v1/embeddings", "/v1/moderations", "/v1/images/generations", "/v1/", "/nothing", "/v2/chat"]


@pytest.mark.parametrize("method", ["get", "post", "put", "patch", "delete", "options"])
@pytest.mark.parametrize("path", UNKNOWN)
def test_unknown_route_is_json_404_for_any_method(http, method, path):
    resp = http.generic(method.upper(), path, data="{}", content_type="application/json")
    err = assert_openai_error(resp, 404, code="not_found")
    assert path in err["message"]


def test_the_admin_keeps_its_html_pages():
    from django.http import Http404
    from django.test import RequestFactory

    from apps.api import views

    request = RequestFactory().get("/admin/no-such-page/")
    assert views.handler404(request, Http404()).headers["content-type"].startswith("text/html")
    assert views.handler500(request).headers["content-type"].startswith("text/html")
    resp = views.handler500(RequestFactory().get("/v1/catalog/download"))
    assert resp.status_code == 500 and json.loads(resp.content)["error"]["code"] == "internal_error"


@pytest.mark.parametrize("path", ["/v1/models", "/health"])
def test_post_to_a_get_route_is_405_envelope_not_csrf_403(http, path):
    assert_openai_error(http.post(path, data="{}", content_type="application/json"), 405, code="method_not_allowed")


# -- GET /v1/models/{id} ---------------------------------------------------------------------------------------


@pytest.fixture
def listed(monkeypatch):
    from apps.api import model_views

    entry = {"id": "org/tiny", "object": "model", "created": 0, "owned_by": "ignis", "status": "serving"}

    async def payload():
        return {"object": "list", "data": [entry]}

    monkeypatch.setattr(model_views, "models_payload", payload)
    return entry


def test_model_retrieve_answers_the_listed_entry(http, listed):
    resp = http.get("/v1/models/org/tiny")
    assert resp.status_code == 200 and resp.json() == listed


def test_model_retrieve_unknown_is_404_model_not_found(http, listed):
    assert_openai_error(http.get("/v1/models/gpt-9"), 404, code="model_not_found", param="model")
    assert_openai_error(http.delete("/v1/models/org/tiny"), 405, code="method_not_allowed")
