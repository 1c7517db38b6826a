"""`python -m bench.sim` / `kvroute sim`: run N simulated vLLM servers until interrupted.

Every SimConfig field is a flag (`--time-scale` for `time_scale`), generated from the
Struct so the help text is the field's description; `--config FILE` reads the same keys
from YAML, and explicit flags win over the file. Faults use `--fault INDEX:MODE[:ARG]`.
`--instances N` says how many servers to run; it is a count, not an address, so it is
not named like `kvroute serve --backend URL`. `--roles prefill decode ...` gives each
instance its P/D kv_role, for a disaggregated fleet; `--speeds 1,1,0.5,0.5` gives each
its speed, for a mixed fleet (every step of a 0.5 instance takes twice as long). Once
every socket is bound, stderr names the served model (and the roles, if any is not
"both"), and stdout gets one line per instance, `http://HOST:PORT`, then (with
--kv-events) one line per instance, `kv-events http://HOST:PORT pub=tcp://...
replay=tcp://...`, flushed, so a harness can read the addresses when ports are free-picked.
"""

import argparse
import asyncio
import contextlib
import signal
import sys
import typing
from typing import Annotated, Any, Literal

import msgspec
import uvloop
import yaml

from bench.sim.fleet import SimFleet, start_fleet
from bench.sim.params import Fault, SimConfig, SimParams, load_config

_METAVARS: dict[type, str] = {int: "N", float: "X", str: "TEXT"}
_FAULT_ARG = {"fail": "status", "close_midstream": "after_chunks", "slow": "factor"}
_FAULT_HELP = (
    "inject a fault into instance INDEX (0..N-1) from the start; repeatable. MODE: "
    "fail[:STATUS] (inference and /health answer STATUS, default 503), hang (never answer), "
    "close_midstream[:N] (cut streams after N chunks, default 3), slow[:FACTOR] (steps "
    "FACTOR times longer, default 5), none. "
    'Change it at runtime with POST /sim/fault, e.g. {"mode": "slow", "factor": 5}.'
)

_EPILOG = f"""example:
  kvroute sim --instances 2 --base-port 8100
      two servers, http://127.0.0.1:8100 and http://127.0.0.1:8101, serving {SimParams().model}
  kvroute serve --backend http://127.0.0.1:8100 --backend http://127.0.0.1:8101
      the router in front of them, in another terminal
  kvroute sim --instances 3 --roles prefill prefill decode
      prefill/decode disaggregation (NixlConnector's kv_transfer_params): two prefill
      instances and one decode instance
  kvroute sim --instances 4 --speeds 1,1,0.5,0.5
      a mixed fleet: the last two prefill and decode at half speed (GET /sim/stats
      shows each instance's true_speeds)"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvroute sim",
        description=(
            "Simulate N vLLM servers (--instances N; OpenAI API, /metrics, KV events) in one\n"
            "process. Prints each server's URL on stdout and the model to ask for on stderr."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "-c",
        "--config",
        metavar="FILE",
        help="YAML file with the flags' names as keys, e.g. `instances: 2`; flags win",
    )
    parser.add_argument("--fault", action="append", metavar="INDEX:MODE[:ARG]", help=_FAULT_HELP)
    fleet = parser.add_argument_group("fleet")
    server = parser.add_argument_group("each simulated server")
    own = set(SimConfig.__struct_fields__) - set(SimParams.__struct_fields__)
    for field in msgspec.structs.fields(SimConfig):
        if field.name != "faults":
            _add_flag(fleet if field.name in own else server, field)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if k not in ("config", "fault")}
    try:
        if args.fault:
            overrides["faults"] = dict(_parse_fault(spec) for spec in args.fault)
        config = load_config(args.config, overrides)
    except (OSError, ValueError, yaml.YAMLError, msgspec.ValidationError) as e:
        print(f"kvroute sim: {e}", file=sys.stderr)
        return 2
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_serve(config))
    return 0


def _add_flag(group: Any, field: msgspec.structs.FieldInfo) -> None:
    base, meta = typing.get_args(field.type) or (field.type, None)
    kwargs: dict[str, Any] = {
        "help": getattr(meta, "description", None) or field.name,
        "default": argparse.SUPPRESS,  # absent flags must not override the YAML file
    }
    if base is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif typing.get_origin(base) is Literal:
        kwargs["choices"] = typing.get_args(base)
    elif typing.get_origin(base) is list:
        kwargs["nargs"] = "*"
        (item,) = typing.get_args(base)
        item = typing.get_args(item)[0] if typing.get_origin(item) is Annotated else item
        if item is float:  # numbers as one comma-separated argument: --speeds 1,1,0.5
            kwargs.update(nargs=None, type=_floats, metavar="X,X,...")
        elif typing.get_origin(item) is Literal:
            kwargs["choices"] = typing.get_args(item)
        else:
            kwargs["metavar"] = "NAME"
    else:
        kwargs["type"] = base
        kwargs["metavar"] = _METAVARS[base]
    default = field.default_factory() if field.default is msgspec.NODEFAULT else field.default
    kwargs["help"] += f" (default: {default!r})"
    group.add_argument("--" + field.name.replace("_", "-"), **kwargs)


def _floats(text: str) -> list[float]:
    """`1,1,0.5` as [1.0, 1.0, 0.5]."""
    try:
        return [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"want numbers like 1,1,0.5, got {text!r}") from None


def _parse_fault(spec: str) -> tuple[int, Fault]:
    index, _, rest = spec.partition(":")
    mode, _, arg = rest.partition(":")
    raw: dict[str, Any] = {"mode": mode}
    if arg:
        if mode not in _FAULT_ARG:
            raise ValueError(f"--fault {spec}: mode {mode!r} takes no argument")
        raw[_FAULT_ARG[mode]] = float(arg) if mode == "slow" else int(arg)
    if not index.isdigit():
        raise ValueError(f"--fault {spec}: INDEX must be an instance number")
    return int(index), msgspec.convert(raw, Fault)


async def _serve(config: SimConfig) -> None:
    roles, speeds = config.roles or None, config.speeds or None
    fleet = await start_fleet(
        config.instances, config, config.host, config.base_port, roles, speeds
    )
    try:
        _announce(fleet, config.model)
        task = asyncio.current_task()
        assert task is not None
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread
                asyncio.get_running_loop().add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()  # until SIGINT/SIGTERM
    finally:
        await fleet.stop()


def _announce(fleet: SimFleet, model: str) -> None:
    """The addresses on stdout (a harness reads them); for a person, on stderr, the
    model name requests must ask for."""
    roles = [b.params.kv_role for b in fleet.backends]
    pd = "" if set(roles) == {"both"} else f" (kv roles: {', '.join(roles)})"
    print(f"kvroute sim: {len(fleet.backends)} servers of model {model!r}{pd}", file=sys.stderr)
    for backend in fleet.backends:
        print(backend.url)
    for backend in fleet.backends:
        if backend.publisher is not None:
            pub = backend.publisher
            print(f"kv-events {backend.url} pub={pub.endpoint} replay={pub.replay_endpoint}")
    sys.stdout.flush()
