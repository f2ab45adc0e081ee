"""The bottom app: what every other app needs and nothing above it.

``apps.core`` holds the error hierarchy and its one renderer (errors.py), the
engine client (engine_client.py: the Django side's only door to the engine) and
the engine metrics (metrics.py). It imports no other app; ``apps.api``,
``apps.models`` and ``apps.playground`` import it (tests/test_layers.py keeps it so).
"""
