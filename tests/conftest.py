"""Fixtures shared by every test layer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def models_dir() -> Path:
    return Path(os.environ.get("IGNIS_SERVER_MODELS_DIR") or ROOT / "models")


@pytest.fixture(scope="session")
def default_gguf_path() -> Path:
    """The default model's GGUF, fetched into the models directory if absent."""
    from apps.models.download import ensure_default_model

    return ensure_default_model(models_dir())
