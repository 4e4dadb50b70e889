"""The state folder of `fngate up`: where a running deployment leaves its gateway, Redis and
repository, so that every other command on the machine finds them without flags."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path

import orjson

UP_FILE = "up.json"


def state_dir(
    override: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None
) -> Path:
    """`override` if given, else $XDG_STATE_HOME/fngate, else ~/.local/state/fngate."""
    if override:
        return Path(override).expanduser()
    env = os.environ if environ is None else environ
    base = env.get("XDG_STATE_HOME") or str(Path("~/.local/state").expanduser())
    return Path(base) / "fngate"


@dataclasses.dataclass(frozen=True, slots=True)
class UpState:
    """What `fngate up` serves, written when it starts and removed when it stops."""

    gateway_url: str
    redis_url: str
    repo: str
    """A folder (absolute) or an s3:// URL."""
    pid: int


def write_up(state: UpState, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / UP_FILE
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    with os.fdopen(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as file:
        file.write(orjson.dumps(dataclasses.asdict(state), option=orjson.OPT_INDENT_2))
    temporary.replace(path)
    return path


def read_up(folder: Path) -> UpState | None:
    """The running `fngate up`'s state; None when there is none, or its process has gone."""
    try:
        doc = orjson.loads((folder / UP_FILE).read_bytes())
        state = UpState(**{field.name: doc[field.name] for field in dataclasses.fields(UpState)})
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return state if _alive(state.pid) else None


def clear_up(folder: Path, pid: int) -> None:
    """Remove the state file if it is still this process's."""
    current = read_up(folder)
    if current is None or current.pid == pid:
        with contextlib.suppress(OSError):
            (folder / UP_FILE).unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
