"""The front (docs/front.md): owns the public port, forwards to the engine's Unix socket, holds requests while the
engine is not serving and resumes those a restart broke.

routes.py: which paths are forwarded, held, resumed or refused; engine.py: each engine the front reaches (its
socket, /health probe, records and serving flag) and the pool that says which serves; records.py: the one reader
of an engine's records (its supervisor's state file and history, its weight holder's state file) and the hold
bound taken from them; watch.py: the task that probes the engines, the outages it sees, the front's headline and
state file; outages.py: what kind of restart an outage was; gate.py: the bounded hold; failure.py: the one
decision "the engine failed under this request"; context.py: what the handlers share; forward.py: requests passed
through, and non-streamed completions sent again; streams.py: a stream relayed and continued after a break;
resume.py: what a stream keeps and the requests that continue it (pure); sse.py: server-sent events; metrics.py:
what clients saw; proxy.py: the aiohttp application that routes each request; serve.py: the front's run; role.py:
the front as a role.  role.py and what it imports (records.py) import no aiohttp (the `[front]`
extra): every host chooses its role through it; the rest of the front's run does.
"""
