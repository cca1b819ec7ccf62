"""Run the HTTP server: bind first, then start the engine process and uvicorn."""

from __future__ import annotations

import logging
import socket
from typing import Any

import uvicorn
from omegaconf import OmegaConf

from strata.config import ConfigError, validate_engine
from strata.serve.app import create_app

log = logging.getLogger("strata.serve")


def _bind(host: str, port: int) -> socket.socket:
    """Bind before anything starts, so a taken port is a clean error and port 0 works."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    err: Exception = OSError(f"cannot resolve {host!r}")
    for family, kind, proto, _name, addr in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.set_inheritable(False)
            return sock
        except OSError as e:
            sock.close()
            err = e
    raise err


#: Longest wait a server knob may ask for (s): a year, well inside threading.TIMEOUT_MAX.
MAX_WAIT_S = 365 * 86400.0

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def validate_server(s: Any) -> None:
    def bad(key: str, msg: str) -> None:
        raise ConfigError(f"server.{key}: {msg}")

    if not 0 <= int(s.port) <= 65535:
        bad("port", f"must be in [0, 65535] (0 = any free port), got {s.port}")
    if int(s.max_pending) < 1:
        bad("max_pending", f"must be >= 1, got {s.max_pending}")
    # Finite and waitable: inf (or 1e300) passed `< 0`, then the supervisor thread died in
    # Event.wait (OverflowError) at the first restart, and every Retry-After (/health while
    # loading) was a 500 (int(inf)); nan passed too, and meant 0.
    for key, zero in (("restart_delay_s", ""), ("step_timeout_s", " (0 = never)"),
                      ("queue_timeout_s", " (0 = no limit)")):
        if not 0 <= float(getattr(s, key)) <= MAX_WAIT_S:
            bad(key, f"must be in [0, {MAX_WAIT_S:g}] s{zero}, got {getattr(s, key)}")
    if str(s.log_level).lower() not in LOG_LEVELS:
        bad("log_level", f"must be one of {', '.join(LOG_LEVELS)}, got {s.log_level!r}")
    if s.api_key is not None and not str(s.api_key):
        bad("api_key", "must be null (no key) or a non-empty string")


def serve(cfg: Any) -> int:
    """Serve until SIGINT/SIGTERM (0); 1 when the engine cannot start at all; 2: bad config."""
    scfg = cfg.server
    try:
        validate_server(scfg)
        validate_engine(cfg.engine)     # the engine checks again; this fails before binding
    except ConfigError as e:
        log.error("error: %s", e)
        return 2
    level = str(scfg.log_level).lower()
    logging.getLogger("strata.serve").setLevel(level.upper() if level != "trace" else "DEBUG")
    try:
        sock = _bind(scfg.host, int(scfg.port))
    except OSError as e:
        log.error("cannot listen on %s:%s: %s", scfg.host, scfg.port, e)
        return 1
    host, port = sock.getsockname()[:2]
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    app = create_app(cfg_dict, scfg)
    max_pending = int(scfg.max_pending)
    config = uvicorn.Config(
        app, log_level=level, access_log=level in ("debug", "trace"),
        timeout_keep_alive=5, timeout_graceful_shutdown=3,
        # Connections beyond this get a plain 503 from uvicorn before any app code runs.
        limit_concurrency=max(256, 2 * max_pending + 64),
    )
    server = uvicorn.Server(config)
    app.state.fatal_hooks.append(lambda _msg: setattr(server, "should_exit", True))
    shown = f"[{host}]" if ":" in host else host
    log.info("strata server listening on http://%s:%d (api key %s); model loading in the engine "
             "process, GET /health says 200 once it is ready", shown, port,
             "required" if scfg.api_key else "off")
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:   # uvicorn re-raises the Ctrl-C it handled once it has shut down
        pass
    sup = app.state.sup
    if sup.fatal_message:
        log.error("exiting: %s", sup.fatal_message)
        return 1
    return 0
