"""The admin's static files, served by the ASGI app itself (whitenoise).

``WhiteNoiseMiddleware`` is sync-only; in an async middleware chain Django would
run everything below it through a thread. Its lookup is a dict read of the file
index built at start (``WHITENOISE_USE_FINDERS``: no collectstatic step), so an
async ``__call__`` is the same work without the hop.
"""

from __future__ import annotations

from asgiref.sync import markcoroutinefunction
from whitenoise.middleware import WhiteNoiseMiddleware


class StaticFilesMiddleware(WhiteNoiseMiddleware):
    async_capable = True
    sync_capable = False

    def __init__(self, get_response):
        super().__init__(get_response)
        markcoroutinefunction(self)

    async def __call__(self, request):
        static_file = self.files.get(request.path_info)
        if static_file is not None:
            return self.serve(static_file, request)
        return await self.get_response(request)
