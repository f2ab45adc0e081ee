from django.apps import AppConfig


class ModelsConfig(AppConfig):
    name = "apps.models"
    label = "ignis_models"
    verbose_name = "Model catalog"

    def ready(self) -> None:
        from apps.core import engine_state
        from apps.models.switching import status_took

        if status_took not in engine_state.STATUS_HOOKS:
            engine_state.STATUS_HOOKS.append(status_took)
