"""The torch threads an engine process takes (worker/engine/runtime.py), from the settings and the cores."""

from __future__ import annotations

from shared.settings import Settings
from worker.engine.runtime import torch_threads_for


def test_the_engines_torch_threads_leave_a_core_to_the_rest_of_the_stack():
    """ACTQ_TORCH_THREADS unset: 1 on 2 cores or fewer (the API, Redis and Celery share them), else
    the cores less one; set, it is taken as given; inter-op threads are 1 unless set."""
    unset = Settings(torch_threads=None)
    assert [torch_threads_for(unset, cores) for cores in (1, 2, 3, 4, 16)] == [1, 1, 2, 3, 15]
    assert torch_threads_for(Settings(torch_threads=2), cores=2) == 2
    assert torch_threads_for(unset) >= 1  # this machine's cores
    assert unset.torch_interop_threads == 1 and Settings(torch_interop_threads=4).torch_interop_threads == 4
