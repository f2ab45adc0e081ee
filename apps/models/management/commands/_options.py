"""CLI flags generated from the configuration schema (``--model-prefill-chunk`` ...)."""

from ignis_site import config


def add_config_flags(parser, skip: tuple[str, ...] = ()) -> None:
    for field in config.FIELDS.values():
        if field.key in skip:
            continue
        # default=None: an unset flag must not beat the saved value or the environment; the help says the default.
        text = f"{field.help} (default: {_shown(field.default)}) [{field.env_name}]"
        metavar = field.type.__name__.upper()
        parser.add_argument(field.flag, dest=field.key, default=None, metavar=metavar, help=text.replace("%", "%%"))


def _shown(default) -> str:
    if default == "":
        return "''"
    return str(default).lower() if isinstance(default, bool) else str(default)


def config_flags(options: dict) -> dict:
    """The configuration keys given as flags, with their values as given."""
    return {k: options[k] for k in config.FIELDS if options.get(k) is not None}


def apply_config_flags(options: dict) -> dict:
    """settings.IGNIS from defaults < the saved configuration < the environment < these flags."""
    from apps.models.config_service import config_start

    return config_start(config_flags(options))


def switch_interval(values: dict) -> None:
    """The process's thread switch interval from ``server.switch_interval_us``: how long a thread that
    wants the interpreter lock waits before the one holding it is asked to let go (at Python's 5 ms,
    the default, the engine's step thread can wait that long at a time in a burst; docs/CONFIG.md)."""
    import sys

    sys.setswitchinterval(values["server.switch_interval_us"] / 1e6)


def gc_freeze(values: dict) -> None:
    """``server.gc_freeze``: freeze the objects the process holds now and after each model load
    (engine/gc_pause.py); call it once the process is set up, before it serves."""
    from engine import gc_pause

    gc_pause.enable(values["server.gc_freeze"])
