"""Which replicas are live: one probe loop per replica, on the server's event loop.

A probe asks the actor whether its engine is healthy. No answer within the timeout, an actor
error, or ``False`` takes the replica out (``on_down``); an answer of ``True`` from a replica
that was out brings it back (``on_up``): Ray restarted its actor and the new engine is built
(calls to a restarting actor wait until it is up, which is why a timeout, not an error, is what
a restart looks like). Ray answers ActorDiedError at once for an actor it will not restart any
more; when every replica has answered so a few times in a row, ``on_all_dead`` is called.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

# Consecutive ActorDiedError answers after which a replica counts as gone for good.
_DEAD_FOR_GOOD_PROBES = 3


class ReplicaHealth:
    def __init__(
        self,
        actors: list[Any],
        interval_s: float,
        timeout_s: float,
        on_down: Callable[[int, str], None],
        on_up: Callable[[int], None],
        on_all_dead: Callable[[BaseException], None],
    ) -> None:
        self.actors = actors
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.on_down = on_down
        self.on_up = on_up
        self.on_all_dead = on_all_dead
        self._live = [True] * len(actors)
        self._died_probes = [0] * len(actors)
        self._tasks: list[asyncio.Task] = []
        self.num_downs = 0

    @property
    def is_running(self) -> bool:
        return any(not task.done() for task in self._tasks)

    def live_replicas(self) -> list[int]:
        return [replica for replica, live in enumerate(self._live) if live]

    def is_live(self, replica: int) -> bool:
        return self._live[replica]

    def mark_down(self, replica: int) -> bool:
        """Take a replica out; False if it already was."""
        if not self._live[replica]:
            return False
        self._live[replica] = False
        self.num_downs += 1
        return True

    def start(self) -> None:
        if self.is_running:
            return
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._probe_loop(replica), name=f"pagedllm-replica-{replica}-health")
                       for replica in range(len(self.actors))]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def _probe_loop(self, replica: int) -> None:
        import ray

        while True:
            try:
                healthy = await asyncio.wait_for(_await_ref(self.actors[replica].check_health.remote()),
                                                 timeout=self.timeout_s)
                reason = "its engine reports unhealthy"
                self._died_probes[replica] = 0
            except asyncio.CancelledError:
                raise
            except TimeoutError:
                healthy, reason = False, f"no answer to a health probe within {self.timeout_s:g} s"
            except ray.exceptions.ActorDiedError as exc:
                healthy, reason = False, "its actor died"
                self._died_probes[replica] += 1
                if all(count >= _DEAD_FOR_GOOD_PROBES for count in self._died_probes):
                    self.on_all_dead(exc)
                    return
            except Exception as exc:  # noqa: BLE001 - any other failure to answer is a replica down
                healthy, reason = False, f"health probe failed: {type(exc).__name__}"
            if healthy and not self._live[replica]:
                self._live[replica] = True
                self.on_up(replica)
            elif not healthy and self._live[replica]:
                self.on_down(replica, reason)
            await asyncio.sleep(self.interval_s)


async def _await_ref(ref: Any) -> Any:
    return await ref
