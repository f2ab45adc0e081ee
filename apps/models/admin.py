"""The catalog, the running configuration and the switch history in the Django admin.

Actions call the same services as the API: downloads and imports queue the
Celery tasks, a switch goes through ``model_switch``, a config edit through
``config_update`` (validated whole; a reload key reloads the model).
"""

from __future__ import annotations

from asgiref.sync import async_to_sync
from django import forms
from django.contrib import admin, messages
from django.http import HttpResponseRedirect

from apps.core.errors import IgnisError
from apps.models import catalog
from apps.models.models import Artifact, ConfigValue, SwitchRecord
from apps.models.services import switch_target_resolve
from ignis_site import config


@admin.register(Artifact)
class ArtifactAdmin(admin.ModelAdmin):
    list_display = ("served_id", "state", "format", "size_bytes", "progress", "path", "source", "updated_at")
    readonly_fields = ("sha256", "size_bytes", "state", "progress_bytes", "progress_total", "task_id", "error")
    actions = ("download", "verify", "reimport", "switch_to")

    @admin.display(description="progress")
    def progress(self, obj: Artifact) -> str:
        pct = obj.progress_percent
        return f"{obj.progress_bytes}/{obj.progress_total} ({pct:.0f}%)" if pct is not None else "-"

    def _each(self, request, queryset, fn, done: str) -> None:
        for art in queryset:
            try:
                fn(art)
                self.message_user(request, f"{art.served_id}: {done}")
            except IgnisError as err:
                self.message_user(request, f"{art.served_id}: {err.message}", messages.ERROR)

    @admin.action(description="Download (Celery task)")
    def download(self, request, queryset):
        self._each(request, queryset, lambda a: catalog.artifact_download(served_id=a.served_id), "download queued")

    @admin.action(description="Verify sha256")
    def verify(self, request, queryset):
        for art in queryset:
            try:
                clean, got, want = catalog.artifact_verify(served_id=art.served_id)
            except IgnisError as err:
                self.message_user(request, f"{art.served_id}: {err.message}", messages.ERROR)
                continue
            level = messages.SUCCESS if clean else messages.ERROR
            self.message_user(request, f"{art.served_id}: {'ok' if clean else f'{got} != {want}'}", level)

    @admin.action(description="Import again (hash and size, Celery task)")
    def reimport(self, request, queryset):
        self._each(
            request, queryset, lambda a: catalog.artifact_import(path=a.path, served_id=a.served_id), "import queued"
        )

    @admin.action(description="Switch to this model")
    def switch_to(self, request, queryset):
        from apps.models.switching import model_switch

        def go(art):
            target = switch_target_resolve(served_id=art.served_id)
            async_to_sync(model_switch)(target=target, trigger="explicit")

        self._each(request, queryset[:1], go, "switch started")


class ConfigValueForm(forms.ModelForm):
    """A value the schema refuses is a form error: the page shows it and nothing is saved."""

    class Meta:
        model = ConfigValue
        fields = ("value",)

    def clean_value(self):
        value = self.cleaned_data.get("value")
        try:
            config.validate({self.instance.key: value})
        except ValueError as exc:
            raise forms.ValidationError(exc.args[-1]) from None
        return value


@admin.register(ConfigValue)
class ConfigValueAdmin(admin.ModelAdmin):
    """``value`` is the saved value (read back at start) or, unsaved, the one the server started with;
    ``running`` and ``source`` are this process's (an environment variable or a flag beats a saved value)."""

    form = ConfigValueForm
    list_display = ("key", "value", "saved", "running", "source", "updated_at")
    list_filter = ("saved",)
    readonly_fields = ("key", "saved")
    actions = ("forget",)

    @admin.display(description="running")
    def running(self, obj: ConfigValue):
        from django.conf import settings

        from apps.models.config_service import SECRET_KEYS

        value = settings.IGNIS.get(obj.key)
        return "***" if obj.key in SECRET_KEYS and value else value

    @admin.display(description="source")
    def source(self, obj: ConfigValue) -> str:
        from apps.models.config_service import config_sources

        return config_sources().get(obj.key, "-")

    @admin.action(description="Forget the saved value (the environment, a flag or the default decides at next start)")
    def forget(self, request, queryset):
        n = queryset.update(saved=False)
        self.message_user(request, f"{n} saved value(s) forgotten; the running values stay until restart")

    def has_add_permission(self, request) -> bool:
        return False

    def save_model(self, request, obj, form, change):
        """Edits go through config_update, like PATCH /v1/config (it persists the row itself)."""
        from apps.models.config_service import config_update

        try:
            async_to_sync(config_update)(patch={obj.key: obj.value})
        except IgnisError as err:
            # The change view would go on to log the change and say "changed successfully".
            request.ignis_config_refused = True
            self.message_user(request, f"{obj.key}: {err.message}", messages.ERROR)

    def log_change(self, request, obj, message):
        if not getattr(request, "ignis_config_refused", False):
            return super().log_change(request, obj, message)
        return None

    def response_change(self, request, obj):
        """A refused edit goes back to its form with the error only, not also a success message."""
        if getattr(request, "ignis_config_refused", False):
            return HttpResponseRedirect(request.path)
        return super().response_change(request, obj)


@admin.register(SwitchRecord)
class SwitchRecordAdmin(admin.ModelAdmin):
    list_display = ("started_at", "trigger", "from_id", "to_id", "outcome", "seconds", "reason")
    list_filter = ("outcome", "trigger")

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False
