"""``compress serve``: an OpenAI-compatible HTTP server over the runtime's engine.

FastAPI + uvicorn on the HTTP side (:mod:`.app`, bodies checked by :mod:`.protocol`);
the engine runs on its own thread (:mod:`.engine_loop`) so a forward pass never holds up
the event loop. :mod:`.server` starts both (``serve`` in the foreground, ``ServerThread``
inside a process); :mod:`.cli` is the subcommand. Importing this package loads nothing
heavy.
"""
