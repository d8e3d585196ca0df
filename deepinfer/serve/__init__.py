"""``deepinfer serve``: an OpenAI-compatible HTTP server over one continuously batching engine loop.

``protocol`` holds the request and response shapes, ``errors`` OpenAI's error JSON, ``engine_loop`` the one thread
that owns the engine, ``app`` the HTTP routes, ``launch`` both built from the command's flags; the command is ``deepinfer/cli/serve.py``. See docs/serve.md."""
