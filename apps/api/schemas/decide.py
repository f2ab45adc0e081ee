"""POST /v1/decide: the body as a declared serializer (apps.api.decide reads the labels' tokens)."""

from __future__ import annotations

from typing import Any

from apps.api.schemas.fields import Body, Enum, Str, Strict

MAX_LABELS = 64
MAX_LABEL_LEN = 200


class Labels(Strict):
    schema = {
        "type": "array",
        "minItems": 2,
        "maxItems": MAX_LABELS,
        "uniqueItems": True,
        "items": {"type": "string", "minLength": 1, "maxLength": MAX_LABEL_LEN, "pattern": "\\S"},
    }

    def to_internal_value(self, data: Any) -> list[str]:
        from rest_framework.exceptions import ErrorDetail, ValidationError

        if not isinstance(data, list):
            self.bad("'labels' must be an array of strings.", "invalid_type")
        if not 2 <= len(data) <= MAX_LABELS:
            self.bad(f"Give between 2 and {MAX_LABELS} labels.")
        for i, label in enumerate(data):
            if not isinstance(label, str):
                raise ValidationError({i: [ErrorDetail("Each label must be a string.", code="invalid_type")]})
            if not label.strip() or len(label) > MAX_LABEL_LEN:
                raise ValidationError(
                    {i: [ErrorDetail(f"A label is 1 to {MAX_LABEL_LEN} characters, not blank.", code="invalid_value")]}
                )
        if len(set(data)) != len(data):
            self.bad("Labels must be distinct.")
        return data


class DecideBody(Body):
    evidence = Str(description="optional context the question is about")
    question = Str(required=True, nonblank=True)
    labels = Labels(required=True)
    instructions = Str(nonblank=True)
    model = Str()

    def get_fields(self):
        fields = super().get_fields()
        fields["class"] = Enum("interactive", "agent", message="'class' must be 'interactive' or 'agent'.")
        return fields
