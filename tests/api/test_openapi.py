"""GET /openapi.json (issue 11 point 3): an OpenAPI 3.1 document generated from the declared bodies,
and the bodies it declares are the ones the routes validate."""

from __future__ import annotations

import pytest
from django.test import Client
from jsonschema import Draft202012Validator

from apps.api.schemas.openapi import BODIES, ROUTES


@pytest.fixture(scope="module")
def doc() -> dict:
    resp = Client().get("/openapi.json")
    assert resp.status_code == 200 and resp["content-type"].startswith("application/json")
    return resp.json()


def test_document_is_openapi_3_1_with_every_route(doc):
    assert doc["openapi"] == "3.1.0"
    for path, method, _, body in ROUTES:
        op = doc["paths"][path][method]
        assert set(op["responses"]) >= {"200", "400", "default"}
        if body:
            ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            assert ref == f"#/components/schemas/{body}"
    assert set(BODIES) | {"ConfigPatch", "Error"} == set(doc["components"]["schemas"])


def test_every_body_schema_is_valid_json_schema_2020_12(doc):
    for schema in doc["components"]["schemas"].values():
        Draft202012Validator.check_schema(schema)


def test_schemas_say_what_validation_does(doc):
    chat = doc["components"]["schemas"]["ChatCompletionCreate"]
    assert chat["required"] == ["messages"]
    assert chat["properties"]["temperature"]["anyOf"][0] == {"type": "number", "minimum": 0.0, "maximum": 2.0}
    assert chat["properties"]["top_p"]["anyOf"][0]["exclusiveMinimum"] == 0.0
    assert chat["properties"]["n"]["anyOf"][0] == {"type": "integer", "minimum": 1, "maximum": 8}
    for name in ("logit_bias", "min_tokens", "ignore_eos", "reasoning_effort", "class", "deadline"):
        assert name in chat["properties"], name
    responses = doc["components"]["schemas"]["ResponseCreate"]
    fmt = responses["properties"]["text"]["anyOf"][0]["properties"]["format"]["anyOf"][0]
    assert fmt["properties"]["type"]["enum"] == ["text", "json_object", "json_schema"]
    decisions = doc["components"]["schemas"]["DecisionCreate"]
    assert decisions["required"] == ["input", "questions"]
    assert len(decisions["properties"]["questions"]["items"]["oneOf"]) == 3


def test_a_body_valid_by_the_schema_passes_validation_and_one_invalid_is_refused(doc):
    from apps.api.validation import parse_chat_request

    schema = doc["components"]["schemas"]["ChatCompletionCreate"]
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0.5, "logit_bias": {"5": -100}}
    Draft202012Validator(schema).validate(body)
    assert parse_chat_request(body).sampling["logit_bias"] == [[5, -100.0]]
    assert not Draft202012Validator(schema).is_valid({**body, "temperature": 3})


def test_openapi_refuses_other_methods():
    assert Client().post("/openapi.json").status_code == 405
