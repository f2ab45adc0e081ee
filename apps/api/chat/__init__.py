"""POST /v1/chat/completions: service.py (request to engine requests), consumer.py (engine events to SSE or JSON)."""
