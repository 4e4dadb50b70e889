"""Triton's auto-complete of Python models (`python -m runner.triton.complete`): for each Python
model of a folder repository that has no config.pbtxt, its `auto_complete_config` is run in a
process of its own, confined as a Python function's (runner.backends.python), never in a process
that reads the repository; what it answers is recorded in Redis (fngate.keys.auto_completed), where
every gateway and runner reads it as the model's configuration (fngate.registry.FunctionSource).
Run again when the model's folder changes; `fngate up` keeps one running beside its runners.
With `--print FOLDER`, one model's completed configuration is printed instead (`fngate validate`).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError

from fngate import clients, keys
from fngate.errors import FunctionError
from fngate.queue.stored import text
from fngate.triton.models import needs_completion

log = logging.getLogger(__name__)
INTERVAL_S = 2.0
MAX_CONFIG_BYTES = 256 * 1024


def digest(folder: Path) -> str:
    """sha256 over the name, size and modification time of each of the model's files (a stat
    each, never their contents: a folder may hold weights): completed again when one changes."""
    hashed = hashlib.sha256()
    for item in sorted(folder.rglob("*")):
        if item.is_file() and "__pycache__" not in item.parts:
            info = item.stat()
            hashed.update(f"{item.relative_to(folder)}\0{info.st_size}\0{info.st_mtime_ns}\n".encode())
    return hashed.hexdigest()


def completed(folder: Path, module: Path) -> dict[str, Any]:
    """The record of one model: {"digest", "config"} or, when its auto_complete_config fails,
    {"digest", "error"}."""
    from runner.backends.python import auto_complete  # only once a model needs it: a pass is stats

    record: dict[str, Any] = {"digest": digest(folder)}
    given = {"name": folder.name, "backend": "python", "max_batch_size": 0, "input": [], "output": []}
    try:
        config = auto_complete(folder.name, module, given)
    except FunctionError as exc:
        record["error"] = exc.message[:2000]
        return record
    if len(json.dumps(config)) > MAX_CONFIG_BYTES:  # every gateway and runner reads it
        record["error"] = f"its auto_complete_config answered a configuration over {MAX_CONFIG_BYTES} bytes"
    else:
        record["config"] = config
    return record


def _models(root: Path) -> dict[str, tuple[Path, Path]]:
    """The repository's Python models with no config.pbtxt: folder name -> (folder, model.py)."""
    wanted = {}
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        module = needs_completion(folder)
        if module is not None:
            wanted[folder.name] = (folder, module)
    return wanted


async def complete_repository(root: Path, redis: Any) -> int:
    """One pass: each model whose folder changed since its record (or has none) completed and
    recorded; the records of folders gone (or given a config.pbtxt) removed. Answers how many
    models were completed."""
    held = {text(name): json.loads(raw) for name, raw in (await redis.hgetall(keys.auto_completed())).items()}
    wanted = await asyncio.to_thread(_models, root)
    done = 0
    for name, (folder, module) in wanted.items():
        if held.get(name, {}).get("digest") == await asyncio.to_thread(digest, folder):
            continue
        record = await asyncio.to_thread(completed, folder, module)
        if "error" in record:
            log.warning("%s: auto_complete_config failed: %s", folder, record["error"])
        else:
            log.info("%s: completed by its auto_complete_config", folder)
        await redis.hset(keys.auto_completed(), name, json.dumps(record))
        done += 1
    gone = [name for name in held if name not in wanted]
    if gone:
        await redis.hdel(keys.auto_completed(), *gone)
    return done


async def serve(root: Path, redis_url: str, once: bool) -> int:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    async with clients.connect(redis_url) as redis:
        while not stopping.is_set():
            try:
                await complete_repository(root, redis)
            except (RedisError, OSError) as exc:  # Redis away: the next pass tries again
                log.warning("auto-complete of %s: %s", root, exc)
            if once:
                return 0
            await asyncio.wait([asyncio.ensure_future(stopping.wait())], timeout=INTERVAL_S)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner.triton.complete")
    parser.add_argument("--repo", help="a folder repository: complete its Python models")
    parser.add_argument("--redis", help="where to record them")
    parser.add_argument("--once", action="store_true", help="one pass, then exit")
    parser.add_argument("--print", metavar="FOLDER", help="print one model's completed configuration")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.print:
        folder = Path(args.print)
        module = needs_completion(folder)
        if module is None:
            print(f"{folder} is not a Python model folder without a config.pbtxt", file=sys.stderr)
            return 2
        record = completed(folder, module)
        if "error" in record:
            print(f"{folder}: auto_complete_config failed: {record['error']}", file=sys.stderr)
            return 1
        print(json.dumps(record["config"], indent=2))
        return 0
    if not args.repo or not args.redis:
        parser.error("--repo and --redis, or --print FOLDER")
    return asyncio.run(serve(Path(args.repo), args.redis, args.once))


if __name__ == "__main__":
    sys.exit(main())
