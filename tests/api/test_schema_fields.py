"""apps.api.schemas.fields.Body: leaf fields copied per request, never shared or left bound."""

from __future__ import annotations

import threading

import pytest

from apps.api.schemas import validated
from apps.api.schemas.chat import SamplingBody
from apps.core.errors import InvalidRequest


def test_each_serializer_binds_its_own_copies_and_the_declared_fields_stay_unbound():
    a, b = SamplingBody(data={}), SamplingBody(data={})
    for name, field in a.fields.items():
        assert field is not b.fields[name]
        assert field.parent is a and b.fields[name].parent is b and field.field_name == name
    for field in SamplingBody._declared_fields.values():
        assert field.parent is None and field.field_name is None


def test_validation_in_threads_names_each_requests_own_param():
    """Requests validated at once keep their own values and errors (nothing of one reaches another)."""
    errors: list[str] = []

    def run(i: int) -> None:
        for _ in range(200):
            good = validated(SamplingBody, {"temperature": i / 10, "max_tokens": i + 1})
            if good["temperature"] != i / 10 or good["max_tokens"] != i + 1:
                errors.append(f"{i}: {good}")
            with pytest.raises(InvalidRequest) as err:
                validated(SamplingBody, {"top_p": 2 + i} if i % 2 else {"temperature": -1 - i})
            if err.value.param != ("top_p" if i % 2 else "temperature") or str(2 + i if i % 2 else -1 - i) not in str(
                err.value
            ):
                errors.append(f"{i}: {err.value.param} {err.value}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
