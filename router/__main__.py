"""`kvroute` command line: serve, check a config, list strategies, and the bench tools."""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib.metadata import PackageNotFoundError, version

import uvloop

import policies
from router import log
from router.config import DEFAULT_STRATEGY, LOG_LEVELS, ConfigError, advice, load
from router.errors import ListenError


def _version() -> str:
    try:
        return version("kvroute")
    except PackageNotFoundError:
        return "unknown"


def _strategy(text: str) -> str:
    """A strategy name in any case, as registered; argparse lists the names if unknown."""
    return policies.canonical(text) or text


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="run the router",
        description=(
            "Run the router in front of vLLM backends. Settings come from the YAML file "
            "(-c); flags override it; with --backend no file is needed."
        ),
    )
    p.add_argument("-c", "--config", metavar="FILE", help="YAML config file")
    p.add_argument("--host", metavar="ADDR", help="listen address (config default 127.0.0.1)")
    p.add_argument("--port", type=int, metavar="PORT", help="listen port (config default 8000)")
    p.add_argument(
        "--backend",
        action="append",
        metavar="URL",
        help="a vLLM server, e.g. http://10.0.0.5:8000; repeat for each; replaces the file's list",
    )
    _routing_options(p)
    _process_options(p)
    p.add_argument("--check", action="store_true", help="validate the config and exit")


def _routing_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--strategy",
        type=_strategy,
        choices=policies.names(),
        help=f"routing strategy, in any case (config default {DEFAULT_STRATEGY})",
    )
    p.add_argument(
        "--prefix-length",
        type=int,
        metavar="TOKENS",
        help="tokens in the prefix fingerprint (PREFIX_AWARE)",
    )
    p.add_argument(
        "--concurrency-threshold",
        type=int,
        metavar="N",
        help="in-flight requests at which a pinned backend spills over (PREFIX_AWARE)",
    )


def _process_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--grpc-port",
        type=int,
        metavar="PORT",
        help="also serve the gRPC ingress on this port (grpc.enabled)",
    )
    p.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="processes sharing the listen port (config `workers`; 0 or unset: one per "
        "usable core; 1: a single process, no supervisor)",
    )
    p.add_argument(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVELS,
        help="config default info; nothing is logged per request at any level (the "
        "access log aside), and failures are throttled",
    )
    p.add_argument(
        "--log-format",
        choices=("text", "json"),
        help="text, or json: one JSON object per line, the access log's too (config "
        "log_format, default text)",
    )
    p.add_argument(
        "--access-log",
        metavar="FILE",
        help="where each request's line goes: - for standard output (config access_log, "
        "default -), a file to append to, or off",
    )


def _overrides(args: argparse.Namespace) -> dict:
    backends = [{"url": url} for url in args.backend] if args.backend else None
    return {
        "listen.host": args.host,
        "listen.port": args.port,
        "backends": backends,
        "routing.strategy": args.strategy,
        "routing.prefix_length": args.prefix_length,
        "routing.concurrency_threshold": args.concurrency_threshold,
        "grpc.enabled": True if args.grpc_port is not None else None,
        "grpc.port": args.grpc_port,
        "log_level": args.log_level,
        "log_format": args.log_format,
        "access_log.enabled": False if args.access_log == "off" else None,
        "access_log.path": args.access_log if args.access_log not in (None, "off") else None,
        "workers": args.workers,
    }


def _cmd_serve(args: argparse.Namespace) -> int:
    overrides = _overrides(args)
    from router.control.paths import unwritable
    from router.control.serve import hold_reloads, serve

    hold_reloads()
    from router.control.worker import Router

    try:
        config = load(args.config, overrides)
        if args.check:
            Router(config)  # also reads the secrets and tokenizer the config names
    except (ConfigError, OSError, ValueError) as exc:
        print(f"kvroute: invalid config: {exc}", file=sys.stderr)
        return 2
    if problem := unwritable(config):  # before any worker meets it
        print(f"kvroute: {problem}", file=sys.stderr)
        return 2
    if args.check:
        for warning in advice(config):
            print(f"kvroute: warning: {warning}", file=sys.stderr)
        counted = log.counted(len(config.backends), "backend")
        print(f"config OK: {counted}, strategy {config.strategy}")
        return 0
    from router.control.reload import ConfigSource
    from router.control.supervisor import Supervisor, worker_count

    # a cluster's link to the other replicas is the collector's: one runs even for 1 worker
    supervised = worker_count(config) > 1 or config.cluster is not None
    log.setup(config.log_level, "supervisor" if supervised else None, config.log_format)
    for warning in advice(config):
        log.server.warning("%s", warning)
    try:
        if supervised:
            return Supervisor(config, args.config, overrides).run()
        uvloop.run(serve(config, ConfigSource(args.config, overrides)))
    except ListenError as exc:  # the port is taken, or the address is not ours
        print(f"kvroute: {exc}", file=sys.stderr)
        return 1
    except ConfigError as exc:  # a secret the config names cannot be read
        print(f"kvroute: invalid config: {exc}", file=sys.stderr)
        return 2
    return 0


def _cmd_policies(args: argparse.Namespace) -> int:
    for name in policies.names():
        cls = policies.policy_class(name)
        summary = (sys.modules[cls.__module__].__doc__ or "").strip().splitlines()[0]
        print(f"{name:28} {summary.removeprefix(name + ': ')}")
        print(f"{'':28} use when {cls.use_when}")
        tunable = ", ".join(sorted(cls.params_type.pool_tunable))
        if tunable:
            print(f"{'':28} a pool may set: {tunable}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvroute",
        description="KV-cache-aware router for fleets of vLLM servers.",
    )
    parser.add_argument("--version", action="version", version=f"kvroute {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _serve_parser(sub)
    sub.add_parser("policies", help="list the routing strategies")
    for name, (_, text) in _TOOLS.items():
        tool = sub.add_parser(name, help=text, add_help=False)
        tool.add_argument("args", nargs=argparse.REMAINDER)
    return parser


#: subcommands implemented elsewhere, each with its own `main(argv)` and --help
_TOOLS = {
    "token": ("router.ingress.auth", "issue a signed data-plane token (kvroute token issue -h)"),
    "sim": ("bench.sim.cli", "run simulated vLLM servers (see kvroute sim --help)"),
    "bench": (
        "bench.harness.compare",
        "compare routing strategies on one workload (kvroute bench -h)",
    ),
    "demo": (
        "bench.harness.demo",
        "4 simulated backends, 4 strategies, one table, in about a minute",
    ),
    "health": (
        "router.control.probe",
        "GET /health on the config's listener over loopback (the image's HEALTHCHECK)",
    ),
    "recommend": (
        "bench.harness.recommend",
        "advise a strategy and its parameters from a capture (kvroute recommend -h)",
    ),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in _TOOLS:
        module = importlib.import_module(_TOOLS[argv[0]][0])
        return module.main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    commands = {"serve": _cmd_serve, "policies": _cmd_policies}
    if args.command is None:
        parser.print_help()
        return 2
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
