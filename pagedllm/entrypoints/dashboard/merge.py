"""Several replicas' snapshots as one: their pools side by side, their numbers summed.

The merged snapshot has the shape of one (engine/snapshot.py), so the page draws it unchanged: the
device maps are concatenated in replica order (replica 1's block 0 follows replica 0's last
block), likewise the CPU maps; request indices and shared-block owners are shifted to match, and
each request names its ``replica``. ``segments`` says where each replica's blocks start. Counts,
queue lengths, memory categories, sharing figures and counters are sums.
"""

from __future__ import annotations

from typing import Any

_POOL_ARRAYS = ("state", "ref", "fill")


def merge_snapshots(snapshots: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One snapshot of the replicas' pools together; ``snapshots`` maps replica -> its snapshot (non-empty)."""
    if not snapshots:
        raise ValueError("merge_snapshots needs at least one replica's snapshot")
    replicas = sorted(snapshots)
    first = snapshots[replicas[0]]
    merged: dict[str, Any] = {
        "block_size": first["block_size"],
        "kv_allocation": first["kv_allocation"],
        "requests": [],
        "requests_omitted": 0,
        "map": _empty_map(),
        "cpu_map": _empty_map(),
        "segments": [],
    }
    for name in ("blocks", "queues", "waste", "sharing", "counters"):
        merged[name] = _sum_numbers([snapshots[replica].get(name, {}) for replica in replicas])
    for replica in replicas:
        snapshot = snapshots[replica]
        request_offset = len(merged["requests"])
        merged["requests"].extend(dict(request, replica=replica) for request in snapshot["requests"])
        merged["requests_omitted"] += snapshot.get("requests_omitted", 0)
        segment = {"replica": replica}
        for key, label in (("map", "start"), ("cpu_map", "cpu_start")):
            segment[label] = len(merged[key]["state"])
            _append_pool(merged[key], snapshot[key], request_offset)
        segment["blocks"] = len(snapshot["map"]["state"])
        segment["cpu_blocks"] = len(snapshot["cpu_map"]["state"])
        merged["segments"].append(segment)
    return merged


def _empty_map() -> dict[str, Any]:
    return {"state": [], "ref": [], "owner": [], "fill": [], "owners": {}}


def _append_pool(into: dict[str, Any], pool: dict[str, Any], request_offset: int) -> None:
    block_offset = len(into["state"])
    for name in _POOL_ARRAYS:
        into[name].extend(pool[name])
    into["owner"].extend(owner + request_offset if owner >= 0 else -1 for owner in pool["owner"])
    for block_id, owners in pool["owners"].items():
        into["owners"][str(int(block_id) + block_offset)] = [owner + request_offset for owner in owners]


def _sum_numbers(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Key-wise sums of the numeric fields (a field one part lacks counts as 0 there)."""
    total: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                total[key] = total.get(key, 0) + value
    return total
