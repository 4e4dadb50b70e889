"""The `fngate` console script. Gateway and runner are imported only inside their subcommands.

A user's mistake (a missing file, an unknown function, a port in use) is one line on stderr and
exit code 2; an unreachable service is one line and exit code 1; never a traceback."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fngate
from fngate.up.state import UpState, read_up, state_dir

if TYPE_CHECKING:
    from fngate.config import RepositoryLimits

GATEWAY_WORKERS_MAX = 4


def gateway_workers(cpus: int | None = None) -> int:
    """How many gateway processes `fngate up` starts on a machine of `cpus` CPUs (this one's by
    default): one per two CPUs, at least one and at most GATEWAY_WORKERS_MAX. The gateway shares
    the machine with the runners and Redis, and each invocation crosses all three: a gateway
    process per CPU left them waiting for a CPU behind it. On two cores one process measured
    15-20% more HTTP throughput at 16 clients and a p99 about 20% lower under open-loop traffic at
    4,000-5,000 req/s than two did (gRPC at 64 clients, whose gateway work is the heaviest, 20%
    less)."""
    count = cpus if cpus is not None else len(os.sched_getaffinity(0))
    return max(1, min(count // 2, GATEWAY_WORKERS_MAX))


DEFAULT_GATEWAY = "http://127.0.0.1:8000"
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
DEFAULT_REPO = "functions"


class UsageError(Exception):
    """Something the user asked for cannot be done as asked: exit code 2."""


class ServiceError(Exception):
    """A service the command needs did not answer: exit code 1."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except UsageError as exc:
        print(f"fngate {args.command}: {exc}", file=sys.stderr)
        return 2
    except ServiceError as exc:
        print(f"fngate {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (`fngate ls | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fngate",
        description="Serve ML models as serverless functions.",
        epilog="`fngate COMMAND --help` describes each command. Commands find a running `fngate up` "
        "(its gateway, Redis and repository) through its state folder, so they need no flags.",
    )
    parser.add_argument("--version", action="version", version=f"fngate {fngate.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _add_up_command(commands)

    gateway = commands.add_parser(
        "gateway", help="run one gateway (settings from flags or FNGATE_* variables)"
    )
    gateway.add_argument("--repo", help="repository: a folder or s3://bucket/prefix (FNGATE_REPO)")
    gateway.add_argument("--redis", metavar="URL", help="the queue Redis (FNGATE_REDIS_URL)")
    gateway.add_argument("--host", help="address to listen on (FNGATE_HOST)")
    gateway.add_argument("--port", type=int, help="port to listen on (FNGATE_PORT)")
    gateway.add_argument(
        "--grpc-port", type=int, help="gRPC port, 0 for none (FNGATE_GRPC_PORT; default 8001, as Triton's)"
    )
    gateway.add_argument("--workers", type=int, help="processes sharing the port (FNGATE_WORKERS)")
    _add_metrics_port(gateway, "FNGATE_METRICS_PORT; default 8002, as Triton's; 0: none", None)
    gateway.add_argument(
        "--server", choices=["uvicorn", "hypercorn"], help="the HTTP server (default uvicorn)"
    )
    _add_server_name(gateway)
    _add_client_shm(gateway)

    runner = commands.add_parser("runner", help="run one runner (settings from flags or FNGATE_* variables)")
    runner.add_argument("--repo", help="repository: a folder or s3://bucket/prefix (FNGATE_REPO)")
    runner.add_argument("--redis", metavar="URL", help="the queue Redis (FNGATE_REDIS_URL)")
    runner.add_argument("--pool", help="the runner pool this runner serves (FNGATE_POOL)")
    runner.add_argument("--functions", nargs="+", metavar="NAME", help="serve only these functions")

    _validation_parsers(commands)

    commands.add_parser(
        "schema", help="print the JSON Schema of function.yaml (also docs/function.schema.json)"
    )

    invoke = commands.add_parser(
        "invoke",
        help="call a function and print its outputs",
        description="Call a function through the gateway. DATA is a JSON body ('{\"inputs\": {...}}' "
        "or just the inputs object), @FILE.json, @FILE.npy for a function with one input, or "
        "NAME=@FILE.npy (repeatable) for several; with no DATA the body is read from stdin. The API "
        "key is FNGATE_API_KEY, or, for fngate up's own gateway, the admin key it keeps.",
    )
    invoke.add_argument("name", metavar="NAME", help="the function")
    invoke.add_argument(
        "data", nargs="*", metavar="DATA", help="JSON, @FILE.json, @FILE.npy or NAME=@FILE.npy"
    )
    invoke.add_argument("--version", dest="function_version", metavar="N", help="call this version")
    invoke.add_argument(
        "--gateway", metavar="URL", help=f"the gateway (default: fngate up's, or {DEFAULT_GATEWAY})"
    )
    invoke.add_argument(
        "--timeout-s",
        type=float,
        help="give up after this long (default: as long as the gateway may hold the invocation: the "
        "function's model.load_timeout_s for a cold start, then its batching.timeout_ms)",
    )
    invoke.add_argument(
        "--async",
        dest="asynchronous",
        action="store_true",
        help="submit it asynchronously and print its id; `fngate result ID` fetches the result",
    )
    result = commands.add_parser(
        "result",
        help="fetch an asynchronous invocation's result (`fngate invoke NAME --async`)",
        description="Print the result of an asynchronous invocation, or its state while pending.",
    )
    result.add_argument("id", metavar="ID", help="the invocation's id")
    result.add_argument("--wait", action="store_true", help="wait until it is done (at most --timeout-s)")
    result.add_argument(
        "--gateway", metavar="URL", help=f"the gateway (default: fngate up's, or {DEFAULT_GATEWAY})"
    )
    result.add_argument("--timeout-s", type=float, default=300.0, help="with --wait: give up after this long")

    _add_repository_commands(commands)

    cache = commands.add_parser("cache", help="manage the response cache")
    cache.add_argument("action", choices=["clear"], help="clear: drop every cached response of NAME")
    cache.add_argument("function", metavar="NAME", help="the function")
    cache.add_argument(
        "--redis",
        metavar="URL",
        help="the cache Redis (default: FNGATE_CACHE_URL, FNGATE_REDIS_URL or fngate up's)",
    )

    k8s = commands.add_parser(
        "k8s", help="render Kubernetes objects (KEDA ScaledObjects per pool) from manifests"
    )
    k8s.add_argument("action", choices=["render"], help="render: print the objects as YAML")
    k8s.add_argument("rest", nargs=argparse.REMAINDER, help="options of `python -m fngate.k8s --help`")
    return parser


def _add_up_command(commands: Any) -> None:
    up = commands.add_parser("up", help="run a whole deployment on this machine (Redis, gateway, runners)")
    up.add_argument(
        "--repo",
        default=DEFAULT_REPO,
        help="repository: a folder or s3://bucket/prefix (default: ./functions)",
    )
    _add_listen_flags(up)
    _add_server_name(up)
    _add_client_shm(up)
    _add_metrics_port(up, "on 127.0.0.1; default 8002, as Triton's; 0: none", 8002)
    up.add_argument("--redis", metavar="URL", help="use this Redis instead of starting a private one")
    up.add_argument(
        "--idle-shutdown-s",
        type=float,
        default=60.0,
        help="a runner with no model loaded and no work this long exits (default 60)",
    )
    up.add_argument(
        "--gateway-workers",
        type=int,
        default=gateway_workers(),
        help="gateway processes sharing the port (default: one per two cores, at least 1, at most 4)",
    )
    up.add_argument(
        "--server",
        choices=["uvicorn", "hypercorn"],
        default="uvicorn",
        help="the gateway's HTTP server (default uvicorn, the fastest; hypercorn adds HTTP/2)",
    )
    up.add_argument(
        "--standby-runner",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep one runner process started ahead of need for the next pool that wakes: its cold "
        "start skips the runner's start-up, about a second (default on; costs an idle runner's "
        "memory: about 85 MB RSS)",
    )
    up.add_argument(
        "--reload",
        action="store_true",
        help="watch the repository folder and reload a changed function where it is loaded, make "
        "before break (a change that does not load is logged; the old files serve on)",
    )
    up.add_argument(
        "--sched-batch",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run Redis, the gateway and the runners under Linux's SCHED_BATCH: on one machine "
        "they wake each other for every invocation, and this spares the preemption of each wake "
        "(default on; a lower p99 under Poisson arrivals on the benchmark's two cores)",
    )
    up.add_argument(
        "--runner-python",
        metavar="PATH",
        help="the Python interpreter that runs the runners (and the auto-complete of Python models): "
        "another environment with fngate and what the models import beyond it, such as torch for "
        "TorchScript models or a Python model's packages (default: this fngate's)",
    )
    up.add_argument("--redis-max-memory", default="1gb", help="the private Redis's maxmemory (default 1gb)")
    up.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default: INFO)")
    _add_auth_flags(up)


def _add_metrics_port(parser: argparse.ArgumentParser, where: str, default: int | None) -> None:
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=default,
        help=f"Prometheus /metrics without an API key, Triton's nv_* names beside fngate's ({where})",
    )


def _call_gateway(args: argparse.Namespace) -> int:
    """`fngate invoke` and `fngate result`: fngate up's gateway (with its admin key) unless told."""
    from fngate.cli.invoke import InvokeError, invoke, result

    up_gateway = _from_up("gateway_url")
    gateway = args.gateway or up_gateway or DEFAULT_GATEWAY
    try:
        key = _api_key(gateway == up_gateway)
        if args.command == "result":
            return result(gateway, args.id, args.wait, args.timeout_s, sys.stdout, key)
        version, timeout_s = args.function_version, args.timeout_s
        return invoke(gateway, args.name, args.data, version, timeout_s, sys.stdout, key, args.asynchronous)
    except InvokeError as exc:
        raise (ServiceError if exc.unreachable else UsageError)(str(exc)) from exc


def _run(args: argparse.Namespace) -> int:
    if args.command == "keys" or (
        args.command == "deploy" and args.gateway and not (args.repo or args.redis)
    ):
        return _key_command(args) if args.command == "keys" else _deploy_through(args)
    if args.command in ("traffic", "rollback"):
        return _rollout_command(args)
    if args.command in ("deploy", "ls", "rm"):
        return _repository_command(args)
    if args.command == "cache":
        return _clear_cache(args.function, args.redis)
    if args.command == "k8s":
        from fngate.k8s import main as k8s_main

        return k8s_main(args.rest)
    if args.command == "validate":
        from fngate.cli.validation import validate_files

        return validate_files(args.files, sys.stdout, sys.stderr)
    if args.command == "import-triton":
        return _import_triton(args.repo, args.out)
    if args.command == "schema":
        from fngate.manifest import schema_json

        sys.stdout.write(schema_json())
        return 0
    if args.command in ("invoke", "result"):
        return _call_gateway(args)
    if args.command == "up":
        from fngate.up.supervisor import run_local

        return run_local(args)
    if args.command == "gateway":
        from fngate.config import GatewaySettings
        from gateway.__main__ import main as gateway_main

        overrides = _overrides(
            args,
            redis_url="redis",
            repo="repo",
            host="host",
            port="port",
            grpc_port="grpc_port",
            workers="workers",
            server="server",
            server_name="server_name",
            allow_client_shm="allow_client_shm",
            metrics_port="metrics_port",
        )
        settings = GatewaySettings(**overrides)  # type: ignore[arg-type]
        if not settings.bind:
            from fngate.up.supervisor import port_problem

            for port, flag in ((settings.port, "--port"), (settings.grpc_port, "--grpc-port")):
                busy = port_problem(settings.host, port, flag)
                if busy:
                    raise UsageError(busy)
        return gateway_main(settings)
    if args.command == "runner":
        from fngate.config import RunnerSettings
        from runner.__main__ import main as runner_main

        overrides = _overrides(args, redis_url="redis", repo="repo", pool="pool", functions="functions")
        return runner_main(RunnerSettings(**overrides))  # type: ignore[arg-type]
    raise UsageError(f"unknown command {args.command}")


def _add_repository_commands(commands: Any) -> None:
    """deploy, ls, rm: a function's versions in a repository (a folder or S3)."""
    deploy = commands.add_parser("deploy", help="upload functions as their next versions to a repository")
    deploy.add_argument(
        "files",
        type=Path,
        nargs="+",
        metavar="FILE",
        help="manifests (function.yaml) or Triton model repositories; pipelines go last, and their steps "
        "may call functions given here",
    )
    _repository_flags(deploy)
    deploy.add_argument(
        "--gateway",
        metavar="URL",
        help="upload through this gateway's deploy API with the key in FNGATE_API_KEY (without --repo "
        f"and --redis; with them, only the address in the printed curl lines: default fngate up's, or "
        f"{DEFAULT_GATEWAY})",
    )
    deploy.add_argument(
        "--no-registry",
        dest="record_it",
        action="store_false",
        help="S3 only: upload without recording; `fngate ls --sync` records it where Redis is reachable",
    )
    deploy.add_argument(
        "--warm",
        action="store_true",
        help="then have a runner of its pool load the new version (starting one if none runs) and wait "
        "for it: its first invocation finds it loaded (with --gateway: an admin key)",
    )

    ls = commands.add_parser("ls", help="list functions, versions, traffic and load state")
    _repository_flags(ls)
    ls.add_argument(
        "--sync", action="store_true", help="rewrite the registry from the repository; create missing streams"
    )

    rm = commands.add_parser("rm", help="remove a function; its queued invocations get not_found")
    rm.add_argument("name", metavar="NAME", help="the function")
    _repository_flags(rm)
    rm.add_argument(
        "--grace-s", type=float, default=3.0, help="answer invocations queued this long after (default 3)"
    )
    rm.add_argument("--yes", action="store_true", help="remove without asking first (needed off a terminal)")
    _add_rollout_commands(commands)
    _add_key_commands(commands)


def _add_rollout_commands(commands: Any) -> None:
    """traffic and rollback: unpinned invocations moved between stored versions, make before break."""
    traffic = commands.add_parser(
        "traffic",
        help="split a function's unpinned invocations over stored versions: fngate traffic NAME 3=90 4=10",
        description="Route invocations that name no version to versions already stored, by weight "
        "(adding up to 100). Make before break: where a runner has the function loaded, the versions "
        "are loaded and ready before traffic moves; a load that fails changes nothing. The next "
        "deploy hands routing back to its manifest's versions policy.",
    )
    traffic.add_argument("name", metavar="NAME", help="the function")
    traffic.add_argument("weights", nargs="+", metavar="VERSION=WEIGHT", help="e.g. 3=90 4=10")
    rollback = commands.add_parser(
        "rollback",
        help="send all of a function's traffic back to a stored version (by default the one before)",
        description="Route every unpinned invocation to VERSION, by default the stored version just "
        "before the newest one taking traffic now, make before break, as `fngate traffic NAME V=100`.",
    )
    rollback.add_argument("name", metavar="NAME", help="the function")
    rollback.add_argument("version", nargs="?", metavar="VERSION", help="the version to route to")
    for parser in (traffic, rollback):
        _repository_flags(parser)
        parser.add_argument(
            "--gateway",
            metavar="URL",
            help="through this gateway's deploy API with the key in FNGATE_API_KEY (without --repo "
            "and --redis)",
        )


def _repository_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--repo", help="s3://bucket/prefix or a folder (default: FNGATE_REPO, fngate up's, or ./functions)"
    )
    parser.add_argument(
        "--redis",
        metavar="URL",
        help="the registry and queue Redis (default: FNGATE_REDIS_URL or fngate up's)",
    )


def _api_key(to_up: bool) -> str | None:
    """FNGATE_API_KEY, else (for fngate up's own gateway only) the admin key it keeps."""
    key = os.environ.get("FNGATE_API_KEY")
    if key or not to_up:
        return key or None
    try:
        return (state_dir() / "admin.key").read_text().strip() or None
    except OSError:
        return None


def _up() -> UpState | None:
    return read_up(state_dir())


def _from_up(field: str) -> str | None:
    up = _up()
    return str(getattr(up, field)) if up is not None else None


def targets(repo: str | None, redis_url: str | None) -> tuple[str, str]:
    """The repository and Redis a command works on: its flags, else FNGATE_REPO and
    FNGATE_REDIS_URL, else what a running `fngate up` serves, else the built-in defaults."""
    up = _up()
    repo = repo or os.environ.get("FNGATE_REPO") or (up.repo if up else None) or DEFAULT_REPO
    redis_url = (
        redis_url or os.environ.get("FNGATE_REDIS_URL") or (up.redis_url if up else None) or DEFAULT_REDIS
    )
    return repo, redis_url


def _validation_parsers(commands: Any) -> None:
    """validate, and import-triton (which validates a Triton repository as it goes)."""
    validate = commands.add_parser(
        "validate",
        help="check manifests as deploy does, and against their ONNX models; print every problem",
    )
    validate.add_argument(
        "files",
        nargs="+",
        type=Path,
        metavar="FILE",
        help="function.yaml files, or Triton model repositories",
    )
    parser = commands.add_parser(
        "import-triton", help="write function.yaml files for the models of a Triton model repository"
    )
    parser.add_argument("repo", type=Path, help="a Triton model repository (folders with config.pbtxt)")
    parser.add_argument("out", type=Path, help="an empty folder for the functions")


def _import_triton(repo: Path, out: Path) -> int:
    from fngate.cli.triton import import_repository, is_triton_repository
    from fngate.manifest import ManifestError

    if not is_triton_repository(repo):
        raise UsageError(f"{repo} holds no Triton model (a folder with config.pbtxt or N/model.onnx)")
    try:
        written = import_repository(repo, out, sys.stderr)
    except ManifestError as exc:
        print("\n".join(exc.lines()), file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    return 0


def _rollout_command(args: argparse.Namespace) -> int:
    """traffic and rollback: through a gateway's deploy API, or on the repository and Redis."""
    from fngate.cli import rollout
    from fngate.errors import FunctionError

    try:
        weights = rollout.parse_weights(args.weights) if args.command == "traffic" else None
        version = None if args.command == "traffic" else args.version
        if args.gateway and not (args.repo or args.redis):
            api_key = os.environ.get("FNGATE_API_KEY", "")
            if not api_key:
                raise UsageError("--gateway needs an API key with the deploy scope in FNGATE_API_KEY")
            return rollout.route_through(
                args.gateway, api_key, args.name, weights, version, sys.stdout, sys.stderr
            )
        repository, redis_url = _open_target(args)
        return rollout.route_direct(repository, redis_url, args.name, weights, version, sys.stdout)
    except rollout.RolloutError as exc:
        raise UsageError(str(exc)) from exc
    except FunctionError as exc:
        print(f"fngate {args.command}: {exc.message}", file=sys.stderr)
        return rollout.exit_code(exc)


def _open_target(args: argparse.Namespace) -> tuple[Any, str]:
    """The repository (opened: boto3 only for an S3 one) and Redis a command works on. A command
    that writes needs to be told where (a flag, FNGATE_REPO or a running fngate up): it never
    writes into ./functions, the example folder, by default."""
    from fngate.repository import is_remote, open_repository

    writes = args.command in ("deploy", "traffic", "rollback")
    if writes and not (args.repo or os.environ.get("FNGATE_REPO") or _up()):
        raise UsageError(
            "no fngate up is running and no repository was given: pass --repo PATH or "
            "--repo s3://bucket/prefix (or set FNGATE_REPO)"
        )
    url, redis_url = targets(args.repo, args.redis)
    if is_remote(url):
        from fngate.s3 import S3Repository

        return S3Repository(url), redis_url
    if not Path(url).is_dir() and args.command != "deploy":
        raise UsageError(f"repository folder {url} does not exist")
    return open_repository(url), redis_url


def _repository_command(args: argparse.Namespace) -> int:
    """deploy, ls and rm."""
    from fngate.cli import deploy
    from fngate.manifest import ManifestError

    repository, redis_url = _open_target(args)
    url = repository.url
    if args.command == "deploy":
        from fngate.cli.triton import deploy_paths, is_triton_repository

        for file in args.files:
            if not file.is_file() and not is_triton_repository(file):
                raise UsageError(f"{file} does not exist" if not file.exists() else f"{file} is not a file")
        gateway = _deploy_gateway(args.gateway, url)
        limits = _repository_limits()
        try:
            files, staging = deploy_paths(args.files, sys.stderr)
        except ManifestError as exc:
            print("\n".join(exc.lines()), file=sys.stderr)
            return 2
        try:
            return deploy.deploy_all(
                files,
                repository,
                redis_url,
                gateway,
                sys.stdout,
                sys.stderr,
                args.record_it,
                args.warm,
                limits,
            )
        finally:
            if staging is not None:
                staging.cleanup()
    if args.command == "ls":
        return deploy.list_functions(repository, redis_url, args.sync, sys.stdout, sys.stderr)
    _deployed(repository, args.name)
    _confirm_removal(repository, args.name, args.yes)
    return deploy.remove(repository, args.name, redis_url, args.grace_s, sys.stdout, sys.stderr)


def _repository_limits() -> RepositoryLimits:
    """FNGATE_MAX_VERSIONS and FNGATE_MAX_REPOSITORY_BYTES, as the gateway's deploy API reads them."""
    from pydantic import ValidationError

    from fngate.config import RepositoryLimits

    try:
        return RepositoryLimits()
    except ValidationError as exc:
        problems = "; ".join(
            f"FNGATE_{'.'.join(map(str, error['loc'])).upper()}: {error['msg']}" for error in exc.errors()
        )
        raise UsageError(problems) from None


def _confirm_removal(repository: Any, name: str, yes: bool) -> None:
    """`fngate rm` asks first on a terminal; elsewhere it needs --yes."""
    if yes:
        return
    count = len(repository.get(name).versions)
    if not sys.stdin.isatty():
        raise UsageError(f"this removes {name} and its {count} versions from {repository.url}: pass --yes")
    answer = input(f"remove {name} and its {count} versions from {repository.url}? [y/N] ")
    if answer.strip().lower() not in ("y", "yes"):
        raise UsageError("nothing was removed")


def _deployed(repository: Any, name: str) -> None:
    from fngate.errors import FunctionNotFound

    try:
        repository.get(name)
    except FunctionNotFound as exc:
        raise UsageError(f"{exc.message} ({repository.url})") from exc


def _deploy_gateway(flag: str | None, repo: str) -> str | None:
    """Where the printed curl lines point; None (no curl lines, a warning instead) when the running
    `fngate up` serves another repository, so the lines would answer 404."""
    if flag:
        return flag
    up = _up()
    if up is None:
        return DEFAULT_GATEWAY
    if _same_repo(up.repo, repo):
        return up.gateway_url
    print(
        f"fngate deploy: warning: fngate up at {up.gateway_url} serves {up.repo}, not {repo}; "
        f"to call this function there, restart it with `fngate up --repo {repo}`",
        file=sys.stderr,
    )
    return None


def _same_repo(served: str, repo: str) -> bool:
    from fngate.repository import is_remote

    if is_remote(served) or is_remote(repo):
        return served.rstrip("/") == repo.rstrip("/")
    return Path(served).resolve() == Path(repo).resolve()


# `fngate keys` and `fngate deploy --gateway`: API keys in the registry Redis, deploys by API key;
# `fngate up --no-auth`, `--state-dir`.
def _add_listen_flags(up: argparse.ArgumentParser) -> None:
    up.add_argument("--host", default="127.0.0.1", help="gateway address (default: 127.0.0.1)")
    up.add_argument("--port", type=int, default=8000, help="gateway port (default: 8000)")
    up.add_argument(
        "--grpc-port",
        type=int,
        default=8001,
        help="the gateway's gRPC port, the Open Inference Protocol's GRPCInferenceService as Triton's "
        "(default: 8001; 0: no gRPC)",
    )


def _add_server_name(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--server-name",
        metavar="NAME",
        help="the name server metadata answers (FNGATE_SERVER_NAME; default fngate): 'triton' for "
        "clients that check it, as Triton's example clients do",
    )


def _add_client_shm(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--allow-client-shm",
        action="store_true",
        default=None,
        help="serve Triton's system shared memory extension to clients on this host "
        "(FNGATE_ALLOW_CLIENT_SHM; off by default: the gateway reads and writes the objects they name "
        "with its own user's rights)",
    )


def _add_callback_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--callback-allow",
        metavar="LIST",
        help="internal receivers that callbacks may reach: networks and host names, comma-separated "
        "(10.1.0.0/16,hooks.internal); every other internal address is refused",
    )


def _add_auth_flags(up: argparse.ArgumentParser) -> None:
    _add_callback_flag(up)
    up.add_argument(
        "--no-auth", action="store_true", help="serve without API keys (only with a loopback --host)"
    )
    up.add_argument(
        "--state-dir",
        default=str(state_dir()),
        help="where the admin API key, the private Redis's data and this deployment's URLs are kept, "
        "for the other commands (default: $XDG_STATE_HOME/fngate, else ~/.local/state/fngate)",
    )


def _add_key_commands(commands: Any) -> None:
    keys = commands.add_parser("keys", help="create, list and revoke API keys")
    actions = keys.add_subparsers(
        dest="action", required=True, metavar="ACTION", help="create, ls, revoke or hash"
    )
    create = actions.add_parser("create", help="create a key; it is printed once and stored only as a hash")
    create.add_argument(
        "--scope",
        action="append",
        required=True,
        metavar="SCOPE",
        help="invoke[:glob], read, deploy or admin; repeat for several",
    )
    create.add_argument("--name", default="", help="a label shown by `fngate keys ls`")
    create.add_argument(
        "--rps", type=float, default=0.0, help="invocations per second, all gateways (0: no limit)"
    )
    create.add_argument(
        "--burst", type=int, default=0, help="invocations above the rate at once (0: the rate)"
    )
    create.add_argument(
        "--max-in-flight", type=int, default=0, help="invocations in flight at once (0: no limit)"
    )
    create.add_argument(
        "--max-queued",
        type=int,
        default=0,
        help="invocations of one function queued or running at once: a share of its queue (0: no limit)",
    )
    create.add_argument(
        "--compute-budget",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="seconds of batch time a minute, all runners (0: no budget); past it: 429 until the minute ends",
    )
    listing = actions.add_parser("ls", help="list keys: id, name, scopes, limits (never the key)")
    used = actions.add_parser(
        "usage",
        help="the batch time (and CPU time, where measured) charged to each key, by function: over a "
        "window and ever",
    )
    used.add_argument(
        "--minutes", type=int, default=60, help="the window, in minutes (default 60; at most 2880)"
    )
    revoke = actions.add_parser("revoke", help="revoke a key on every gateway within a few seconds")
    revoke.add_argument("id", metavar="ID")
    actions.add_parser(
        "hash", help="print '<id>:<sha256>' of the key in FNGATE_API_KEY, for FNGATE_ADMIN_KEY_HASH"
    )
    for parser in (create, listing, revoke, used):
        parser.add_argument("--redis", metavar="URL", help="the registry Redis (default: FNGATE_REDIS_URL)")


def _key_command(args: argparse.Namespace) -> int:
    import redis

    from fngate import apikeys, clients
    from fngate.errors import FunctionError

    if args.action == "hash":
        try:
            print(apikeys.hash_line(os.environ.get("FNGATE_API_KEY", "")))
        except FunctionError as exc:
            print(f"fngate keys: {exc.message} in FNGATE_API_KEY", file=sys.stderr)
            return 2
        return 0
    client = clients.connect_sync(targets(None, args.redis)[1], socket_connect_timeout=3)
    try:
        if args.action == "create":
            key, record = apikeys.create(
                client,
                args.scope,
                args.name,
                args.rps,
                args.burst,
                args.max_in_flight,
                args.max_queued,
                args.compute_budget,
            )
            print(f"created key {record.id} ({', '.join(record.scopes)}); it is shown only now:\n{key}")
        elif args.action == "revoke":
            apikeys.revoke(client, args.id)
            print(f"revoked key {args.id}")
        elif args.action == "usage":
            _print_usage(client, max(1, min(args.minutes, 2880)))
        else:
            print(
                f"{'ID':<12}  {'NAME':<16}  {'RPS':>6}  {'BURST':>5}  {'IN-FLIGHT':>9}  {'QUEUED':>6}  SCOPES"
            )
            for record in apikeys.records(client):
                print(
                    f"{record.id:<12}  {record.name:<16}  {record.rps:>6g}  {record.burst:>5}  "
                    f"{record.max_in_flight:>9}  {record.max_queued:>6}  {' '.join(record.scopes)}"
                )
    except FunctionError as exc:
        print(f"fngate keys: {exc.message}", file=sys.stderr)
        return 1
    except (redis.RedisError, OSError) as exc:
        print(f"fngate keys: redis is unreachable ({exc})", file=sys.stderr)
        return 1
    return 0


def _print_usage(client: Any, minutes: int) -> None:
    from fngate import apikeys

    window = f"LAST {minutes} MIN (s)"
    print(
        f"{'ID':<12}  {'NAME':<16}  {'FUNCTION':<24}  {window:>18}  {'EVER (s)':>10}  "
        f"{'CPU ' + window:>22}  {'CPU EVER (s)':>12}"
    )
    for used in apikeys.usage(client, minutes):
        window_cpu = "-" if used.window_cpu_s is None else f"{used.window_cpu_s:.3f}"
        total_cpu = "-" if used.total_cpu_s is None else f"{used.total_cpu_s:.3f}"
        print(
            f"{used.record.id:<12}  {used.record.name:<16}  {used.function:<24}  {used.window_s:>18.3f}  "
            f"{used.total_s:>10.3f}  {window_cpu:>22}  {total_cpu:>12}"
        )


def _deploy_through(args: argparse.Namespace) -> int:
    from fngate.cli import deploy

    api_key = os.environ.get("FNGATE_API_KEY", "")
    if not api_key:
        print(
            "fngate deploy: --gateway needs an API key with the deploy scope in FNGATE_API_KEY",
            file=sys.stderr,
        )
        return 2
    for file in sorted(args.files, key=_is_pipeline):  # functions first: a pipeline's steps must exist
        code = deploy.deploy_through(file, args.gateway, api_key, sys.stdout, sys.stderr, args.warm)
        if code:
            return code
    return 0


def _is_pipeline(path: Path) -> bool:
    from fngate.manifest import ManifestError, load_manifest

    try:
        return load_manifest(path).pipeline is not None
    except ManifestError:
        return False  # deploy_through reports it


def _overrides(args: argparse.Namespace, **fields: str) -> dict[str, object]:
    """Settings fields given on the command line; the rest come from FNGATE_* variables."""
    return {field: getattr(args, flag) for field, flag in fields.items() if getattr(args, flag) is not None}


def _clear_cache(function: str, url: str | None) -> int:
    import asyncio

    from redis.exceptions import RedisError

    from fngate import clients
    from fngate.deployment import clear_cache

    if url is None:
        url = os.environ.get("FNGATE_CACHE_URL") or targets(None, None)[1]

    async def clear() -> int:
        async with clients.connect(url, socket_connect_timeout=3) as client:
            return await clear_cache(client, function)

    try:
        cleared = asyncio.run(clear())
    except (RedisError, OSError) as exc:
        raise ServiceError(
            f"redis at {url} is unreachable ({exc}); is fngate up running? or pass --redis URL"
        ) from exc
    print(f"cleared {cleared} cached responses of {function}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
