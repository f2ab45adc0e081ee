"""The Responses API: service.py (request to engine request, the store), events.py (engine
events to Responses events), consumer.py (POST /v1/responses), socket.py (the WebSocket),
views.py (GET / DELETE /v1/responses/{id}).

The package re-exports service.py, so ``apps.api.responses.response_parse`` and the
other names of the old responses.py module still resolve.
"""

from apps.api.responses.service import *  # noqa: F403
from apps.api.responses.service import PreparedResponse, ResponseRequest, response_parse  # noqa: F401
