"""OpenAI-compatible serving over engine.service.Engine (`kvproof serve`).

    schemas.py     pydantic request/response models: the HTTP edge, bounds as constraints
    errors.py      one table from Finished.outcome (and submit's refusals) to HTTP answers
    bridge.py      engine thread -> asyncio; one abort per live choice when a client leaves
    generation.py  submit a request's choices, gather or stream them, answer or fail
    wire.py        OpenAI's JSON shapes for completions and chat, whole and streamed
    metrics.py     /metrics: engine.snapshot() at scrape time + the server's own timings
    app.py         the FastAPI app and its routes; dashboard.html is the page at /
    command.py     `kvproof serve`: uvicorn, startup lines, SIGTERM drains the engine
"""
