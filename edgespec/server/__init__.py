"""`edgespec serve`: a local OpenAI-compatible HTTP server over one Engine.

command.py is the verb (the only part that writes to the terminal); app.py the ASGI app and
its routes; openai.py, anthropic.py, responses.py and ollama.py each API's bodies and answers
(the other three translated into openai.ChatRequest); schemas.py what they share (ApiError, Shape);
worker.py the generation threads and the request queue. `create_app` is importable for embedding
the app in another ASGI server.
"""
from .command import add_parser

__all__ = ["add_parser", "create_app"]


def __getattr__(name):
    # the web stack is an optional extra: import it only when the app itself is wanted
    if name == "create_app":
        from .app import create_app
        return create_app
    raise AttributeError(name)
