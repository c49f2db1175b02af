"""Serving: an OpenAI-compatible HTTP server (``spd-serve``) on a pipeline loaded once.

``pipeline.py`` loads the engine (in this process, or rank 0 of stage processes started once);
``scheduler.py`` queues requests and runs them on the engine's thread (one at a time, or many at once with
``--max-batch``); ``app.py`` is the HTTP layer (FastAPI, server-sent events), ``middleware.py`` what runs around
every route (the API key, the body's size, the access log) and ``state.py`` what the routes share; ``requests.py``
and ``protocol.py`` the OpenAI wire format; ``metrics.py`` the Prometheus metrics. Needs the ``serve`` extra
(fastapi, uvicorn, prometheus-client).
"""
