"""GET and DELETE /v1/responses/{id}: the store of answered responses."""

from __future__ import annotations

from django.http import JsonResponse
from django.views.decorators.csrf import csrf_exempt

from apps.api.responses.service import stored_response_delete, stored_response_get
from apps.core.errors import IgnisError, NotFound, error_response


@csrf_exempt
async def response_detail(request, response_id: str):
    """GET /v1/responses/{id}: a stored response as it was answered; DELETE forgets it."""
    try:
        if request.method == "GET":
            try:
                return JsonResponse((await stored_response_get(response_id))["response"])
            except IgnisError:
                raise NotFound(f"No stored response with id '{response_id}'.", param="response_id") from None
        if request.method == "DELETE":
            if not await stored_response_delete(response_id):
                raise NotFound(f"No stored response with id '{response_id}'.", param="response_id")
            return JsonResponse({"id": response_id, "object": "response.deleted", "deleted": True})
        raise IgnisError("Use GET or DELETE here.", code="method_not_allowed", status=405)
    except IgnisError as err:
        return error_response(err)
