#!/usr/bin/env python
"""Django's command-line utility for ignis."""

import os
import sys

# Keys the settings module reads before any command parses its flags: a flag for
# one of them is moved into the environment first, so it takes effect like the rest.
EARLY_KEYS = ("server.data_dir", "server.models_dir", "server.redis_url", "server.log_level")


def hoist_early_flags(argv: list[str]) -> None:
    for key in EARLY_KEYS:
        flag = "--" + key.replace(".", "-").replace("_", "-")
        env = "IGNIS_" + key.replace(".", "_").upper()
        for i, arg in enumerate(argv):
            if arg == flag and i + 1 < len(argv):
                os.environ[env] = argv[i + 1]
            elif arg.startswith(flag + "="):
                os.environ[env] = arg.split("=", 1)[1]


def main() -> None:
    hoist_early_flags(sys.argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ignis_site.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
