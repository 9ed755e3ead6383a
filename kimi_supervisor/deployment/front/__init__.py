"""The front (docs/front.md): owns the public port, forwards to the engine's Unix socket, holds requests while the
engine is not serving and resumes those a restart broke.

routes.py: which paths are forwarded, held, resumed or refused; gate.py: the engine's serving state and the
bounded hold; upstream.py: the engine's socket (requests and the /health probe); sse.py: server-sent events;
resume.py: what a stream keeps and how it continues through the token-in route; metrics.py: what clients saw;
proxy.py: the aiohttp application that puts them together.  Only proxy.py and upstream.py import aiohttp (the
`[front]` extra).
"""
