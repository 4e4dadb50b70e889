"""The process a Python function runs in (`python -m runner.sandbox`), and the frames it speaks with
the runner over its stdin and stdout: a JSON header and the tensors' raw bytes in the V2 binary
layout, read straight into the arrays that use them (one copy each way, no pickling)."""

from __future__ import annotations

import argparse
import collections
import importlib.util
import math
import os
import re
import select
import shutil
import signal
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from fngate.errors import ErrorCode, FunctionError, ModelFailed
from fngate.tensors import DATATYPES, Tensors, datatype_of, from_bytes, to_bytes
from runner.confinement import Confinement, confine

Header = dict[str, Any]
Buffer = bytes | memoryview

PREFIX = struct.Struct("<IQ")
"""Header bytes, body bytes."""
SECRET = re.compile(r"^(FNGATE_|AWS_|AZURE_|GOOGLE_)|SECRET|PASSWORD|PASSWD|TOKEN|CREDENTIAL|PRIVATE|_KEY$")
"""Variables a function's process never sees: the runner's settings (the Redis URL holds its
password), cloud credentials, and whatever is named like a secret."""
PARENT_CHECK_S = 0.5
MAX_HEADER_BYTES = 16 * 2**20


class ChannelClosed(Exception):
    """The other end of the pipe is gone (the process exited or closed it)."""


class FrameTooLarge(Exception):
    """A frame's prefix declares a body past what its reader takes (nothing of it was read)."""

    def __init__(self, body_bytes: int, max_body_bytes: int) -> None:
        super().__init__(f"a frame of {body_bytes} bytes, over {max_body_bytes}")
        self.body_bytes = body_bytes
        self.max_body_bytes = max_body_bytes


def clean_environment(environ: Mapping[str, str]) -> dict[str, str]:
    return {name: value for name, value in environ.items() if not SECRET.search(name.upper())}


def pack_tensors(tensors: Mapping[str, np.ndarray[Any, Any]]) -> tuple[list[list[Any]], list[Buffer]]:
    """Each tensor as [name, datatype, shape, byte length], and its buffer (a view, not a copy, for a
    C-contiguous little-endian array)."""
    specs: list[list[Any]] = []
    buffers: list[Buffer] = []
    for name, array in tensors.items():
        datatype = datatype_of(array)
        if datatype == "BYTES":
            buffer: Buffer = to_bytes(array)
        elif not array.size:
            buffer = b""
        elif array.flags.c_contiguous and array.dtype.byteorder != ">":
            buffer = array.data.cast("B")
        else:
            buffer = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).data.cast("B")
        specs.append([name, datatype, list(array.shape), len(buffer)])
        buffers.append(buffer)
    return specs, buffers


def unpack_tensors(specs: Sequence[Sequence[Any]], body: np.ndarray[Any, Any]) -> Tensors:
    """Arrays over `body`, a uint8 array (no copy for fixed-size datatypes)."""
    tensors: Tensors = {}
    offset = 0
    for name, datatype, shape, length in specs:
        if datatype == "BYTES":
            tensors[name] = from_bytes(datatype, shape, body[offset : offset + length].data, name)
        else:
            dtype = DATATYPES[datatype]
            count = length // dtype.itemsize
            if count * dtype.itemsize != length or count != math.prod(shape):
                raise ValueError(f"tensor '{name}': {length} bytes do not hold {datatype} of shape {shape}")
            array = np.frombuffer(body, dtype=dtype, count=count, offset=offset)
            tensors[name] = array.reshape(shape)
        offset += length
    return tensors


def send(fd: int, header: Header, buffers: Sequence[Buffer] = (), deadline: float | None = None) -> None:
    """Write one frame, in one system call when the pipe has room. With a deadline
    (time.monotonic()), `fd` must be non-blocking; raises TimeoutError past it and ChannelClosed
    when the reader is gone."""
    raw = orjson.dumps(header)
    parts: list[Buffer] = [PREFIX.pack(len(raw), sum(len(buffer) for buffer in buffers)) + raw]
    parts += [buffer for buffer in buffers if len(buffer)]
    total = sum(len(part) for part in parts)
    written = _write(fd, parts[:512], deadline)
    if written == total:
        return
    pending = [memoryview(part).cast("B") for part in parts]
    while pending:
        while pending and written >= len(pending[0]):
            written -= len(pending[0])
            pending.pop(0)
        if written:
            pending[0] = pending[0][written:]
        if pending:
            written = _write(fd, pending[:512], deadline)


def _write(fd: int, parts: Sequence[Buffer], deadline: float | None) -> int:
    while True:
        try:
            return os.writev(fd, parts)
        except BlockingIOError:
            _wait(fd, select.POLLOUT, deadline)
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise ChannelClosed(str(exc)) from exc


def receive(
    fd: int, deadline: float | None = None, max_body_bytes: int | None = None
) -> tuple[Header, np.ndarray[Any, Any]]:
    """Read one frame: its header and its body (a uint8 array), in two system calls when it has
    all arrived. Raises FrameTooLarge, having read only its prefix, for a body past
    `max_body_bytes`: the body is never allocated."""
    if deadline is not None:
        _wait(fd, select.POLLIN, deadline)  # rather than a first read that fails with EAGAIN
    prefix = bytearray(PREFIX.size)
    _read_into(fd, [memoryview(prefix)], deadline)
    header_bytes, body_bytes = PREFIX.unpack(prefix)
    if header_bytes > MAX_HEADER_BYTES:
        raise ValueError(f"a frame header of {header_bytes} bytes")
    if max_body_bytes is not None and body_bytes > max_body_bytes:
        raise FrameTooLarge(body_bytes, max_body_bytes)
    raw = bytearray(header_bytes)
    body = np.empty(body_bytes, dtype=np.uint8)  # not zeroed: every byte is read into
    _read_into(fd, [memoryview(raw), body.data], deadline)
    header: Header = orjson.loads(raw)
    return header, body


def readable(fd: int, timeout_s: float) -> bool:
    """Whether a frame has begun to arrive on `fd` within `timeout_s`."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout_s * 1000))


def _read_into(fd: int, views: list[memoryview], deadline: float | None) -> None:
    views = [view for view in views if len(view)]
    while views:
        try:
            count = os.readv(fd, views)
        except BlockingIOError:
            _wait(fd, select.POLLIN, deadline)
            continue
        except ConnectionResetError as exc:
            raise ChannelClosed(str(exc)) from exc
        if count == 0:
            raise ChannelClosed("end of file")
        while views and count >= len(views[0]):
            count -= len(views[0])
            views.pop(0)
        if count:
            views[0] = views[0][count:]


def _wait(fd: int, events: int, deadline: float | None) -> None:
    poller = select.poll()
    poller.register(fd, events)
    if deadline is None:
        poller.poll()
        return
    remaining_ms = (deadline - time.monotonic()) * 1000
    if remaining_ms <= 0 or not poller.poll(max(1, int(remaining_ms))):
        raise TimeoutError


# ---------------------------------------------------------------- the child's side


def serve(
    model: Any,
    name: str,
    requests: int,
    replies: int,
    memory_limit_bytes: int | None = None,
    calls: ModelCalls | None = None,
) -> None:
    """Answer batches until the runner closes the pipe or asks to close. With `calls` (a Triton
    model's), the requests pipe is read through them: what comes down it for the model's calls and
    streams meanwhile goes to them."""
    while True:
        try:
            header, body = calls.next_batch() if calls is not None else receive(requests)
        except ChannelClosed:
            return
        op = header.get("op")
        if op == "close":
            return
        if op is not None:  # what was meant for a batch that ended (a late cancel): no batch of its own
            continue
        number = header.get("batch")  # its reply names it (a decoupled model's batches overlap)
        named = {"batch": number} if number is not None else {}
        try:
            inputs = unpack_tensors(header["tensors"], body)
            outputs = _infer(model, name, inputs, header["outputs"], header.get("rows"), number or 0)
            specs, buffers = pack_tensors(outputs)
            _check_size(name, sum(len(buffer) for buffer in buffers), header)
        except FunctionError as exc:
            send(replies, _reported(model, {"error": exc.message, "code": exc.code.value, **named}))
            continue
        except MemoryError as exc:
            failed = {
                "error": out_of_memory(name, memory_limit_bytes, exc),
                "code": ErrorCode.MODEL_FAILED.value,
                **named,
            }
            send(replies, _reported(model, failed))
            continue
        except Exception as exc:
            message = f"function '{name}' failed: {type(exc).__name__}: {exc}"
            send(replies, _reported(model, {"error": message, "code": ErrorCode.MODEL_FAILED.value, **named}))
            continue
        errors = getattr(model, "member_errors", None)  # invocations that failed alone (runner.triton)
        header = {"tensors": specs, **({"errors": errors} if errors else {}), **named}
        still = getattr(model, "open_requests", None)  # a decoupled batch's requests that stream on
        if still:
            header["open"] = still
        send(replies, _reported(model, header), buffers)


class ModelCalls:
    """The model process's pipes to its runner, as a Triton model uses them. Its calls (BLS) go up
    the replies pipe ({"op": "call"}) and their answers come down the requests pipe ({"op":
    "called"}; a decoupled call's responses first, each with "part"), each named by its id; a
    decoupled model's responses go up as they are made ({"op": "sent"}, with their batch's number
    and request's index). Down the requests pipe also come the batches, and the runner's word that a
    request's caller left ({"op": "cancel"}). Whoever reads the pipe hands each frame to whom it is
    for: several threads share it (calls at once, the batches' loop, is_cancelled())."""

    def __init__(self, requests: int, replies: int) -> None:
        self._requests, self._replies = requests, replies
        self._sending = threading.Lock()
        self._reading = threading.Lock()
        self._arrived = threading.Condition()
        self._answers: dict[int, collections.deque[tuple[dict[str, Any], Any]]] = {}
        self._batches: collections.deque[tuple[dict[str, Any], Any]] = collections.deque()
        self._next = 0
        self._cancelled: set[tuple[int, int]] = set()

    def cancelled(self, batch: int, index: int) -> bool:
        """Whether the caller of request `index` of batch `batch` left, as its runner said; reads
        what has come down the pipe, without waiting."""
        if (batch, index) not in self._cancelled and self._reading.acquire(blocking=False):
            try:
                while readable(self._requests, 0):
                    self._take(*receive(self._requests))
            finally:
                self._reading.release()
        return (batch, index) in self._cancelled

    def forget(self, batch: int) -> None:
        """The batch's requests have all ended: what was said of them is not kept."""
        self._cancelled = {item for item in self._cancelled if item[0] != batch}

    def next_batch(self) -> tuple[dict[str, Any], Any]:
        """The next frame that is no call's answer nor a cancel: a batch (or "close")."""
        return self._wait_for(lambda: self._batches.popleft() if self._batches else None)

    def call(
        self, model: str, version: str, outputs: Sequence[str], inputs: Mapping[str, np.ndarray[Any, Any]]
    ) -> Tensors | str:
        """The callee's outputs, or its error's message."""
        answer, body = self._await(self._start(model, version, outputs, inputs, False))
        if "error" in answer:
            return str(answer["error"])
        return unpack_tensors(answer.get("tensors") or [], body)

    def call_decoupled(
        self, model: str, version: str, outputs: Sequence[str], inputs: Mapping[str, np.ndarray[Any, Any]]
    ) -> Iterator[Tensors | str]:
        """The callee's responses as they come (outputs, or an error's message), its answer last.
        The call goes out at once; its responses are read as the iterator is."""
        return self._responses(self._start(model, version, outputs, inputs, True))

    def _responses(self, call_id: int) -> Iterator[Tensors | str]:
        while True:
            answer, body = self._await(call_id)
            yield (
                str(answer["error"])
                if "error" in answer
                else unpack_tensors(answer.get("tensors") or [], body)
            )
            if not answer.get("part"):
                return

    def _start(
        self,
        model: str,
        version: str,
        outputs: Sequence[str],
        inputs: Mapping[str, np.ndarray[Any, Any]],
        decoupled: bool,
    ) -> int:
        specs, buffers = pack_tensors(inputs)
        with self._sending:
            self._next += 1
            call_id = self._next
            header = {"op": "call", "id": call_id, "model": model, "version": version}
            if decoupled:
                header["decoupled"] = True
            with self._arrived:
                self._answers[call_id] = collections.deque()
            send(self._replies, {**header, "outputs": list(outputs), "tensors": specs}, buffers)
        return call_id

    def sent(
        self,
        batch: int,
        index: int,
        final: bool,
        outputs: Mapping[str, np.ndarray[Any, Any]] | None,
        error: tuple[str, str] | None,
    ) -> None:
        """A decoupled model's response to request `index` of batch `batch`, up the replies pipe
        ({"op": "sent"}) as it is made (None: the final flag alone); `final` ends that request."""
        specs, buffers = pack_tensors(outputs or {})
        header: dict[str, Any] = {
            "op": "sent",
            "batch": batch,
            "index": index,
            "final": final,
            "tensors": specs,
        }
        if outputs is None and error is None:
            header["empty"] = True
        if error is not None:
            header["error"] = list(error)
        with self._sending:
            send(self._replies, header, buffers)

    def _take(self, header: dict[str, Any], body: Any) -> None:
        """A frame down the pipe, to whom it is for."""
        op = header.get("op")
        if op == "cancel":
            self._cancelled.add((int(header.get("batch", 0)), int(header.get("index", -1))))
            return
        with self._arrived:
            if op != "called":
                self._batches.append((header, body))
            elif (waiting := self._answers.get(int(header.get("id", 0)))) is not None:
                waiting.append((header, body))  # else: a call its caller gave up on
            self._arrived.notify_all()

    def _next_of(self, call_id: int) -> tuple[dict[str, Any], Any] | None:
        """Under `_arrived`: the next frame for the call, if one came (its last one ends it)."""
        waiting = self._answers[call_id]
        if not waiting:
            return None
        frame = waiting.popleft()
        if not frame[0].get("part"):
            del self._answers[call_id]
        return frame

    def _await(self, call_id: int) -> tuple[dict[str, Any], Any]:
        return self._wait_for(lambda: self._next_of(call_id))

    def _wait_for(self, found: Callable[[], tuple[dict[str, Any], Any] | None]) -> tuple[dict[str, Any], Any]:
        """What `found` finds (under `_arrived`), reading the pipe meanwhile when no other thread
        does."""
        while True:
            with self._arrived:
                if (frame := found()) is not None:
                    return frame
            if not self._reading.acquire(blocking=False):
                with self._arrived:
                    if (frame := found()) is not None:
                        return frame
                    self._arrived.wait(0.05)
                continue
            try:
                while True:
                    with self._arrived:
                        if (frame := found()) is not None:
                            return frame
                    self._take(*receive(self._requests))
            finally:
                self._reading.release()
                with self._arrived:
                    self._arrived.notify_all()


def _reported(model: Any, header: Header) -> Header:
    """The reply's header with the custom metrics the model changed since the last reply (a Triton
    model's pb_utils.MetricFamily), if any."""
    take = getattr(model, "take_metrics", None)
    metrics = take() if take is not None else None
    return {**header, "metrics": metrics} if metrics else header


def _check_size(name: str, size: int, request: Header) -> None:
    """The runner reads no more than max_output_bytes an invocation (and stops a process that
    sends more): a batch past it is refused here, and its process stays."""
    limit = request.get("max_output_bytes")
    if limit is None:
        return
    invocations = len(request.get("rows") or ()) or 1
    if size <= limit * invocations:
        return
    if invocations == 1:
        raise ModelFailed(
            f"function '{name}': the outputs of this invocation are {size} bytes, over its "
            f"max_output_bytes of {limit}"
        )
    raise ModelFailed(
        f"function '{name}': the outputs of the batch are {size} bytes, over the {limit * invocations} "
        f"its {invocations} invocations may answer (max_output_bytes {limit} each)"
    )


def out_of_memory(name: str, memory_limit_bytes: int | None, exc: BaseException | None = None) -> str:
    """The error of a batch that needed more memory than its function may have."""
    cause = f" ({type(exc).__name__}: {exc})" if exc is not None and str(exc) else ""
    if memory_limit_bytes is None:
        return f"function '{name}': the batch ran out of memory{cause}"
    return (
        f"function '{name}': the batch needed more memory than its memory_limit_mb of "
        f"{memory_limit_bytes // 2**20} MiB{cause}"
    )


def _infer(
    model: Any, name: str, inputs: Tensors, wanted: Sequence[str], rows: Any = None, batch: int = 0
) -> Tensors:
    takes_rows = getattr(model, "takes_rows", False)
    results = model.infer(inputs, rows, batch) if takes_rows else model.infer(inputs)
    if not isinstance(results, dict):
        raise TypeError(f"Model.infer returned {type(results).__name__}, not a dict of arrays")
    outputs: Tensors = {}
    for output in wanted:
        if output in results:
            array = np.asarray(results[output])
            try:
                datatype_of(array)
            except FunctionError:
                raise TypeError(f"output '{output}' is {array.dtype}, which no datatype holds") from None
            outputs[output] = array
    return outputs


def load_model(
    module_path: Path, directory: Path, triton_config: dict[str, Any] | None = None, instance: int = 0
) -> Any:
    """model.py's Model, or its TritonPythonModel (Triton's Python backend, runner.triton) with the
    model configuration `triton_config`, as the function's instance `instance`."""
    from runner.triton.model import TritonModel

    module = _module(module_path)
    model_class = getattr(module, "Model", None)
    if model_class is None and hasattr(module, "TritonPythonModel"):
        return TritonModel(module, module_path, directory, triton_config or {}, instance)
    if model_class is None:
        raise ValueError(f"{module_path.name} defines no class Model (nor Triton's TritonPythonModel)")
    return model_class(directory)


def _module(module_path: Path) -> Any:
    """model.py imported, with Triton's `triton_python_backend_utils` importable beside it."""
    from runner.triton.model import provide_utils

    provide_utils()
    spec = importlib.util.spec_from_file_location("fngate_function", module_path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{module_path.name} is not a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules["fngate_function"] = module
    spec.loader.exec_module(module)
    return module


def auto_complete(module_path: Path, config: dict[str, Any]) -> dict[str, Any]:
    """A Triton Python model's configuration as its `auto_complete_config` completes `config` (as it
    is, for a model without one)."""
    from runner.triton.python_backend import ModelConfig

    model_class = getattr(_module(module_path), "TritonPythonModel", None)
    if model_class is None:
        raise ValueError(f"{module_path.name} defines no class TritonPythonModel")
    complete = getattr(model_class, "auto_complete_config", None)
    given = ModelConfig(config)
    if complete is None:
        return given.as_dict()
    answered = complete(given)
    if not isinstance(answered, ModelConfig):
        raise TypeError(
            f"auto_complete_config answered {type(answered).__name__}, not the pb_utils.ModelConfig"
        )
    return answered.as_dict()


def _complete_only(header: Header, replies: int, applied: Any) -> int:
    try:
        completed = auto_complete(Path(header["module"]), header["complete"])
    except Exception as exc:
        traceback.print_exc()
        send(replies, {"error": f"{type(exc).__name__}: {exc}", "code": ErrorCode.INVALID_ARGUMENT.value})
        return 1
    send(replies, {"ready": True, "confined": applied, "config": completed})
    shutil.rmtree(os.getcwd(), ignore_errors=True)  # its working folder
    return 0


def _watch_parent(parent: int) -> None:
    """A runner that dies (even by SIGKILL) takes its functions' processes with it."""
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_S)
    os._exit(70)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner.sandbox")
    parser.add_argument("--function", required=True)
    parser.add_argument("--parent", required=True, type=int)
    parser.add_argument("--prints", required=True, type=int, help="where stdout goes: a pipe to the runner")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the runner decides when its functions stop
    # The frames own stdin and the original stdout; what the model prints goes to the runner on
    # pipes of their own (runner.output), never where its answers go.
    requests, replies = 0, os.dup(1)
    os.dup2(args.prints, 1)
    os.close(args.prints)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # each print when it happens
    try:
        # Once the runner has placed this process (its cgroups): what to load, and how confined.
        header, _body = receive(requests)
    except ChannelClosed:
        return 1
    confinement = Confinement.decode(header["confinement"])
    try:
        applied = confine(confinement)
    except OSError as exc:
        failed = {"error": f"could not confine its process: {exc}", "code": ErrorCode.MODEL_FAILED.value}
        send(replies, failed)
        return 1
    # Started once confined: a thread started before would be outside the mount namespace, the
    # seccomp filter and Landlock's domain, which hold the thread that applies them and its own.
    threading.Thread(target=_watch_parent, args=(args.parent,), daemon=True).start()
    if header.get("complete") is not None:  # only auto_complete_config, then gone
        return _complete_only(header, replies, applied)
    calls: ModelCalls | None = None
    try:
        triton_config, instance = header.get("triton_config"), int(header.get("instance", 0))
        if triton_config is not None:  # its calls to other models (BLS) go through these pipes
            from runner.triton import python_backend

            calls = ModelCalls(requests, replies)
            python_backend.open_channel(calls)
        if header.get("torchscript") is not None:
            from runner.backends.torchscript import OwnProcess

            model = OwnProcess(header["torchscript"], Path(header["directory"]))
        else:
            model = load_model(Path(header["module"]), Path(header["directory"]), triton_config, instance)
    except Exception as exc:
        traceback.print_exc()
        send(replies, {"error": f"{type(exc).__name__}: {exc}", "code": ErrorCode.INVALID_ARGUMENT.value})
        return 1
    reason = getattr(model, "fallback_reason", None)
    device = str(getattr(model, "device", "cpu"))
    ready = {"ready": True, "confined": applied, "device": device}
    send(replies, ready | {"reason": None if reason is None else str(reason)})
    serve(model, args.function, requests, replies, confinement.memory_limit_bytes, calls)
    close = getattr(model, "close", None)
    if callable(close):
        close()
    shutil.rmtree(os.getcwd(), ignore_errors=True)  # the working folder the runner made for this process
    return 0


if __name__ == "__main__":
    sys.exit(main())
