"""The dashboard's views: one engine, or replicas seen all together and one by one (``?replica=``).

Each view is its own DashboardHub (its own history, token rates and latency windows), so
switching the page to replica 1 shows replica 1's series, not a slice of everyone's. Like a
single hub, a view does work only while someone watches it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedllm.entrypoints.dashboard.hub import DashboardHub


class UnknownViewError(ValueError):
    """``?replica=`` names no view of this dashboard."""


class DashboardViews:
    def __init__(self, hubs: dict[str, DashboardHub], default: str,
                 replica_states: Callable[[], list[dict[str, Any]]] | None = None) -> None:
        if default not in hubs:
            raise ValueError(f"default view {default!r} is not one of {list(hubs)}")
        self.hubs = hubs
        self.default = default
        # None: one engine, no replicas to choose from.
        self.replica_states = replica_states

    @classmethod
    def single(cls, hub: DashboardHub) -> DashboardViews:
        return cls({"engine": hub}, "engine")

    @property
    def default_hub(self) -> DashboardHub:
        return self.hubs[self.default]

    def hub(self, view: str | None) -> DashboardHub:
        """The hub of ``view`` (None: the default one)."""
        if view is None:
            return self.default_hub
        if self.replica_states is None:
            raise UnknownViewError("This server runs one engine: there are no replicas to choose with ?replica=.")
        hub = self.hubs.get(view.strip().lower())
        if hub is None:
            raise UnknownViewError(f"?replica= must be one of {', '.join(self.hubs)}; got {view!r}.")
        return hub

    def describe(self) -> dict[str, Any]:
        """The /dashboard/replicas document: the views and every replica's live state."""
        if self.replica_states is None:
            return {"views": [], "default": None, "replicas": []}
        return {"views": list(self.hubs), "default": self.default, "replicas": self.replica_states()}
