"""A real worker's KV cache in /metrics: it grows with the jobs that run together and, once they
have ended and ACTQ_KV_CACHE_SHRINK_SECONDS passed, shrinks; each heartbeat carries its size."""

from __future__ import annotations

import time

MODEL = "tiny-kv"
POSITION_BYTES = 4 * 2 * 2 * 16 * 4  # the tiny model: layers x (keys, values) x KV heads x head size x float32


def kv_cache(http) -> tuple[int, int, int] | None:
    """(bytes, slots, positions per slot) of the model's one live worker, as /metrics shows it."""
    found: dict[str, float] = {}
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("actq_kv_cache_") and f'model="{MODEL}"' in line:
            name, _, value = line.rpartition(" ")
            found[name.split("{")[0]] = float(value)
    if not found:
        return None
    return int(found["actq_kv_cache_bytes"]), int(found["actq_kv_cache_slots"]), int(found["actq_kv_cache_slot_tokens"])


def test_the_kv_cache_figure_follows_the_cache_as_it_grows_and_shrinks(live, tiny_dir):
    live.start_worker(
        MODEL, {"ACTQ_MODEL": str(tiny_dir), "ACTQ_MODEL_NAME": MODEL, "ACTQ_KV_CACHE_SHRINK_SECONDS": "5"}
    )
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 60}
    try:
        with live.client() as http:
            assert live.wait(http, live.submit(http, body))["status"] == "succeeded"
            seen = set()
            deadline = time.monotonic() + 10
            while (one := kv_cache(http)) is None or one[1] != 1:  # one job ran: one slot
                assert time.monotonic() < deadline, one
                time.sleep(0.1)
            seen.add(one)
            ids = [live.submit(http, body) for _ in range(6)]
            assert all(live.wait(http, job_id)["status"] == "succeeded" for job_id in ids)
            deadline = time.monotonic() + 4  # within the shrink delay: the six jobs' cache is still held
            while (grown := kv_cache(http)) is None or grown[1] < 2:
                assert time.monotonic() < deadline, grown
                time.sleep(0.1)
            seen.add(grown)
            deadline = time.monotonic() + 20
            while (shrunk := kv_cache(http)) is None or shrunk[1] != 1:  # idle for 5 s: back to one slot
                assert time.monotonic() < deadline, shrunk
                time.sleep(0.2)
            seen.add(shrunk)
    finally:
        live.stop_process(f"worker-{MODEL}")  # the shared stack's later tests do not need it
    assert grown[1] in (2, 4, 8) and grown[2] == one[2] == shrunk[2] == 256, seen  # jobs that ran together
    assert all(size == slots * tokens * POSITION_BYTES for size, slots, tokens in seen), seen
