"""The error hierarchy: every error type a job can be stored with is a class of it."""

from __future__ import annotations

import re
from pathlib import Path

from shared import errors

ROOT = Path(__file__).resolve().parents[2]


def test_every_stored_error_type_is_a_job_failure_class():
    assert errors.JobFailure.stored_types() == {
        "job_failed",  # JobFailure itself: an edit that cannot apply, a grammar that does not compile
        "context_length_exceeded",
        "storage_error",
        "timeout",
        "out_of_memory",
        "worker_lost",
        "unsupported_by_worker",  # a rolling upgrade: a newer API's request on an older worker
        "cancelled",
        "internal_error",
        "nnsight_error",  # nnsight jobs (docs/nnsight.md)
        "weights_written",
        "result_too_large",
        "payload_mismatch",
    }


def test_no_error_type_is_written_as_a_string_in_the_product():
    """Errors are stored through JobFailure.as_error(); a literal {"type": ...} would bypass it."""
    names = "|".join(errors.JobFailure.stored_types())
    literal = re.compile(rf"""["']type["']\s*:\s*["']({names})["']""")
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for folder in ("api", "worker", "shared")
        for path in (ROOT / folder).rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), start=1)
        if literal.search(line)
    ]
    assert found == []


def test_a_failure_is_stored_as_its_type_and_message():
    assert errors.WorkerLost("lost twice").as_error() == {"type": "worker_lost", "message": "lost twice"}
    assert errors.StorageError("disk full").status_code == 503
    assert issubclass(errors.JobCancelled, errors.JobFailure)


def test_context_length_messages_write_plain_integers_as_vllm_does():
    """Clients read the figures out of vLLM's message with `(\\d+)`: "8,192" would read as 8."""
    for message in (
        errors.over_context(8192, 8000, 1500),
        errors.over_context(8192, 8000, 1500, at_least="its first message alone"),
    ):
        assert re.search(r"maximum context length is (\d+) tokens", message).group(1) == "8192", message
        assert "9500" in message and "1500" in message and not re.search(r"\d,\d", message), message
