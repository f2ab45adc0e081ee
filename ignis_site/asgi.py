"""ASGI entry: streaming routes are Channels consumers, the rest is Django."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ignis_site.settings")
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.urls import path, re_path  # noqa: E402

from apps.api.auth import ApiGate  # noqa: E402
from apps.api.chat.consumer import ChatCompletionsConsumer  # noqa: E402
from apps.api.completions.consumer import CompletionsConsumer  # noqa: E402
from apps.api.cors import CorsGate  # noqa: E402
from apps.api.decide.consumer import DecideConsumer  # noqa: E402
from apps.api.decisions.consumer import DecisionsConsumer  # noqa: E402
from apps.api.responses.consumer import ResponsesConsumer  # noqa: E402
from apps.api.responses.socket import ResponsesSocketConsumer  # noqa: E402

# CorsGate: preflights (they carry no key) and origins; ApiGate: API keys and the
# declared body size, before any consumer or view runs.
application = CorsGate(
    ApiGate(
        ProtocolTypeRouter(
            {
                "http": URLRouter(
                    [
                        path("v1/chat/completions", ChatCompletionsConsumer.as_asgi()),
                        path("v1/completions", CompletionsConsumer.as_asgi()),
                        path("v1/responses", ResponsesConsumer.as_asgi()),
                        path("v1/decide", DecideConsumer.as_asgi()),
                        path("v1/decisions", DecisionsConsumer.as_asgi()),
                        re_path(r"", django_asgi_app),
                    ]
                ),
                "websocket": URLRouter([path("v1/responses", ResponsesSocketConsumer.as_asgi())]),
            }
        )
    )
)
