"""Helpers the tests share (imported by tests; conftest files only hold fixtures):

stack.py       TestStack: a local stack with submit/wait helpers, and Redis counting helpers
models.py      a model description for API tests that run without a worker
tiny_model.py  a tiny random-weight Llama built at test time
reference.py   the independent forward-hook reference for captured activations
host_reads.py  counting host reads of tensor values (a GPU sync each): bench_step.py and tests/gpu
s3_server.py   SeaweedFS, a real S3-compatible server on loopback ports
"""
