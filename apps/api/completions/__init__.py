"""POST /v1/completions: service.py (prompts to engine requests), consumer.py (engine events to SSE or JSON)."""
