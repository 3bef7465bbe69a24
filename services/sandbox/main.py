"""Starts the sandbox: checks that the jail runs here (or warns that it is off), then serves until SIGTERM."""

from __future__ import annotations

import logging
import signal

from services.sandbox.config import SandboxConfig
from services.sandbox.jail import Jail, JailError
from services.sandbox.runtimes import RUNTIMES

log = logging.getLogger("sparrow.sandbox")

INSECURE_WARNING = (
    "jail.insecure_local is set: programs run UNJAILED (rlimits and an empty environment only; they see "
    "this machine's files and network). Development only: never point a trainer at this service."
)


class SetupError(ValueError):
    """The jail cannot run here; one line."""


def build_jail(config: SandboxConfig) -> Jail:
    """The jail of the config, checked once per runtime; SetupError where bubblewrap cannot run."""
    try:
        jail = Jail(config.jail.bwrap, config.jail.uid, config.jail.insecure_local, config.jail.proc)
        if jail.insecure_local:
            log.warning(INSECURE_WARNING)
        installed = [r for r in RUNTIMES.values() if r.interpreter() is not None]
        if not installed:
            raise JailError(f"no runtime of the table is installed ({', '.join(RUNTIMES)})")
        for runtime in installed:
            jail.check(runtime)
    except JailError as exc:
        raise SetupError(f"the sandbox will not run programs unjailed: {exc}") from None
    return jail


def serve(config: SandboxConfig) -> None:
    """Serve the API until SIGTERM or SIGINT; running programs finish first."""
    import uvicorn

    from services.sandbox.api import create_app

    log.info("config %s", config.dump())
    jail = build_jail(config)
    app = create_app(config, jail)
    server = uvicorn.Server(
        uvicorn.Config(app, host=config.api.host, port=config.api.port, log_level="warning", lifespan="on")
    )
    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # uvicorn's own handler stops it; exit 0
    try:
        log.info(
            "sandbox on http://%s:%d (docs at /docs), %d workers, queue limit %d",
            config.api.host,
            config.api.port,
            config.pool.workers,
            config.pool.queue_limit,
        )
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
