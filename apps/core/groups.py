"""Membership of a Channels group for a listener that runs for the process's life."""

from __future__ import annotations

import asyncio
import logging

GROUP_REFRESH = 3600.0  # channels_redis forgets group members after a day


async def join_forever(layer, group: str, channel: str, log: logging.Logger, event: str) -> None:
    """Add ``channel`` to ``group`` now and again every GROUP_REFRESH seconds; a failed add
    is logged as ``event`` and retried in 5 s. Runs until cancelled."""
    while True:
        try:
            await layer.group_add(group, channel)
        except Exception:
            log.exception(event)
            await asyncio.sleep(5)
            continue
        await asyncio.sleep(GROUP_REFRESH)
