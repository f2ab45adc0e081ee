"""The one configuration schema: ``server.*``, ``model.*``, ``switch.*``, ``spec.*``, ``cuda.*``.

Every key has one value, settable (weakest first) by its default, the saved
configuration (``ConfigValue`` rows a PATCH /v1/config or the admin wrote), the
environment (``IGNIS_MODEL_PREFILL_CHUNK``), and a CLI flag of the serve /
runengine commands (``--model-prefill-chunk``). The environment is read here
and nowhere else; the saved rows are read by the commands at start
(``apps.models.config_service.config_start``) and handed to ``resolve``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MiB = 1 << 20


# model.prefill_chunk's default on the cuda backend, chosen by measurement on the H200 (docs/PERFORMANCE.md,
# "Prefill on the CUDA backend": bench/bench_cuda.py --prefill's chunk sweep); the others keep 1024.
CUDA_PREFILL_CHUNK = 2048


@dataclass(frozen=True)
class Field:
    key: str
    type: type
    default: Any
    help: str
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()  # a str key's only values (empty: any string)

    @property
    def env_name(self) -> str:
        return "IGNIS_" + self.key.replace(".", "_").upper()

    @property
    def flag(self) -> str:
        return "--" + self.key.replace(".", "-").replace("_", "-")

    def parse(self, raw: Any, *, strict: bool = False) -> Any:
        """Coerce ``raw`` (a string from env/CLI, or a JSON value) or raise ValueError.

        ``strict`` (a JSON patch): an array or object is never a value, and a
        string key takes only a string (not a number, null, or a list written
        as its Python repr). Numbers and booleans may still come as strings
        ("0.5", "off"), as from the environment.
        """
        if strict:
            self._check_json_type(raw)
        if self.type is bool:
            if isinstance(raw, bool):
                return raw
            s = str(raw).strip().lower()
            if s in ("1", "true", "yes", "on"):
                return True
            if s in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"{self.key} must be a boolean")
        if self.type in (int, float):
            if isinstance(raw, bool):
                raise ValueError(f"{self.key} must be a number")
            if self.type is int and isinstance(raw, float) and not raw.is_integer():
                raise ValueError(f"{self.key} must be an integer")
            try:
                value = self.type(raw)
            except (TypeError, ValueError):
                raise ValueError(f"{self.key} must be {'an integer' if self.type is int else 'a number'}") from None
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{self.key} must be finite")
            if self.minimum is not None and value < self.minimum:
                raise ValueError(f"{self.key} must be >= {self.minimum}")
            if self.maximum is not None and value > self.maximum:
                raise ValueError(f"{self.key} must be <= {self.maximum}")
            return value
        if raw is None:
            return None
        value = str(raw)
        if self.choices and value not in self.choices:
            raise ValueError(f"{self.key} must be one of {' | '.join(self.choices)}")
        return value

    def _check_json_type(self, raw: Any) -> None:
        if isinstance(raw, list | dict) or (self.type is str and not isinstance(raw, str)):
            kind = "a string" if self.type is str else "a boolean" if self.type is bool else "a number"
            raise ValueError(f"{self.key} must be {kind}, not {_json_kind(raw)}")


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


FIELDS: dict[str, Field] = {
    f.key: f
    for f in [
        Field("server.host", str, "127.0.0.1", "address the API listens on"),
        Field("server.port", int, 8080, "port the API listens on", 0, 65535),
        Field("server.metrics_bind", str, "127.0.0.1:9464", "loopback listener for /metrics ('' = off)"),
        Field(
            "server.front_ends",
            int,
            1,
            "serve: HTTP front-end processes sharing the API port, each with its own interpreter "
            "(more than 1 needs server.redis_url; docs/FLEET.md, Front ends on one host)",
            1,
            64,
        ),
        Field(
            "server.channel_hub",
            str,
            "",
            "Unix socket of the channel hub the processes of serve --server-front-ends share "
            "(serve sets it for its children; '' = none)",
        ),
        Field(
            "server.reuse_port",
            bool,
            False,
            "bind the API port with SO_REUSEPORT, so several serve processes share it (IPv4 hosts)",
        ),
        Field(
            "server.gc_freeze",
            bool,
            True,
            "serve, runengine: freeze the objects the process holds once started and after each model load, "
            "so the garbage collector's passes scan only what was made since",
        ),
        Field(
            "server.switch_interval_us",
            int,
            5000,
            "serve, runengine: the interpreter's thread switch interval in microseconds (Python's own: 5000)",
            50,
            20000,
        ),
        Field("server.body_limit", int, 4 * MiB, "largest request body in bytes", 1024, 1 << 30),
        Field("server.api_keys", str, "", "comma-separated API keys ('' = no auth)"),
        Field(
            "server.cors_origins",
            str,
            "",
            "comma-separated origins a browser page may call /v1 from ('*' = any, '' = none)",
        ),
        Field(
            "server.read_timeout",
            float,
            60.0,
            "seconds a request's headers and body may take to arrive (0 = no bound)",
            0,
            86400,
        ),
        Field("server.api_keys_file", str, "", "file of API keys, one a line ('#' comments), beside server.api_keys"),
        Field("server.deadline", float, 600.0, "seconds a request may run before it is cut (0 = none)", 0, 86400),
        Field("server.deadline_max", float, 3600.0, "largest per-request 'deadline' a client may ask for", 1, 86400),
        Field("server.models_dir", str, "", "where artifacts live (default: ./models)"),
        Field("server.log_level", str, "info", "level of the log on stderr: debug | info | warning | error"),
        Field("server.log_format", str, "json", "the log on stderr: json (one object a line) | text (for people)"),
        Field("server.data_dir", str, "", "state: SQLite, Celery queue, caches (default: ./var)"),
        Field("server.redis_url", str, "", "Redis URL: scaled mode (engine in `runengine`)"),
        Field(
            "server.database_url",
            str,
            "",
            "postgresql://user[:password]@host[:port]/name: Django's database ('' = SQLite under server.data_dir)",
        ),
        Field(
            "server.socket_idle_close",
            int,
            600,
            "idle seconds before a Responses WebSocket closes (0 = never)",
            0,
            1 << 31,
        ),
        Field(
            "server.sse_keepalive",
            float,
            5.0,
            "seconds between ': keepalive' comments while a stream waits or prefills (0 = off)",
            0,
            300,
        ),
        Field("server.responses_keep", int, 10000, "stored responses kept for previous_response_id", 1, 1 << 31),
        Field("server.image_fetch", bool, False, "fetch http(s) image URLs of image parts (off: data: URLs only)"),
        Field(
            "server.image_fetch_hosts",
            str,
            "",
            "comma-separated hosts image URLs may name ('*.example.com' = subdomains)",
        ),
        Field(
            "server.image_fetch_private",
            bool,
            False,
            "image fetches may reach a listed host's loopback and private addresses (link-local never)",
        ),
        Field("server.image_fetch_max_bytes", int, 16 * MiB, "largest fetched image, in bytes", 1024, 1 << 30),
        Field("server.image_fetch_timeout", float, 10.0, "seconds an image fetch may take in all", 0.1, 300),
        Field("server.engine_heartbeat", float, 1.0, "seconds between the engine's status heartbeats", 0.05, 60),
        Field(
            "server.engine_timeout",
            float,
            5.0,
            "seconds without an engine heartbeat before a front end takes the engine for gone",
            0.2,
            3600,
        ),
        Field(
            "server.worker_id",
            str,
            "",
            "runengine: this worker's id in a fleet, its channel ignis.engine.<id> ('' = the one engine channel)",
        ),
        Field(
            "server.worker_timeout",
            float,
            0.0,
            "seconds without a worker's heartbeat before a front end drops it from the fleet (0 = server.engine_timeout)",
            0,
            3600,
        ),
        Field("model.id", str, "smollm2-135m-instruct", "served id of the model loaded at start"),
        Field("model.path", str, "", "artifact path (default: the catalog's file for model.id)"),
        Field(
            "model.backend", str, "cpu", "cpu | numpy | cuda (cpu falls back to numpy where its kernels do not build)"
        ),
        Field(
            "model.weight_format",
            str,
            "auto",
            "weights on the backend: auto (as stored) | bf16 | fp8 (e4m3, quantized at load; backends that take fp8)",
            choices=("auto", "bf16", "fp8"),
        ),
        Field("model.prefill_chunk", int, 1024, f"tokens per prefill chunk (cuda: {CUDA_PREFILL_CHUNK})", 16, 1 << 20),
        Field(
            "model.short_prefill",
            int,
            16,
            "a prompt whose uncached tail is at most this many tokens joins the decode round as rows (0 = never)",
            0,
            64,
        ),
        Field("model.decode_share", float, 0.25, "fraction of time decoding lanes keep during a prefill", 0.0, 0.95),
        Field("model.prefill_group", bool, True, "prompts that fit one prefill chunk together prefill in one step"),
        Field(
            "model.async_rounds", bool, True, "plan each decode round while the one before computes (backends that can)"
        ),
        Field("model.default_max_tokens", int, 1024, "generation cap when a request sets none", 1, 1 << 20),
        Field("model.max_context", int, 8192, "largest prompt + generation, in tokens", 64, 1 << 22),
        Field("model.kv_block_size", int, 16, "tokens per KV page", 1, 1024),
        Field("model.kv_ram_budget", int, 768 * MiB, "numpy backend: bytes for the KV pool", MiB, 1 << 40),
        Field("model.host_kv_budget", int, 2048 * MiB, "bytes of host RAM for swapped KV pages", 0, 1 << 42),
        Field(
            "model.gpu_budget",
            float,
            0.9,
            "CUDA backend: device memory a load may take (weights + workspace + KV pool): up to 1 a fraction"
            " of the card's free memory at load, above 1 bytes",
            0.01,
            float(1 << 50),
        ),
        Field("model.blas_threads", int, 1, "numpy backend: BLAS threads (0 = BLAS's own default)", 0, 256),
        Field("model.cpu_threads", int, 0, "cpu backend: kernel threads (0 = every core)", 0, 1024),
        Field("model.idle_unload", int, 300, "seconds idle before unloading (0 = never)", 0, 1 << 31),
        Field(
            "model.ram_budget",
            int,
            0,
            "numpy backend: bytes for weights + workspace + KV (0 = weights + workspace + model.kv_ram_budget)",
            0,
            1 << 44,
        ),
        Field(
            "model.max_image_pixels",
            int,
            32 * MiB,
            "largest image decoded, in pixels (width x height, read from its header before decoding)",
            1,
            89_478_485,  # Pillow's own decompression-bomb limit (Image.MAX_IMAGE_PIXELS)
        ),
        Field("model.max_images", int, 16, "images one request may hold (vision-language models)", 0, 1024),
        Field("switch.allow_implicit", bool, True, "a request naming another known model switches to it"),
        Field("switch.known_models", str, "", "comma-separated ids (or id=path) an implicit switch may reach"),
        Field(
            "switch.drain_timeout",
            float,
            30.0,
            "seconds running requests get to finish before a switch (and before a SIGTERMed worker exits)",
            0,
            3600,
        ),
        Field(
            "switch.fleet_policy",
            str,
            "idle",
            "which worker an implicit switch takes when none serves the model: idle | least_loaded | none",
        ),
        Field(
            "server.celery_worker",
            bool,
            True,
            "serve starts an embedded Celery worker (--pool=solo); default off with server.redis_url",
        ),
        Field("spec.decode_lanes", int, 8, "decode lanes (rows of one round)", 1, 64),
        Field("spec.enabled", bool, True, "speculative rounds: drafts (prompt lookup, prediction) verified per round"),
        Field("spec.max_draft", int, 8, "drafts a lane proposes at most in one round (0 = none)", 0, 63),
        Field("spec.cost_aware", bool, False, "keep only the drafts worth their rows' time in the round"),
        Field("spec.ngram", int, 4, "longest n-gram prompt lookup matches (down to 2)", 1, 16),
        Field("spec.loop_guard", bool, True, "take back reasoning that loops and force the end of the thinking"),
        Field("spec.loop_guard_min_span", int, 8, "loop guard: shortest repeating span (tokens) that counts", 1, 4096),
        Field("spec.loop_guard_max_span", int, 256, "loop guard: longest repeating span (tokens) watched", 1, 4096),
        Field("spec.loop_guard_count", int, 3, "loop guard: back-to-back occurrences of a span that fire it", 2, 64),
        Field(
            "spec.draft_model",
            str,
            "",
            "a draft model (same tokenizer) proposing drafts: a folder or GGUF in the models directory",
        ),
        Field("spec.draft_kv", int, 256 * MiB, "bytes of the draft model's KV pool", MiB, 1 << 40),
        Field(
            "cuda.gemv_u2_below",
            int,
            40 * MiB,
            "CUDA backend: matrices of fewer weights run the 2-step tensor-core GEMV (0 = none)",
            0,
            1 << 62,
        ),
        Field("cuda.kernel_cache_dir", str, "", "CUDA backend: compiled kernels (default: <models dir>/.cache/pycuda)"),
        Field(
            "cuda.round_rows",
            int,
            16,
            "CUDA backend: rows one decode round may hold, lanes and their verify rows (8 with quantized weights)",
            8,
            64,
        ),
        Field(
            "cuda.known_rows",
            int,
            64,
            "CUDA backend: rows a decode round may hold when those past cuda.round_rows are known tokens "
            "(short prompts' tails, forced tokens), not drafts; 0 = cuda.round_rows",
            0,
            64,
        ),
        Field(
            "cuda.pdl",
            bool,
            False,
            "CUDA backend: launch a decode round's kernels with programmatic dependent launch (each starts as the one before ends)",
        ),
        Field(
            "cuda.pinned_upload",
            bool,
            True,
            "CUDA backend: upload bf16 weights at load through pinned, double-buffered staging (off: a copy a tensor)",
        ),
        Field(
            "cuda.quant_activations",
            bool,
            False,
            "CUDA backend: decode GEMVs over GGUF blocks quantize x to int8 (per 32) for integer mma (not yet run on a card)",
        ),
        Field(
            "cuda.gemv_pair",
            bool,
            True,
            "CUDA backend: bf16 GEMVs of 33..64 rows run in blocks of two tiles sharing x (the same bits)",
        ),
        Field(
            "cuda.decode_lanes",
            bool,
            False,
            "CUDA backend: decode attention of 9+ rows takes a lane's rows in one block (the same bits; measured slower)",
        ),
        Field(
            "cuda.fp8_gemm",
            bool,
            False,
            "CUDA backend: prefill of per-channel FP8 weights on the fp8 tensor cores (x quantized to e4m3 a row)",
        ),
        Field(
            "cuda.narrow_tiles",
            bool,
            True,
            "CUDA backend on Hopper: a prefill GEMM of 33..128 rows may take 64- or 32-column tiles (the same bits)",
        ),
        Field(
            "cuda.attention_spans",
            bool,
            False,
            "CUDA backend on Hopper: a prefill pass of several prompts runs a layer's attention as one launch (same bits)",
        ),
        Field(
            "cuda.expert_budget",
            int,
            0,
            "CUDA backend: device bytes for MoE experts (0 = all resident); fewer: the rest in pinned host RAM",
            0,
            1 << 44,
        ),
    ]
}


def resolve(
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
    saved: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[str, str]]:
    """(values, sources): defaults < ``saved`` < the environment < ``overrides`` (CLI flags).

    ``sources[key]`` names where each value came from: ``default``, ``saved``,
    ``env`` or ``flag``. A saved value for a START_ONLY key, or one that no
    longer parses, is ignored (the environment and flags always get an
    operator out of a bad saved value).
    """
    environ = os.environ if environ is None else environ
    values, sources = {}, {}
    for key, field in FIELDS.items():
        value, source = field.default, "default"
        if saved and key in saved and key not in START_ONLY_KEYS:
            try:
                value, source = field.parse(saved[key]), "saved"
            except ValueError:
                pass
        if field.env_name in environ:
            value, source = field.parse(environ[field.env_name]), "env"
        if overrides and overrides.get(key) is not None:
            value, source = field.parse(overrides[key]), "flag"
        values[key], sources[key] = value, source
    if sources["model.prefill_chunk"] == "default" and values["model.backend"] == "cuda":
        values["model.prefill_chunk"] = CUDA_PREFILL_CHUNK
    if sources["server.celery_worker"] == "default" and values["server.redis_url"]:
        # Scaled mode: one dedicated `celery -A ignis_site worker`, not one per front end.
        values["server.celery_worker"] = False
    return values, sources


def load(overrides: dict[str, Any] | None = None, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Defaults, then the environment, then ``overrides`` (CLI flags); no saved configuration."""
    return resolve(overrides, environ)[0]


# Keys the settings module is built from before the database opens: the
# environment or a flag sets them, never the saved configuration (PATCH refuses them).
START_ONLY_KEYS = frozenset(
    {
        "server.data_dir",
        "server.redis_url",
        "server.database_url",
        "server.models_dir",
        "server.log_level",
        "server.log_format",
        "server.worker_id",  # one per process: a saved value would give every worker the same
        "server.channel_hub",
        "server.front_ends",  # the processes serve starts: a saved value would be each child's too
        "server.reuse_port",
        "server.switch_interval_us",  # set as the process starts
        "server.gc_freeze",
    }
)

# Keys a load is built from: changing one reloads the model (the way a switch does).
RELOAD_KEYS = frozenset(
    {
        "model.id",
        "model.path",
        "model.backend",
        "model.weight_format",
        "model.max_context",
        "model.kv_block_size",
        "model.kv_ram_budget",
        "model.host_kv_budget",
        "model.gpu_budget",
        "model.ram_budget",
        "spec.decode_lanes",
        "spec.draft_model",
        "spec.draft_kv",
    }
)
# Keys that apply to the running server at once; the rest need a restart.
LIVE_KEYS = frozenset(
    {
        "model.prefill_chunk",
        "model.short_prefill",
        "model.decode_share",
        "model.prefill_group",
        "model.async_rounds",
        "model.default_max_tokens",
        "model.idle_unload",
        "spec.enabled",
        "spec.max_draft",
        "spec.cost_aware",
        "spec.loop_guard",
        "spec.loop_guard_min_span",
        "spec.loop_guard_max_span",
        "spec.loop_guard_count",
        "switch.allow_implicit",
        "switch.known_models",
        "switch.drain_timeout",
        "server.api_keys",
        "server.cors_origins",
        "server.read_timeout",
        "server.body_limit",
        "server.deadline",
        "server.deadline_max",
        "server.engine_timeout",
        "server.image_fetch",
        "server.image_fetch_hosts",
        "server.image_fetch_private",
        "server.image_fetch_max_bytes",
        "server.image_fetch_timeout",
        "model.max_image_pixels",
        "model.max_images",
        "server.worker_timeout",
        "switch.fleet_policy",
    }
)


def key_applies(key: str) -> str:
    """``reload``, ``live`` or ``restart``: what setting ``key`` on a running server does."""
    return "reload" if key in RELOAD_KEYS else "live" if key in LIVE_KEYS else "restart"


def validate(patch: dict[str, Any]) -> dict[str, Any]:
    """Parsed values for ``patch`` (JSON values of each key's type) or ValueError(key, message) on the
    first bad one; nothing is applied."""
    parsed = {}
    for key, raw in patch.items():
        field = FIELDS.get(key)
        if field is None:
            raise ValueError(key, f"unknown configuration key '{key}'")
        if key in START_ONLY_KEYS:
            raise ValueError(key, f"{key} is read before the database opens: set {field.env_name} or {field.flag}")
        try:
            parsed[key] = field.parse(raw, strict=True)
        except ValueError as exc:
            raise ValueError(key, str(exc)) from None
    return parsed


def database_settings(url: str, sqlite_path: Path) -> dict[str, Any]:
    """Django's DATABASES["default"] for ``server.database_url`` (PostgreSQL), or SQLite at ``sqlite_path``."""
    if not url:
        # Writers come from several threads of one process (the request path, the engine state
        # listener recording switches, Celery's solo worker): BEGIN IMMEDIATE takes the write
        # lock up front and waits for it (timeout), where a deferred transaction that reads
        # then writes fails at once with "database is locked" when another writer holds it.
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": sqlite_path,
            "OPTIONS": {"timeout": 20, "transaction_mode": "IMMEDIATE"},
        }
    from urllib.parse import unquote, urlsplit

    parts = urlsplit(url)
    if parts.scheme not in ("postgres", "postgresql"):
        raise ValueError(f"server.database_url must be a postgresql:// URL, not {parts.scheme or url!r}")
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": unquote(parts.path.lstrip("/")) or "ignis",
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "",
        "PORT": str(parts.port or ""),
        "CONN_MAX_AGE": 0,
    }


def worker_options(values: dict[str, Any]) -> dict[str, Any]:
    """The engine worker's own settings (idle unload, switch drain, RAM plan, heartbeat)."""
    return {
        "idle_unload": values["model.idle_unload"],
        "drain_timeout": values["switch.drain_timeout"],
        "ram_budget": values["model.ram_budget"],
        "heartbeat": values["server.engine_heartbeat"],
        "worker_id": values["server.worker_id"] or None,
    }


def engine_config_dict(values: dict[str, Any]) -> dict[str, Any]:
    """The subset the engine's EngineConfig takes (plain dict: no engine import here)."""
    return {
        "backend": values["model.backend"],
        "decode_lanes": values["spec.decode_lanes"],
        "prefill_chunk": values["model.prefill_chunk"],
        "short_prefill": values["model.short_prefill"],
        "decode_share": values["model.decode_share"],
        "prefill_group": values["model.prefill_group"],
        "async_rounds": values["model.async_rounds"],
        "default_max_tokens": values["model.default_max_tokens"],
        "max_context": values["model.max_context"],
        "block_size": values["model.kv_block_size"],
        "weight_format": values["model.weight_format"],
        "kv_ram_budget": values["model.kv_ram_budget"],
        "host_kv_budget": values["model.host_kv_budget"],
        "blas_threads": values["model.blas_threads"],
        "spec_enabled": values["spec.enabled"],
        "spec_max_draft": values["spec.max_draft"],
        "spec_cost_aware": values["spec.cost_aware"],
        "spec_ngram": values["spec.ngram"],
        "loop_guard": values["spec.loop_guard"],
        "loop_guard_min_span": values["spec.loop_guard_min_span"],
        "loop_guard_max_span": values["spec.loop_guard_max_span"],
        "loop_guard_count": values["spec.loop_guard_count"],
        "spec_draft_model": draft_model_path(values),
        "spec_draft_kv": values["spec.draft_kv"],
        "cpu_threads": values["model.cpu_threads"],
        # Compiled code belongs to the checkout, not to a models directory: every server of this
        # checkout (and each test's own models directory) shares one build (engine/backends/cpu/build.py).
        "cpu_kernel_cache_dir": "",
        "cuda": cuda_tuning_dict(values),
    }


def draft_model_path(values: dict[str, Any]) -> str:
    """``spec.draft_model`` as a path inside the models directory ("" for none); ValueError otherwise."""
    raw = values["spec.draft_model"]
    if not raw:
        return ""
    models = Path(models_dir(values)).resolve()
    if "\x00" in raw or not (path := (models / raw).resolve()).is_relative_to(models):
        raise ValueError("spec.draft_model", f"spec.draft_model must name a model inside {models}")
    return str(path)


def models_dir(values: dict[str, Any]) -> str:
    """server.models_dir, or the repository's models/ when unset."""
    return values["server.models_dir"] or str(Path(__file__).resolve().parent.parent / "models")


def cuda_tuning_dict(values: dict[str, Any]) -> dict[str, Any]:
    """EngineConfig.cuda (CudaTuning); the kernel cache defaults into the models dir."""
    models = models_dir(values)
    return {
        "gemv_u2_below": values["cuda.gemv_u2_below"],
        "kernel_cache_dir": values["cuda.kernel_cache_dir"] or os.path.join(models, ".cache", "pycuda"),
        "expert_budget": values["cuda.expert_budget"],
        "gpu_budget": values["model.gpu_budget"],
        "round_rows": values["cuda.round_rows"],
        "known_rows": values["cuda.known_rows"],
        "pdl": values["cuda.pdl"],
        "pinned_upload": values["cuda.pinned_upload"],
        "quant_activations": values["cuda.quant_activations"],
        "gemv_pair": values["cuda.gemv_pair"],
        "decode_lanes": values["cuda.decode_lanes"],
        "fp8_gemm": values["cuda.fp8_gemm"],
        "narrow_tiles": values["cuda.narrow_tiles"],
        "attention_spans": values["cuda.attention_spans"],
    }
