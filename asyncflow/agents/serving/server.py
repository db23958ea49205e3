"""An instance's endpoint: the aiohttp app served on the episode runner's event loop."""
from __future__ import annotations

from aiohttp import web

from .app import make_app
from .keys import EpisodeKeys
from .spec import EndpointSpec

__all__ = ["EndpointServer"]


class EndpointServer:
    def __init__(self, spec: EndpointSpec, keys: EpisodeKeys | None = None) -> None:
        self.spec = spec
        self.keys = keys or EpisodeKeys()
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> None:
        # handler_cancellation: a client that disconnects cancels its handler (its request is aborted)
        # shutdown_timeout: closing does not wait for idle keep-alive connections of agents' clients
        runner = web.AppRunner(make_app(self.keys, self.spec.model_name), handler_cancellation=True,
                               access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.spec.host, self.spec.port).start()
        except OSError as e:
            await runner.cleanup()
            raise RuntimeError(f"OpenAI endpoint: cannot listen on {self.spec.host}:{self.spec.port}: {e}") from e
        self._runner = runner
        self.port = int(runner.addresses[0][1])

    @property
    def base_url(self) -> str:
        host = f"[{self.spec.host}]" if ":" in self.spec.host else self.spec.host
        return f"http://{host}:{self.port}/v1"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
