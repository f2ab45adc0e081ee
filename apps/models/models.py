"""The catalog: artifacts on disk, the running configuration and the switch history."""

from __future__ import annotations

from django.db import models


class Artifact(models.Model):
    """One servable model: a GGUF file or a Hugging Face directory under the models directory."""

    class State(models.TextChoices):
        MISSING = "missing"  # known (e.g. a download) but not on disk
        DOWNLOADING = "downloading"
        IMPORTING = "importing"
        ON_DISK = "on_disk"
        FAILED = "failed"

    served_id = models.SlugField(max_length=200, unique=True)
    path = models.CharField(max_length=1000, help_text="relative to the models directory")
    format = models.CharField(max_length=16, blank=True, help_text="gguf | hf")
    source = models.CharField(max_length=300, blank=True, help_text="pypi:<pkg>==<ver> | import:<path>")
    sha256 = models.CharField(max_length=64, blank=True)
    size_bytes = models.BigIntegerField(default=0)
    state = models.CharField(max_length=16, choices=State.choices, default=State.MISSING)
    progress_bytes = models.BigIntegerField(default=0)
    progress_total = models.BigIntegerField(default=0)
    task_id = models.CharField(max_length=64, blank=True)
    error = models.TextField(blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["served_id"]

    def __str__(self) -> str:
        return self.served_id

    @property
    def progress_percent(self) -> float | None:
        if not self.progress_total:
            return None
        return round(100.0 * self.progress_bytes / self.progress_total, 1)


class ConfigValue(models.Model):
    """The configuration, one row per key (the value as JSON).

    ``saved`` rows were set through PATCH /v1/config or the admin: the commands
    read them back at start (below the environment and flags). The other rows
    record the value the last server started with.
    """

    key = models.CharField(max_length=100, unique=True)
    value = models.JSONField(null=True)
    saved = models.BooleanField(
        default=False, help_text="set through PATCH /v1/config or the admin: read back at start"
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["key"]

    def __str__(self) -> str:
        return f"{self.key}={self.value!r}"


class SwitchRecord(models.Model):
    """One switch and how it ended (switched | refused | restored | failed)."""

    switch_id = models.CharField(max_length=64, unique=True)
    trigger = models.CharField(max_length=16)  # explicit | implicit | config
    from_id = models.CharField(max_length=200, blank=True)
    to_id = models.CharField(max_length=200)
    outcome = models.CharField(max_length=16, blank=True)  # empty while it runs
    reason = models.TextField(blank=True)
    seconds = models.FloatField(null=True)
    started_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True)

    class Meta:
        ordering = ["-started_at"]

    def __str__(self) -> str:
        return f"{self.from_id} -> {self.to_id}: {self.outcome or 'running'}"
