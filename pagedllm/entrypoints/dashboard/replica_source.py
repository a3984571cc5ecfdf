"""Engine replicas on Ray as a dashboard source: one live replica's pool, snapshot taken in its actor.

Each replica has its own KV pool; the page draws one at a time (the first live one, named in the
snapshot's ``replica``), taken between two of that replica's steps as EngineSource does in-process.
"""

from __future__ import annotations

import time
from typing import Any


class ReplicaSource:
    def __init__(self, replicated_engine: Any) -> None:
        self.replicated_engine = replicated_engine
        # The pool's format and size, the same on every replica (source_kv_cache reads it).
        self.kv_cache_info = dict(replicated_engine.engine.kv_cache_info)

    def now(self) -> float:
        return time.time()

    def is_alive(self) -> bool:
        return self.replicated_engine.is_healthy

    async def capture(self) -> dict[str, Any]:
        return await self.replicated_engine.capture_replica_snapshot()
