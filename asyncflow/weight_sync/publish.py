"""One version from the policy to every rollout instance, as the driver runs it: every
instance starts receiving (in the background, generating meanwhile), the policy's ranks send,
then the instances swap it in, ``wave`` at a time, so that with a wave smaller than the
instances some always keep generating.

The warm-up and phase syncs swap one instance at a time (``wave=1``); the streaming executor
swaps in waves of ``ExecutorConfig.swap_wave`` and times every call under the step the new
weights serve (``timed``). A swap that fails is raised once every swap of its wave has ended,
so that none is left running unseen; later waves do not start.

An instance of the first wave whose worker has ``take_weights`` (receive and swap in one call)
gets that one call, made beside the publish, instead of a receive before it and a swap after:
one request a version fewer for each (with one instance, every version's only swap).
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
    takers = {k for k in range(min(wave, len(instances))) if _takes(instances[k])}
    # receiving first (the others), then the publish, beside the takers' one call each
    await asyncio.gather(*(inst.receive_weights(version) for k, inst in enumerate(instances) if k not in takers))
    takes = {k: asyncio.ensure_future(timed(instances[k], instances[k].take_weights(version))) for k in sorted(takers)}
    try:
        await timed(policy, policy.publish_weights(version))
    except BaseException:
        for t in takes.values():  # the instances' calls end by their own timeouts
            t.cancel()
        await asyncio.gather(*takes.values(), return_exceptions=True)
        raise
    if on_published is not None:
        await on_published()
    for start in range(0, len(instances), wave):
        members = list(range(start, min(start + wave, len(instances))))
        swaps = [takes[k] if k in takes else timed(instances[k], instances[k].swap_weights(version)) for k in members]
        outcomes = await asyncio.gather(*swaps, return_exceptions=True)
        failed = next((o for o in outcomes if isinstance(o, BaseException)), None)
        if failed is not None:
            raise failed
        if on_swapped is not None:
            await on_swapped(members)


def _takes(instance: Any) -> bool:
    """Whether the instance's worker group has ``take_weights`` (a registered method)."""
    return "take_weights" in getattr(instance, "methods", {})
