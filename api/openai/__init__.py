"""The OpenAI-compatible API's own parts (the routes are api/routes/openai.py): the wire models
(protocol), requests to jobs (requests), the one submit-and-wait flow (submit), finished jobs as
answers (responses) or as server-sent events (stream), and errors in OpenAI's shape (errors)."""
