"""POST /v1/tokenize and /v1/detokenize: service.py and views.py (DRF)."""
