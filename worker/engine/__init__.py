"""The engine process: its lifetime (process, runtime), the core loop and the scheduler that decides
each step, a job's flow through it (claim -> batch -> results -> outcome), and what runs beside the
loop on threads (progress and streamed text, the API's tokenizer calls, nnsight jobs' way in and
out)."""
