from django.apps import AppConfig


class ModelsConfig(AppConfig):
    name = "apps.models"
    label = "ignis_models"
    verbose_name = "Model catalog"
