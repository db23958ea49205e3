"""One version from the policy to every rollout instance, as the driver runs it: every
instance starts receiving (in the background, generating meanwhile), the policy's ranks send,
then the instances swap it in, ``wave`` at a time, so that with a wave smaller than the
instances some always keep generating.

The warm-up and phase syncs swap one instance at a time (``wave=1``); the streaming executor
swaps in waves of ``ExecutorConfig.swap_wave`` and times every call under the step the new
weights serve (``timed``). A swap that fails is raised once every swap of its wave has ended,
so that none is left running unseen; later waves do not start.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

Timed = Callable[[Any, Awaitable[Any]], Awaitable[Any]]  # (the group called, its call) -> the call, awaited


def _untimed(group: Any, call: Awaitable[Any]) -> Awaitable[Any]:
    return call


async def publish_and_swap(policy: Any, instances: Sequence[Any], version: int, *, wave: int = 1,
                           timed: Timed = _untimed,
                           on_published: Callable[[], Awaitable[None]] | None = None,
                           on_swapped: Callable[[list[int]], Awaitable[None]] | None = None) -> None:
    """Publish the policy's weights as ``version`` and have every instance take them.

    policy: the worker group that publishes (``publish_weights``); instances: the rollout
    instances (``receive_weights``, ``swap_weights``), swapped in this order. ``timed`` wraps
    the publish and each swap; ``on_published()`` runs once the policy's ranks have sent,
    ``on_swapped(indices)`` after each wave with the indices of its instances.
    """
    if wave < 1:
        raise ValueError(f"publish_and_swap: wave must be at least 1 instance, got {wave}")
    await asyncio.gather(*(inst.receive_weights(version) for inst in instances))  # receiving first
    await timed(policy, policy.publish_weights(version))
    if on_published is not None:
        await on_published()
    for start in range(0, len(instances), wave):
        members = list(range(start, min(start + wave, len(instances))))
        outcomes = await asyncio.gather(*(timed(instances[k], instances[k].swap_weights(version)) for k in members),
                                        return_exceptions=True)
        failed = next((o for o in outcomes if isinstance(o, BaseException)), None)
        if failed is not None:
            raise failed
        if on_swapped is not None:
            await on_swapped(members)
