"""The running configuration: read it, patch it (GET / PATCH /v1/config, the admin).

A patch is validated whole before anything applies: one bad value is a 400
naming its key and nothing changes. Keys a load is built from reload the model
with the whole patch, the way a switch does; the reload must land for the patch
to apply. Live keys apply at once (the engine's through ``engine.configure``).

At start the commands read the saved configuration back (``config_start``):
defaults < saved (PATCH / admin) < environment < CLI flags.

Several front ends (scaled mode) agree through the Channels layer: a patch is
sent to the group CONFIG_GROUP, which every ``serve`` process joins at start
(``config_listen``), and each applies it to its own ``settings.IGNIS``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from typing import Any

from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings

from apps.core.engine_client import engine_configure
from apps.core.errors import InvalidRequest, ModelSwitchFailed
from apps.core.groups import join_forever
from apps.models.services import SwitchTarget, path_confine, servable_lookup, served_id_check, served_model
from engine.messages import SWITCHED, UNCHANGED
from ignis_site import config

# Config keys the engine applies live, and the name the engine knows each by.
ENGINE_LIVE = {
    "model.prefill_chunk": "prefill_chunk",
    "model.short_prefill": "short_prefill",
    "model.decode_share": "decode_share",
    "model.prefill_group": "prefill_group",
    "model.async_rounds": "async_rounds",
    "model.default_max_tokens": "default_max_tokens",
    "spec.enabled": "spec_enabled",
    "spec.max_draft": "spec_max_draft",
    "spec.cost_aware": "spec_cost_aware",
    "spec.loop_guard": "loop_guard",
    "spec.loop_guard_min_span": "loop_guard_min_span",
    "spec.loop_guard_max_span": "loop_guard_max_span",
    "spec.loop_guard_count": "loop_guard_count",
    "model.idle_unload": "idle_unload",
    "switch.drain_timeout": "drain_timeout",
}
SECRET_KEYS = {"server.api_keys"}
CONFIG_GROUP = "ignis.config"
_ORIGIN = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
log = logging.getLogger("ignis.config")
# Where each running value came from: default | saved | env | flag (set by config_start).
_sources: dict[str, str] = {}
_start_sources: dict[str, str] = {}


def saved_config() -> dict[str, Any]:
    """The saved rows (PATCH / admin) as {key: value}; {} before the first migrate. Sync ORM."""
    from django.db import DatabaseError

    from apps.models.models import ConfigValue

    try:
        return dict(ConfigValue.objects.filter(saved=True).values_list("key", "value"))
    except DatabaseError:
        return {}


def config_start(overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The serve / runengine commands' configuration: defaults < saved < environment < flags.

    Sync ORM: call it at command start, not on the event loop.
    """
    values, sources = config.resolve(overrides, saved=saved_config())
    settings.IGNIS.update(values)
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = values["server.body_limit"]
    _sources.clear()
    _sources.update(sources)
    _start_sources.clear()
    _start_sources.update(sources)
    return settings.IGNIS


def config_sources() -> dict[str, str]:
    return {k: _sources.get(k, "default") for k in config.FIELDS}


def config_describe() -> dict:
    values = {k: ("***" if k in SECRET_KEYS and v else v) for k, v in settings.IGNIS.items() if k in config.FIELDS}
    fields = {
        f.key: {
            "type": f.type.__name__,
            "default": f.default,
            "help": f.help,
            "applies": config.key_applies(f.key),
            "env": f.env_name,
            "flag": f.flag,
        }
        for f in config.FIELDS.values()
    }
    return {"object": "config", "values": values, "fields": fields, "sources": config_sources()}


def _persist(values: dict[str, Any]) -> None:
    """Save ``values`` (PATCH / admin): read back at the next start."""
    from apps.models.models import ConfigValue

    for key, value in values.items():
        ConfigValue.objects.update_or_create(key=key, defaults={"value": value, "saved": True})


def config_snapshot() -> None:
    """Record the values the server started with in the rows nothing saved (the admin lists every key)."""
    from apps.models.models import ConfigValue

    saved = set(ConfigValue.objects.filter(saved=True).values_list("key", flat=True))
    for key, value in settings.IGNIS.items():
        if key in config.FIELDS and key not in saved:
            ConfigValue.objects.update_or_create(key=key, defaults={"value": value})


def _reload_target(values: dict[str, Any]) -> SwitchTarget:
    served_id_check(values["model.id"], param="model.id")
    if values["model.path"]:
        return SwitchTarget(values["model.id"], path_confine(values["model.path"]))
    if values["model.id"] == served_model().served_id:
        return SwitchTarget(values["model.id"], served_model().path)
    return servable_lookup(values["model.id"])


def _engine_changes(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The engine fields a reload changes. Only those: the worker keeps the rest of what it runs with
    (a fleet's worker runs its own flags -- its backend, lanes, budgets -- which a front end's
    settings need not share)."""

    def engine(values: dict[str, Any]) -> dict[str, Any]:
        return {**config.engine_config_dict(values), "ram_budget": values["model.ram_budget"]}

    before, after = engine(old), engine(new)
    return {k: v for k, v in after.items() if before.get(k) != v}


async def config_update(*, patch: dict[str, Any]) -> dict:
    """Apply ``patch`` (dotted keys); returns the new values and, for a reload, how it ended."""
    from apps.models.switching import model_switch

    if not isinstance(patch, dict) or not patch:
        raise InvalidRequest("Send a JSON object of configuration keys and values.", code="invalid_json")
    try:
        parsed = config.validate(patch)
    except ValueError as exc:
        key, message = exc.args
        raise InvalidRequest(message, param=key) from None
    changed = {k: v for k, v in parsed.items() if settings.IGNIS.get(k) != v}
    if changed.get("spec.draft_model"):  # a path a client sends stays inside the models directory
        try:
            path_confine(changed["spec.draft_model"])
        except InvalidRequest as exc:
            raise InvalidRequest(exc.message, param="spec.draft_model", code="invalid_path") from None
    start_sources = dict(_start_sources)
    new_values = {**settings.IGNIS, **changed}
    result: dict[str, Any] = {"object": "config", "changed": sorted(changed), "reload": None}
    if any(config.key_applies(k) == "reload" for k in changed):
        target = await database_sync_to_async(_reload_target)(new_values)
        engine_cfg = _engine_changes(settings.IGNIS, new_values)
        done = await model_switch(target=target, trigger="config", config=engine_cfg, wait=True)
        result["reload"] = {k: done.get(k) for k in ("outcome", "reason", "seconds")}
        if done.get("outcome") not in (SWITCHED, UNCHANGED):  # unchanged: the engine runs this config already
            raise ModelSwitchFailed(
                f"The reload this patch needs did not land ({done.get('outcome')}): "
                f"{done.get('reason')}; nothing changed."
            )
    _apply_local(changed)
    live = {ENGINE_LIVE[k]: v for k, v in changed.items() if k in ENGINE_LIVE}
    if live:
        await engine_configure(live)  # every worker of a fleet
    await database_sync_to_async(_persist)(changed)
    if changed:
        await get_channel_layer().group_send(
            CONFIG_GROUP, {"type": "config.changed", "values": changed, "origin": _ORIGIN}
        )
    result["restart_required"] = sorted(k for k in changed if config.key_applies(k) == "restart")
    # Saved, but this server's environment or flags set them: they win again at the next start.
    result["overridden_at_start"] = sorted(k for k in parsed if start_sources.get(k) in ("env", "flag"))
    result["values"] = config_describe()["values"]
    return result


def _apply_local(changed: dict[str, Any]) -> None:
    settings.IGNIS.update(changed)
    if "server.body_limit" in changed:
        settings.DATA_UPLOAD_MAX_MEMORY_SIZE = changed["server.body_limit"]
    _sources.update(dict.fromkeys(changed, "saved"))


def config_received(msg: dict) -> bool:
    """Apply another front end's patch (a ``config.changed`` message); False when it is ours or not one."""
    if msg.get("type") != "config.changed" or msg.get("origin") == _ORIGIN:
        return False
    try:
        parsed = config.validate(msg.get("values") or {})
    except ValueError as exc:
        log.warning("ignis.config.bad_broadcast", extra={"error": str(exc.args)})
        return False
    _apply_local(parsed)
    log.info("ignis.config.applied", extra={"keys": sorted(parsed), "origin": msg.get("origin")})
    return True


async def config_listen() -> None:
    """Every ``serve`` process runs this for its life: join CONFIG_GROUP, apply what other front ends patch."""
    layer = get_channel_layer()
    # A plain channel, not a process-specific ``new_channel()`` one: channels_redis serves those
    # through one receive lock per process, which a receive that never ends would hold.
    channel = f"ignis.config.{_ORIGIN}"

    joiner = asyncio.ensure_future(join_forever(layer, CONFIG_GROUP, channel, log, "ignis.config.group_add_failed"))
    try:
        while True:
            try:
                msg = await layer.receive(channel)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("ignis.config.receive_failed")
                await asyncio.sleep(1)
                continue
            config_received(msg)
    finally:
        joiner.cancel()
