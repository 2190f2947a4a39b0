"""What /metrics shows of the workers' figures in Redis, as their heartbeats write them
(shared/stats.py `record_steps`): each live worker's KV cache, its bytes, slots and positions."""

from __future__ import annotations

from shared import stats
from shared.registry import ModelRegistry


def scrape(http) -> dict[str, float]:
    values = {}
    for line in http.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def test_each_live_workers_kv_cache_is_reported_as_its_last_heartbeat_left_it(http, redis_client, settings):
    live, gone = "worker-tiny", "worker-gone"
    stats.record_steps(redis_client, "tiny", live, [3, 3], 16, 12.5, (8 * 16_384 * 1024, 8, 16_384))
    stats.record_steps(redis_client, "tiny", gone, [], 16, 0.0, (1 << 30, 16, 65_536))  # no live heartbeat
    grown = scrape(http)
    label = '{model="tiny",worker="worker-tiny"}'
    assert grown[f"actq_kv_cache_bytes{label}"] == 8 * 16_384 * 1024
    assert grown[f"actq_kv_cache_slots{label}"] == 8
    assert grown[f"actq_kv_cache_slot_tokens{label}"] == 16_384
    assert not any("worker-gone" in name for name in grown), "a worker with no live heartbeat is not reported"

    stats.record_steps(redis_client, "tiny", live, [], 16, 0.0, (256 * 1024, 1, 256))  # shrunk, idle
    shrunk = scrape(http)
    assert shrunk[f"actq_kv_cache_bytes{label}"] == 256 * 1024
    assert (shrunk[f"actq_kv_cache_slots{label}"], shrunk[f"actq_kv_cache_slot_tokens{label}"]) == (1, 256)

    registry = ModelRegistry(redis_client, settings.heartbeat_ttl)
    info = registry.get("tiny")
    assert info is not None
    registry.heartbeat(info, gone)  # it beats again: its figure is shown again
    both = scrape(http)
    assert both['actq_kv_cache_slots{model="tiny",worker="worker-gone"}'] == 16
