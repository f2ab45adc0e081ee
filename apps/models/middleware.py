"""The switch gate for Django's /v1 routes (the consumers call ``switch_gate`` themselves)."""

from __future__ import annotations

from asgiref.sync import iscoroutinefunction, markcoroutinefunction

from apps.core.errors import IgnisError, error_response
from apps.models.switching import switch_gate


class SwitchGateMiddleware:
    """While a switch runs, every /v1 route but the state reads answers 503 model_switching (Retry-After: 5)."""

    async_capable = True
    sync_capable = False

    def __init__(self, get_response):
        self.get_response = get_response
        if iscoroutinefunction(self.get_response):
            markcoroutinefunction(self)

    async def __call__(self, request):
        try:
            await switch_gate(method=request.method, path=request.path)
        except IgnisError as err:
            return error_response(err)
        return await self.get_response(request)
