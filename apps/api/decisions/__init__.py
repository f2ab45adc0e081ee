"""POST /v1/decisions, OpenAI's Decisions API, on the decide machinery (docs/API.md).

``fields`` and ``schema`` declare the request body (DRF serializers, 400s naming
the ``param`` path); ``prompt`` writes each question after the shared input;
``answers`` reads an answer from the engine's logprobs; ``service`` turns a
body into one prefill-only engine request per question; ``consumer`` submits
them and answers.
"""
