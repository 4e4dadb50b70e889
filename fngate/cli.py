"""The `fngate` console script. Gateway and runner are imported only inside their subcommands."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fngate.manifest import ManifestError, load_manifest


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    return _run(parser, args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fngate", description="Serve ML models as serverless functions.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = commands.add_parser("up", help="run a whole deployment on this machine (Redis, gateway, runners)")
    up.add_argument("--repo", default="functions", help="repository folder (default: ./functions)")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=8000)
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
        default=min(os.cpu_count() or 1, 4),
        help="gateway processes sharing the port (default: one per core, at most 4)",
    )
    up.add_argument(
        "--server",
        choices=["uvicorn", "hypercorn"],
        default="uvicorn",
        help="the gateway's HTTP server (default uvicorn, the fastest; hypercorn adds HTTP/2)",
    )
    up.add_argument("--redis-max-memory", default="1gb", help="the private Redis's maxmemory (default 1gb)")
    up.add_argument("--log-level", default="INFO")
    _add_auth_flags(up)

    gateway = commands.add_parser(
        "gateway", help="run one gateway (settings from flags or FNGATE_* variables)"
    )
    gateway.add_argument("--repo")
    gateway.add_argument("--redis", metavar="URL")
    gateway.add_argument("--host")
    gateway.add_argument("--port", type=int)
    gateway.add_argument("--workers", type=int)
    gateway.add_argument(
        "--server", choices=["uvicorn", "hypercorn"], help="the HTTP server (default uvicorn)"
    )

    runner = commands.add_parser("runner", help="run one runner (settings from flags or FNGATE_* variables)")
    runner.add_argument("--repo")
    runner.add_argument("--redis", metavar="URL")
    runner.add_argument("--pool")
    runner.add_argument("--functions", nargs="+", metavar="NAME", help="serve only these functions")

    validate = commands.add_parser("validate", help="check function manifests; print every problem")
    validate.add_argument("files", nargs="+", type=Path, metavar="FILE")

    _add_repository_commands(commands)

    cache = commands.add_parser("cache", help="manage the response cache")
    cache.add_argument("action", choices=["clear"])
    cache.add_argument("function", metavar="NAME")
    cache.add_argument(
        "--redis", metavar="URL", help="the cache Redis (default: FNGATE_CACHE_URL or FNGATE_REDIS_URL)"
    )

    k8s = commands.add_parser(
        "k8s", help="render Kubernetes objects (KEDA ScaledObjects per pool) from manifests"
    )
    k8s.add_argument("action", choices=["render"])
    k8s.add_argument("rest", nargs=argparse.REMAINDER, help="options of `python -m fngate.k8s --help`")

    return parser


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.command == "keys" or (
        args.command == "deploy" and args.gateway and not (args.repo or args.redis)
    ):
        return _key_command(args) if args.command == "keys" else _deploy_through(args)
    if args.command in ("deploy", "ls", "rm"):
        return _repository_command(args)
    if args.command == "cache":
        return _clear_cache(args.function, args.redis)
    if args.command == "k8s":
        from fngate.k8s import main as k8s_main

        return k8s_main(args.rest)
    if args.command == "validate":
        return _validate(args.files)
    if args.command == "up":
        from fngate.local import run_local

        return run_local(args)
    if args.command == "gateway":
        from fngate.config import GatewaySettings
        from gateway.__main__ import main as gateway_main

        overrides = _overrides(
            args, redis_url="redis", repo="repo", host="host", port="port", workers="workers", server="server"
        )
        return gateway_main(GatewaySettings(**overrides))  # type: ignore[arg-type]
    if args.command == "runner":
        from fngate.config import RunnerSettings
        from runner.__main__ import main as runner_main

        overrides = _overrides(args, redis_url="redis", repo="repo", pool="pool", functions="functions")
        return runner_main(RunnerSettings(**overrides))  # type: ignore[arg-type]
    parser.error(f"unknown command {args.command}")
    return 2


def _add_repository_commands(commands: Any) -> None:
    """deploy, ls, rm: a function's versions in a repository (a folder or S3)."""
    deploy = commands.add_parser("deploy", help="upload a function as its next version to a repository")
    deploy.add_argument("file", type=Path, metavar="FILE", help="the function's manifest (function.yaml)")
    _repository_flags(deploy)
    deploy.add_argument(
        "--gateway",
        metavar="URL",
        help="upload through this gateway's deploy API with the key in FNGATE_API_KEY (without --repo "
        "and --redis; with them, only the address in the printed curl lines)",
    )
    deploy.add_argument(
        "--no-registry",
        dest="record_it",
        action="store_false",
        help="S3 only: upload without recording; `fngate ls --sync` records it where Redis is reachable",
    )

    ls = commands.add_parser("ls", help="list functions, versions, traffic and load state")
    _repository_flags(ls)
    ls.add_argument(
        "--sync", action="store_true", help="rewrite the registry from the repository; create missing streams"
    )

    rm = commands.add_parser("rm", help="remove a function; its queued invocations get not_found")
    rm.add_argument("name", metavar="NAME")
    _repository_flags(rm)
    rm.add_argument(
        "--grace-s", type=float, default=3.0, help="answer invocations queued this long after (default 3)"
    )
    _add_key_commands(commands)


def _repository_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repo", help="s3://bucket/prefix or a folder (default: FNGATE_REPO, ./functions)")
    parser.add_argument(
        "--redis", metavar="URL", help="the registry and queue Redis (default: FNGATE_REDIS_URL)"
    )


def _repository_command(args: argparse.Namespace) -> int:
    """deploy, ls and rm: the repository is opened here (boto3 only for an S3 one)."""
    from fngate import deploy
    from fngate.config import GatewaySettings
    from fngate.repository import Repository, is_remote, open_repository

    defaults = GatewaySettings()
    url: str = args.repo or defaults.repo
    redis_url: str = args.redis or defaults.redis_url
    repository: Repository
    if is_remote(url):
        from fngate.s3 import S3Repository

        repository = S3Repository(url)
    else:
        repository = open_repository(url)
    if args.command == "deploy":
        gateway = args.gateway or "http://127.0.0.1:8000"
        return deploy.deploy(
            args.file, repository, redis_url, gateway, sys.stdout, sys.stderr, args.record_it
        )
    if args.command == "ls":
        return deploy.list_functions(repository, redis_url, args.sync, sys.stdout, sys.stderr)
    return deploy.remove(repository, args.name, redis_url, args.grace_s, sys.stdout, sys.stderr)


# `fngate keys` and `fngate deploy --gateway`: API keys in the registry Redis, deploys by API key;
# `fngate up --no-auth`, `--state-dir`.
def _add_auth_flags(up: argparse.ArgumentParser) -> None:
    up.add_argument(
        "--no-auth", action="store_true", help="serve without API keys (only with a loopback --host)"
    )
    up.add_argument(
        "--state-dir",
        default=os.path.join(os.environ.get("XDG_STATE_HOME", "~/.local/state"), "fngate"),
        help="where the admin API key and the private Redis's data are kept (default: ~/.local/state/fngate)",
    )


def _add_key_commands(commands: Any) -> None:
    keys = commands.add_parser("keys", help="create, list and revoke API keys")
    actions = keys.add_subparsers(dest="action", required=True, metavar="ACTION")
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
    listing = actions.add_parser("ls", help="list keys: id, name, scopes, limits (never the key)")
    revoke = actions.add_parser("revoke", help="revoke a key on every gateway within a few seconds")
    revoke.add_argument("id", metavar="ID")
    actions.add_parser(
        "hash", help="print '<id>:<sha256>' of the key in FNGATE_API_KEY, for FNGATE_ADMIN_KEY_HASH"
    )
    for parser in (create, listing, revoke):
        parser.add_argument("--redis", metavar="URL", help="the registry Redis (default: FNGATE_REDIS_URL)")


def _key_command(args: argparse.Namespace) -> int:
    import redis

    from fngate import apikeys
    from fngate.config import GatewaySettings
    from fngate.errors import FunctionError

    if args.action == "hash":
        try:
            print(apikeys.hash_line(os.environ.get("FNGATE_API_KEY", "")))
        except FunctionError as exc:
            print(f"fngate keys: {exc.message} in FNGATE_API_KEY", file=sys.stderr)
            return 2
        return 0
    client = redis.Redis.from_url(args.redis or GatewaySettings().redis_url, socket_connect_timeout=3)
    try:
        if args.action == "create":
            key, record = apikeys.create(
                client, args.scope, args.name, args.rps, args.burst, args.max_in_flight, args.max_queued
            )
            print(f"created key {record.id} ({', '.join(record.scopes)}); it is shown only now:\n{key}")
        elif args.action == "revoke":
            apikeys.revoke(client, args.id)
            print(f"revoked key {args.id}")
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


def _deploy_through(args: argparse.Namespace) -> int:
    from fngate import deploy

    api_key = os.environ.get("FNGATE_API_KEY", "")
    if not api_key:
        print(
            "fngate deploy: --gateway needs an API key with the deploy scope in FNGATE_API_KEY",
            file=sys.stderr,
        )
        return 2
    return deploy.deploy_through(args.file, args.gateway, api_key, sys.stdout, sys.stderr)


def _overrides(args: argparse.Namespace, **fields: str) -> dict[str, object]:
    """Settings fields given on the command line; the rest come from FNGATE_* variables."""
    return {field: getattr(args, flag) for field, flag in fields.items() if getattr(args, flag) is not None}


def _clear_cache(function: str, url: str | None) -> int:
    import redis

    from fngate import keys
    from fngate.config import GatewaySettings

    if url is None:
        settings = GatewaySettings()
        url = settings.cache_url or settings.redis_url
    client = redis.Redis.from_url(url)
    cleared = 0
    batch: list[bytes] = []
    for key in client.scan_iter(match=keys.cache_prefix(function) + "*", count=1000):
        batch.append(key)
        if len(batch) == 1000:
            cleared += client.unlink(*batch)
            batch.clear()
    if batch:
        cleared += client.unlink(*batch)
    print(f"cleared {cleared} cached responses of {function}")
    return 0


def _validate(files: Sequence[Path]) -> int:
    failed = 0
    for path in files:
        try:
            manifest = load_manifest(path)
        except ManifestError as exc:
            failed += 1
            for line in exc.lines():
                print(line, file=sys.stderr)
        else:
            print(f"{path}: ok ({manifest.name}, {manifest.model.backend})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
