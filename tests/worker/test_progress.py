"""worker/engine/progress.py on a real Redis: a round reads every running job's cancel flag (one
command while none is set) and, every `write_every` seconds, writes their progress; a streamed
job's new text goes to its Redis Stream with its offset, and an `end` entry follows once the job
has left; an unedited twin's count is not the job's."""

from __future__ import annotations

import logging
import time

import pytest
import redis
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from shared import keys
from shared.jobs import JobStore
from shared.outages import REDIS, outage
from worker.engine.progress import TEXT_TTL_SECONDS, ProgressWatch
from worker.engine.text_stream import TextStream

VOCAB = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}


@pytest.fixture
def tokenizer() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    backend.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def entries(client: redis.Redis, job_id: str) -> list[dict[str, str]]:
    return [{k.decode(): v.decode() for k, v in fields.items()} for _, fields in client.xrange(keys.job_text(job_id))]


def test_a_streamed_job_s_text_goes_to_its_stream_then_end(redis_client, tokenizer):
    watch = ProgressWatch(JobStore(redis_client, 60), interval=1)  # rounds by hand: poll()
    generated: list[int] = []
    watch.add("job", TextStream(tokenizer, generated, stops=[" STOP"]))
    watch.add("plain")
    generated += [1, 2]
    assert watch.update("job", 2) is False and watch.update("plain", 5) is False
    watch.poll()
    assert redis_client.get(keys.progress("job")) == b"2" and redis_client.get(keys.progress("plain")) == b"5"
    assert entries(redis_client, "job") == [{"at": "0", "t": "Hello w"}]  # 4 characters held for " STOP"
    assert not redis_client.exists(keys.job_text("plain"))
    assert 0 < redis_client.ttl(keys.job_text("job")) <= TEXT_TTL_SECONDS
    generated.append(3)
    watch.update("job", 3)
    watch.poll()
    watch.poll()  # nothing new: nothing written
    assert entries(redis_client, "job")[1:] == [{"at": "7", "t": "o"}]
    watch.remove("job")
    watch.poll()
    assert entries(redis_client, "job")[2:] == [{"end": "1"}]
    watch.poll()
    assert len(entries(redis_client, "job")) == 3  # `end` once


def test_a_cancel_flag_is_seen_and_a_twin_count_is_not_the_job_s(redis_client):
    jobs = JobStore(redis_client, 60)
    watch = ProgressWatch(jobs, interval=1)
    watch.add("job")
    watch.update("job", 4)
    assert watch.update("job", None) is False  # the twin: reads the flag, leaves the count
    redis_client.set(keys.cancel("job"), 1)  # as the API's cancel of a running job sets it
    watch.poll()
    assert redis_client.get(keys.progress("job")) == b"4"
    assert watch.update("job", None) is True and watch.update("job", 5) is True


def test_rounds_between_progress_writes_read_every_cancel_flag_in_one_command(redis_client):
    """Progress is written every `write_every` seconds, cancel flags are read every round: with no
    flag set a round is one command, whatever the number of jobs; a flag set is seen for its job only."""
    calls: list[str] = []

    class Counted:  # the real client, each round trip it is asked for counted
        def __getattr__(self, name: str):
            calls.append(name)
            return getattr(redis_client, name)

    watch = ProgressWatch(JobStore(Counted(), 60), interval=1, write_every=3600)  # type: ignore[arg-type]
    for n in range(32):
        watch.add(f"job{n}")
        watch.update(f"job{n}", 1)
    watch.poll()  # the first round writes
    assert redis_client.get(keys.progress("job7")) == b"1"
    for n in range(32):
        watch.update(f"job{n}", 2)
    calls.clear()
    watch.poll()
    assert calls == ["exists"]  # one command for 32 jobs
    assert redis_client.get(keys.progress("job7")) == b"1"  # not written in this round
    redis_client.set(keys.cancel("job7"), 1)
    watch.poll()
    assert watch.update("job7", None) is True
    assert not any(watch.update(f"job{n}", None) for n in range(32) if n != 7)


def test_a_redis_outage_is_logged_once_not_every_round_and_its_end_once(own_redis, caplog):
    """Issue 47: the progress thread logged each failed 50 ms round, 20 lines a second for the whole
    outage. Redis stopped for real under a running job: one line when it goes, one when it is back."""
    client = redis.Redis.from_url(own_redis.url, socket_timeout=2, socket_connect_timeout=2)
    watch = ProgressWatch(JobStore(client, 60), interval=0.05)
    watch.add("job")
    caplog.set_level("INFO")
    client.ping()
    outage(REDIS).ok()  # Redis answers: an outage an earlier test of this process left open has ended
    caplog.clear()
    watch.start()
    try:
        time.sleep(0.3)
        own_redis.stop()
        time.sleep(1.5)  # about 30 rounds fail
        own_redis.start()
        deadline = time.monotonic() + 10
        while "Redis is back after" not in caplog.text:
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.05)
        assert client.get(keys.progress("job")) == b"0"  # rounds write again
    finally:
        watch.stop()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("Redis is unreachable") and warnings[1].startswith("Redis is back after")
