from __future__ import annotations

import pytest
from openai import OpenAI

from tests.e2e.server import start_server


@pytest.fixture(scope="session")
def live_server_url(tmp_path_factory, default_gguf_path):
    """One embedded server (engine inside Daphne) for the whole session."""
    proc, base = start_server(tmp_path_factory.mktemp("server"), "--model-idle-unload", "0")
    yield base
    proc.stop()


@pytest.fixture(scope="session")
def client(live_server_url) -> OpenAI:
    return OpenAI(base_url=live_server_url + "/v1", api_key="unused", max_retries=0, timeout=120)
