"""Stored responses: what ``previous_response_id`` continues from.

A row keeps the conversation so far as chat messages (instructions excluded:
they are per request, as in OpenAI's API) and the Response object as served.
The KV state itself is the engine's, found again by content; this row only
lets the next turn render the same prompt prefix.
"""

from django.db import models


class StoredResponse(models.Model):
    id = models.CharField(primary_key=True, max_length=64)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    model = models.CharField(max_length=200)
    messages = models.JSONField(default=list)  # the conversation including this response's output
    response = models.JSONField(default=dict)  # the Response object as the client got it

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return self.id
