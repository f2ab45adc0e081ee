"""Assertion helpers shared by API and end-to-end tests."""

from __future__ import annotations


def assert_openai_error(resp, status: int, code: str | None = None, param: str | None = None) -> dict:
    """The response is ``status`` with a complete OpenAI error envelope; returns the error object."""
    assert resp.status_code == status, (resp.status_code, resp.text[:500])
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in err["message"]
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err
