"""`fngate invoke`: one call of a function from the command line, with inputs as JSON or .npy files
(sent as V2 binary tensors, so their datatypes travel exactly). Standard library HTTP only. It waits
as long as the function's cold start may take, and says on a terminal what it waits for."""

from __future__ import annotations

import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import orjson

from fngate.errors import FunctionError
from fngate.tensors import datatype_of, to_bytes

POLL_S = 30
"""One long-poll of `fngate result --wait` (the gateway holds at most 60 s)."""
MARGIN_S = 5.0
"""Beyond what the gateway may hold an invocation (its load, then its deadline): the answer's way back."""
DEFAULT_WAIT_S = 600.0
"""Without the function's limits (a pipeline's steps have their own): ten minutes."""
SPINNER = "|/-\\"
STATE_POLL_S = 1.0


class InvokeError(Exception):
    """Raised for the user's mistakes (exit 2); `unreachable` marks a gateway that did not answer
    (exit 1), `timed_out` one that took the connection but did not answer in time."""

    def __init__(self, message: str, unreachable: bool = False, timed_out: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable
        self.timed_out = timed_out


def invoke(
    gateway: str,
    name: str,
    data: Sequence[str],
    version: str | None,
    timeout_s: float | None,
    out: TextIO,
    api_key: str | None = None,
    asynchronous: bool = False,
    err: TextIO = sys.stderr,
) -> int:
    """Print the answer, or with `asynchronous` the id of the invocation submitted (for
    `fngate result`); raises InvokeError. With no `timeout_s`, wait as long as the gateway may
    hold the invocation (`wait_s`)."""
    auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
    if timeout_s is None:
        timeout_s = wait_s(_config(gateway, name, auth))
    method, path, body, headers = _request(gateway, name, data, version, timeout_s, auth)
    if asynchronous:
        headers["prefer"] = "respond-async"
        answer = _call(method, gateway + path, body, {**headers, **auth}, timeout_s)
    else:
        answer = Watch(gateway, name, auth, err).call(method, gateway + path, body, headers, timeout_s)
    if asynchronous:
        out.write(f"{orjson.loads(answer)['id']}\n")
        return 0
    out.write(orjson.dumps(orjson.loads(answer), option=orjson.OPT_INDENT_2).decode() + "\n")
    return 0


def result(
    gateway: str, invocation_id: str, wait: bool, timeout_s: float, out: TextIO, api_key: str | None = None
) -> int:
    """Print an asynchronous invocation's result; without `wait`, its state while pending (exit 0).
    With `wait`, long-polls until it is done or `timeout_s` passes; raises InvokeError."""
    auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
    url = f"{gateway}/v1/invocations/{urllib.parse.quote(invocation_id, safe='')}"
    deadline = time.monotonic() + timeout_s
    while True:
        left_s = deadline - time.monotonic()
        wait_s = int(max(0, min(left_s, POLL_S))) if wait else 0
        status, answer = _open("GET", f"{url}?wait={wait_s}", None, auth, wait_s + timeout_s)
        if status != 202 or not wait or left_s <= 0:
            break
    if status == 202 and wait:
        state = orjson.loads(answer).get("state")
        raise InvokeError(f"invocation {invocation_id} still {state} after {timeout_s:g} s", unreachable=True)
    try:
        doc = orjson.loads(answer)
    except orjson.JSONDecodeError:  # binary V2 outputs: as they came
        sys.stdout.buffer.write(answer)
        return 0
    out.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode() + "\n")
    return 0


def wait_s(config: dict[str, Any] | None) -> float:
    """How long an invocation may take at most, from its function's Triton configuration: the
    model's load (the gateway holds invocations through a cold start for up to load_timeout_s),
    then its own deadline, and a margin."""
    parameters = (config or {}).get("parameters") or {}
    try:
        load_s = float(parameters["load_timeout_s"]["string_value"])
        deadline_s = float(parameters["timeout_ms"]["string_value"]) / 1000
    except (KeyError, TypeError, ValueError):
        return DEFAULT_WAIT_S
    return load_s + deadline_s + MARGIN_S


def _config(gateway: str, name: str, auth: dict[str, str]) -> dict[str, Any] | None:
    """The function's configuration; None when the gateway does not give it (the invocation
    itself then says what is wrong, an unknown function included)."""
    try:
        doc = orjson.loads(_call("GET", f"{gateway}/v2/models/{name}/config", None, auth, 10))
    except (InvokeError, orjson.JSONDecodeError):
        return None
    return doc if isinstance(doc, dict) else None


class Watch:
    """One invocation in a thread; meanwhile, on a terminal, a spinner with what it waits for
    ("loading classifier (12 s)"), from the model repository index. A timeout says whether the
    model was still loading."""

    def __init__(self, gateway: str, name: str, auth: dict[str, str], err: TextIO) -> None:
        self._gateway = gateway
        self._name = name
        self._auth = auth
        self._err = err
        self.state = ""

    def call(
        self, method: str, url: str, body: bytes | None, headers: dict[str, str], timeout_s: float
    ) -> bytes:
        outcome: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                outcome["answer"] = _call(method, url, body, {**headers, **self._auth}, timeout_s)
            except InvokeError as exc:
                outcome["error"] = exc
            finally:
                done.set()

        threading.Thread(target=run, daemon=True).start()
        self._show(done)
        error: InvokeError | None = outcome.get("error")
        if error is None:
            return bytes(outcome["answer"])
        if error.timed_out:
            state = self._look() or self.state
            why = f": its model is {state}" if state else ""
            raise InvokeError(
                f"{self._name} did not answer within {timeout_s:g} s{why}; wait longer with --timeout-s",
                unreachable=True,
            )
        raise error

    def _show(self, done: threading.Event) -> None:
        terminal = self._err.isatty()
        started = time.monotonic()
        looked = started
        frame = 0
        while not done.wait(0.1):
            now = time.monotonic()
            if terminal and now - looked >= STATE_POLL_S:
                looked, self.state = now, self._look() or self.state
            if terminal:
                doing = {"loading": "loading", "starting": "starting a runner for"}.get(
                    self.state, "waiting for"
                )
                spin = SPINNER[frame % len(SPINNER)]
                self._err.write(f"\r{spin} {doing} {self._name} ({now - started:.0f} s)\x1b[K")
                self._err.flush()
                frame += 1
        if frame:
            self._err.write("\r\x1b[K")
            self._err.flush()

    def _look(self) -> str:
        """ "loading", "starting" (nothing loaded anywhere yet) or "" (ready, or not to be told)."""
        try:
            index = orjson.loads(_call("POST", f"{self._gateway}/v2/repository/index", b"{}", self._auth, 5))
        except (InvokeError, orjson.JSONDecodeError):
            return ""
        states = [
            entry.get("state")
            for entry in index
            if isinstance(entry, dict) and entry.get("name") == self._name
        ]
        if "READY" in states:
            return ""
        return "loading" if "LOADING" in states else "starting"


def _request(
    gateway: str, name: str, data: Sequence[str], version: str | None, timeout_s: float, auth: dict[str, str]
) -> tuple[str, str, bytes, dict[str, str]]:
    """JSON goes to /v1/functions/NAME; .npy inputs to /v2/models/NAME/infer as binary tensors."""
    if not data:
        data = [sys.stdin.read()]
    if all(_is_npy(item) for item in data):
        arrays = _arrays(gateway, name, data, timeout_s, auth)
        return _binary_request(name, arrays, version)
    if len(data) > 1:
        raise InvokeError("give one JSON body, or .npy files only")
    text = data[0]
    if text.startswith("@"):
        text = _read(Path(text[1:])).decode()
    try:
        doc = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise InvokeError(f"DATA is not valid JSON ({exc})") from None
    if isinstance(doc, dict) and "inputs" not in doc:
        doc = {"inputs": doc}
    if version is None:
        return "POST", f"/v1/functions/{name}", orjson.dumps(doc), {"content-type": "application/json"}
    metadata = orjson.loads(
        _call("GET", f"{gateway}/v2/models/{name}/versions/{version}", None, auth, timeout_s)
    )
    path = f"/v2/models/{name}/versions/{version}/infer"
    return "POST", path, _v2_json(doc, metadata), {"content-type": "application/json"}


def _v2_json(doc: Any, metadata: Any) -> bytes:
    """A v1 body ({"inputs": {name: nested lists}}) as a V2 request, for a pinned version (the
    /v1 route draws a version by traffic weight)."""
    inputs = doc.get("inputs") if isinstance(doc, dict) else None
    if not isinstance(inputs, dict):
        raise InvokeError("'inputs' must map input names to nested lists")
    datatypes = {item["name"]: item["datatype"] for item in metadata.get("inputs", [])}
    tensors = []
    for input_name, value in inputs.items():
        array = np.asarray(value, dtype=object)
        tensors.append(
            {
                "name": input_name,
                "datatype": datatypes.get(input_name, "FP32"),
                "shape": list(array.shape),
                "data": array.ravel().tolist(),
            }
        )
    return orjson.dumps({"inputs": tensors})


def _is_npy(item: str) -> bool:
    return (item.partition("=")[2].startswith("@") and item.endswith(".npy")) or (
        item.startswith("@") and item.endswith(".npy")
    )


def _arrays(
    gateway: str, name: str, data: Sequence[str], timeout_s: float, auth: dict[str, str]
) -> dict[str, np.ndarray[Any, Any]]:
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    for item in data:
        input_name, _, file = item.rpartition("=") if not item.startswith("@") else ("", "", item)
        if not input_name:
            input_name = _single_input(gateway, name, timeout_s, auth)
        path = Path(file[1:])
        try:
            arrays[input_name] = np.load(path, allow_pickle=False)
        except FileNotFoundError:
            raise InvokeError(f"{path} does not exist") from None
        except (OSError, ValueError) as exc:
            raise InvokeError(f"{path} is not a .npy array ({exc})") from None
    return arrays


def _single_input(gateway: str, name: str, timeout_s: float, auth: dict[str, str]) -> str:
    metadata = orjson.loads(_call("GET", f"{gateway}/v2/models/{name}", None, auth, timeout_s))
    inputs = [item["name"] for item in metadata.get("inputs", [])]
    if len(inputs) != 1:
        raise InvokeError(f"function '{name}' takes inputs {inputs}: name each one, as NAME=@FILE.npy")
    return str(inputs[0])


def _binary_request(
    name: str, arrays: dict[str, np.ndarray[Any, Any]], version: str | None
) -> tuple[str, str, bytes, dict[str, str]]:
    header: dict[str, Any] = {"inputs": []}
    buffers = []
    for input_name, array in arrays.items():
        try:
            datatype = datatype_of(array)
        except FunctionError as exc:
            raise InvokeError(f"{input_name}: {exc.message}") from None
        raw = to_bytes(array)
        header["inputs"].append(
            {
                "name": input_name,
                "datatype": datatype,
                "shape": list(array.shape),
                "parameters": {"binary_data_size": len(raw)},
            }
        )
        buffers.append(raw)
    json_part = orjson.dumps(header)
    path = f"/v2/models/{name}" + (f"/versions/{version}" if version else "") + "/infer"
    headers = {
        "content-type": "application/octet-stream",
        "inference-header-content-length": str(len(json_part)),
    }
    return "POST", path, b"".join([json_part, *buffers]), headers


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise InvokeError(f"{path} does not exist") from None
    except OSError as exc:
        raise InvokeError(f"cannot read {path} ({exc.strerror})") from None


def _call(method: str, url: str, body: bytes | None, headers: dict[str, str], timeout_s: float) -> bytes:
    return _open(method, url, body, headers, timeout_s)[1]


def _open(
    method: str, url: str, body: bytes | None, headers: dict[str, str], timeout_s: float
) -> tuple[int, bytes]:
    """(status, body) of a 2xx answer; raises InvokeError for any other."""
    request = urllib.request.Request(url, data=body, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            answer: bytes = response.read()
            return int(response.status), answer
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            message = orjson.loads(raw)["error"]
        except (ValueError, KeyError, TypeError):
            message = raw.decode(errors="replace")[:200]
        raise InvokeError(f"{exc.code}: {message}", unreachable=exc.code >= 500) from None
    except TimeoutError:  # connected, then no answer in time: a gateway is there
        raise InvokeError(f"{url} did not answer within {timeout_s:g} s", True, timed_out=True) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        base = url.split("/v", maxsplit=1)[0]
        raise InvokeError(
            f"no gateway answers at {base} ({reason}); is fngate up running? or pass --gateway URL",
            unreachable=True,
        ) from None
