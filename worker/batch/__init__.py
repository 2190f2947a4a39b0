"""The running batch: a job made a row (job_prep, sequence), the one interface the engine core drives
(running_batch) and its kinds (in slots, in state slots, compacted, one job at a time), the passes
they share, the one out-of-memory policy, the served model that picks the kind, and a row's
generation read back."""
