"""`cpn agent`: the per-cluster agent that reports GPUs, links and heartbeats."""

from __future__ import annotations

import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit

import typer

from api.cli.errors import FAILED, fail


class DiscoveryChoice(StrEnum):
    auto = "auto"
    nvml = "nvml"
    kubernetes = "kubernetes"
    inventory = "inventory"


def _http_url(value: str | None, flag: str) -> str | None:
    if value is None:
        return None
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise typer.BadParameter(
            f"{value!r} is not an http(s) URL with a host; use e.g. http://controller:8000",
            param_hint=flag,
        )
    return value.rstrip("/")


def _controller(value: str) -> str:
    return _http_url(value, "--controller") or value


def _advertise(value: str | None) -> str | None:
    """Peers fetch this URL, so it obeys the protocol's probe-URL rule (no query, no creds)."""
    from agents.protocol import check_probe_url

    url = _http_url(value, "--advertise-url")
    if url is None:
        return None
    try:
        return check_probe_url(url)
    except ValueError as exc:
        raise typer.BadParameter(f"{url!r}: {exc}", param_hint="--advertise-url") from None


def _cluster(value: str) -> str:
    if not 1 <= len(value) <= 63:
        raise typer.BadParameter(
            "give a cluster name of 1 to 63 characters", param_hint="--cluster"
        )
    return value


def _token(value: str) -> str:
    if not value.strip():
        raise typer.BadParameter(
            "empty token; pass the cluster's agent key with --token or CPN_AGENT_TOKEN",
            param_hint="--token",
        )
    return value.strip()


def _agent_version() -> str:
    from api.version import VERSION

    return VERSION


def agent(
    cluster: Annotated[
        str, typer.Option(help="Name of the cluster this agent reports for.", callback=_cluster)
    ],
    controller: Annotated[
        str,
        typer.Option(
            help="Base URL of the control plane, e.g. http://cpn:8000.", callback=_controller
        ),
    ],
    token: Annotated[
        str,
        typer.Option(
            envvar="CPN_AGENT_TOKEN",
            show_envvar=True,
            help="Agent API key bound to this cluster.",
            callback=_token,
        ),
    ],
    inventory: Annotated[
        Path | None,
        typer.Option(
            help="YAML file declaring the cluster's GPUs (used when neither NVML nor Kubernetes "
            "applies, or with --discovery inventory)."
        ),
    ] = None,
    discovery: Annotated[
        DiscoveryChoice,
        typer.Option(
            help="GPU source; auto tries NVML, then Kubernetes (in a pod), then --inventory."
        ),
    ] = DiscoveryChoice.auto,
    probe_host: Annotated[
        str, typer.Option(help="Address the probe endpoint listens on.")
    ] = "0.0.0.0",
    probe_port: Annotated[
        int, typer.Option(min=0, max=65535, help="Probe endpoint port; 0 picks a free one.")
    ] = 9100,
    advertise_url: Annotated[
        str | None,
        typer.Option(
            help="Probe URL peers should use (default http://<probe-host or 127.0.0.1>:<port>).",
            callback=_advertise,
        ),
    ] = None,
    once: Annotated[
        bool,
        typer.Option("--once", help="Send one heartbeat, print the controller's answer and exit."),
    ] = False,
    backoff_base: Annotated[
        float, typer.Option(min=0.0, help="First retry delay ceiling, s.")
    ] = 1.0,
    backoff_cap: Annotated[float, typer.Option(min=0.0, help="Largest retry delay, s.")] = 30.0,
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING or ERROR.")] = "INFO",
) -> None:
    """Run the agent of one cluster: discover GPUs, heartbeat, measure WAN links to peers."""
    import logging
    import signal
    import threading

    from agents.backoff import Backoff
    from agents.controller_client import ControllerClient, ControllerError
    from agents.discovery import DiscoveryError, select_source
    from agents.probe_server import ProbeServer, default_probe_url
    from agents.runner import AgentConfig, AgentRunner

    level = logging.getLevelName(log_level.upper())
    if not isinstance(level, int):
        raise fail("agent", "--log-level", "use DEBUG, INFO, WARNING or ERROR")
    logging.basicConfig(
        level=level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if level > logging.DEBUG:  # httpx logs every request at INFO: one line per probe
        for noisy in ("httpx", "httpcore"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    log = logging.getLogger("agents.cli")
    version = _agent_version()

    try:
        source = select_source(discovery.value, inventory)
    except DiscoveryError as exc:  # its message starts with the flag at fault
        raise fail("agent", None, str(exc)) from None
    log.info("cluster %s: GPU discovery through %s", cluster, source.source)
    client = ControllerClient(controller, token, user_agent=f"cpn-agent/{version}")
    try:
        if once:
            # No probe endpoint outlives this call, so only an explicit URL is advertised.
            from agents.protocol import Heartbeat

            try:
                beat = Heartbeat(
                    cluster=cluster,
                    agent_version=version,
                    probe_url=advertise_url,
                    discovery=source.source,
                    gpus=source.collect(),
                )
                ack = client.heartbeat(beat)
            except (ControllerError, DiscoveryError) as exc:
                raise fail("agent", None, str(exc), FAILED) from None
            print(ack.model_dump_json(indent=2))
            return
        try:
            server = ProbeServer(probe_host, probe_port)
        except OSError as exc:
            raise fail(
                "agent",
                "--probe-port",
                f"cannot listen on {probe_host}:{probe_port} "
                f"({exc.strerror or exc}); pick a free port, or 0 for any",
            ) from None
        probe_url = advertise_url or default_probe_url(probe_host, server.port)
        if advertise_url is None and probe_host in ("0.0.0.0", "::", ""):
            log.warning(
                "advertising %s to peers; pass --advertise-url when peers run on other hosts",
                probe_url,
            )
        stop = threading.Event()

        def _on_signal(signum: int, _frame: object) -> None:
            log.info("received %s, stopping", signal.Signals(signum).name)
            stop.set()

        previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        server.start()
        try:
            runner = AgentRunner(
                AgentConfig(cluster, probe_url, version),
                source,
                client,
                backoff=Backoff(backoff_base, backoff_cap),
                stop=stop,
            )
            log.info("cluster %s: heartbeating to %s, probe URL %s", cluster, controller, probe_url)
            runner.run()
        finally:
            server.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        log.info("agent stopped")
    finally:
        client.close()
        source.close()


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the root CLI app."""
    app.command("agent")(agent)
