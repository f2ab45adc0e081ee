"""Django settings for ignis. Environment is read only through ignis_site.config."""

from pathlib import Path

from ignis_site import config, jsonlog

BASE_DIR = Path(__file__).resolve().parent.parent
IGNIS = config.load()
VAR_DIR = Path(IGNIS["server.data_dir"] or BASE_DIR / "var")
VAR_DIR.mkdir(parents=True, exist_ok=True)
MODELS_DIR = Path(IGNIS["server.models_dir"] or BASE_DIR / "models")
REDIS_URL = IGNIS["server.redis_url"]
# The Unix socket of the channel hub a parent serve started (ignis_site/channel_hub.py).
CHANNEL_HUB = "" if REDIS_URL else IGNIS["server.channel_hub"]


def _secret_key() -> str:
    path = VAR_DIR / "secret_key"
    if not path.exists():
        import secrets

        path.write_text(secrets.token_urlsafe(50))
    return path.read_text().strip()


SECRET_KEY = _secret_key()
DEBUG = False
ALLOWED_HOSTS = ["*"]

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "rest_framework",
    "django_prometheus",
    "apps.core",
    "apps.api",
    "apps.models",
    "apps.playground",
]

MIDDLEWARE = [
    "django_prometheus.middleware.PrometheusBeforeMiddleware",
    "ignis_site.staticfiles.StaticFilesMiddleware",  # the admin's CSS and JS at /static/ (whitenoise)
    "apps.models.middleware.SwitchGateMiddleware",  # 503 model_switching on /v1 while a switch runs
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django_prometheus.middleware.PrometheusAfterMiddleware",
]

ROOT_URLCONF = "ignis_site.urls"
ASGI_APPLICATION = "ignis_site.asgi.application"
APPEND_SLASH = False

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

# SQLite under var/ (embedded), or PostgreSQL with server.database_url (a fleet: docs/FLEET.md).
DATABASES = {"default": config.database_settings(IGNIS["server.database_url"], VAR_DIR / "ignis.sqlite3")}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

if REDIS_URL:
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            # redis-py 8 times sockets out after 5 s by default, the same as
            # channels_redis' blocking-pop timeout: a quiet channel would raise.
            "CONFIG": {"hosts": [{"address": REDIS_URL, "socket_timeout": 30}], "capacity": 2000, "expiry": 120},
        }
    }
elif CHANNEL_HUB:
    # serve --server-front-ends N without Redis: the processes of one host through the parent's hub.
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "ignis_site.channel_hub.HubChannelLayer",
            "CONFIG": {"path": CHANNEL_HUB, "capacity": 2000, "expiry": 120},
        }
    }
else:
    # In-process, and safe across the two event loops of the embedded mode (Daphne's and the
    # engine's own, on its thread): channels' InMemoryChannelLayer is bound to one loop.
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "ignis_site.channel_layer.CrossLoopChannelLayer",
            "CONFIG": {"capacity": 2000, "expiry": 120},
        }
    }

# Celery runs downloads and imports. Embedded: a filesystem broker and file
# results under var/, worked by the solo worker the serve command starts.
if REDIS_URL:
    CELERY_BROKER_URL = REDIS_URL
    CELERY_RESULT_BACKEND = REDIS_URL
else:
    _celery_dir = VAR_DIR / "celery"
    for _sub in ("in", "processed", "results", "control"):
        (_celery_dir / _sub).mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_URL = "filesystem://localhost/"  # a host named: kombu warns at each connect otherwise
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_celery_dir / "in"),
        "data_folder_out": str(_celery_dir / "in"),
        "processed_folder": str(_celery_dir / "processed"),
        "store_processed": False,
        "control_folder": str(_celery_dir / "control"),
    }
    CELERY_RESULT_BACKEND = f"file://{_celery_dir / 'results'}"
CELERY_TASK_SERIALIZER = "json"
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True

REST_FRAMEWORK = {
    "EXCEPTION_HANDLER": "apps.core.errors.drf_exception_handler",
    "DEFAULT_AUTHENTICATION_CLASSES": [],
    "DEFAULT_PERMISSION_CLASSES": [],
    "UNAUTHENTICATED_USER": None,
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["apps.api.parsers.JSONBodyParser"],
}
DATA_UPLOAD_MAX_MEMORY_SIZE = IGNIS["server.body_limit"]

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
STATIC_ROOT.mkdir(exist_ok=True)  # whitenoise warns at start about a missing root
# Whitenoise indexes the apps' static files at start: no collectstatic step.
WHITENOISE_USE_FINDERS = True
WHITENOISE_AUTOREFRESH = False
WHITENOISE_MAX_AGE = 3600

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_TZ = True

_LOG_LEVEL = IGNIS["server.log_level"].upper()
if _LOG_LEVEL not in ("DEBUG", "INFO", "WARNING", "ERROR"):
    raise ValueError(f"server.log_level must be debug, info, warning or error, not {IGNIS['server.log_level']!r}")

_LOG_FORMAT = IGNIS["server.log_format"].lower()
if _LOG_FORMAT not in ("json", "text"):
    raise ValueError(f"server.log_format must be json or text, not {IGNIS['server.log_format']!r}")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "main": {"()": f"ignis_site.jsonlog.{'JsonFormatter' if _LOG_FORMAT == 'json' else 'TextFormatter'}"}
    },
    "filters": {"drop_deliberate_503": {"()": "ignis_site.jsonlog.DropDeliberate503"}},
    "handlers": {
        "stderr": {"class": "logging.StreamHandler", "formatter": "main", "level": _LOG_LEVEL},
        # The engine's request and model events feed the metrics' histograms (engine/telemetry.py).
        "telemetry": {"class": "engine.telemetry.TelemetryHandler"},
    },
    "loggers": {
        # The telemetry handler needs INFO events whatever stderr shows.
        "ignis": {
            "handlers": ["stderr", "telemetry"],
            "level": "DEBUG" if _LOG_LEVEL == "DEBUG" else "INFO",
            "propagate": False,
        },
        "django": {"handlers": ["stderr"], "level": "WARNING"},
        "django.request": {
            "handlers": ["stderr"],
            "level": "WARNING",
            "filters": ["drop_deliberate_503"],
            "propagate": False,
        },
        "daphne": {"handlers": ["stderr"], "level": "WARNING"},
        # The embedded Celery worker logs through this configuration too (ignis_site/celery.py).
        "celery": {"handlers": ["stderr"], "level": "WARNING", "propagate": False},
        "kombu": {"handlers": ["stderr"], "level": "WARNING", "propagate": False},
    },
}
# warnings.warn (Celery's "running as root", deprecations) becomes a log record, not a raw stderr print.
jsonlog.capture_warnings()
