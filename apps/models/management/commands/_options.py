"""CLI flags generated from the configuration schema (``--model-prefill-chunk`` ...)."""

from django.conf import settings

from ignis_site import config


def add_config_flags(parser, skip: tuple[str, ...] = ()) -> None:
    for field in config.FIELDS.values():
        if field.key in skip:
            continue
        parser.add_argument(field.flag, dest=field.key, default=None, help=f"{field.help} [{field.env_name}]")


def apply_config_flags(options: dict) -> dict:
    """Flags given on the command line override settings.IGNIS (env and defaults)."""
    overrides = {k: options[k] for k in config.FIELDS if options.get(k) is not None}
    settings.IGNIS.update(config.load(overrides))
    return settings.IGNIS
