"""The `mcp` environment's connections to an MCP server, with a synchronous face.

The MCP SDK is async and the environment API is not: one background thread runs an event
loop for this module, and each connection is a task on it that opens the transport and
the session, then serves the calls it is sent one at a time (the SDK's contexts must be
entered and left by one task). A caller waits for its call's result with a timeout.

A connection is a server process we started (a command, spoken to over stdio; its stderr
goes to a temporary file whose tail the errors quote) or a session with a server at a URL
(streamable HTTP). A call that runs past its timeout, or a server that died, ends the
connection (a process of ours is stopped) and raises `ServerFailure`; the pool starts a
new one for the next episode.

`Pool` hands connections to episodes by isolation mode:
- `shared`: one connection for every episode (a stateless server);
- `reset`: a connection per live episode, reused by later ones, the `reset_tool` called
  at each checkout;
- `fresh`: a new connection per episode, closed when the episode gives it back.
Pools live at module level, one per (server, isolation, reset tool); everything is closed
at interpreter exit.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import json
import os
import shlex
import sys
import tempfile
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from looprl import children
from looprl.errors import EnvError

ISOLATIONS = ("shared", "reset", "fresh")
START_TIMEOUT_S = 30.0  # to start a server and list its tools
GRACE_S = 5.0  # beyond a call's own timeout, before the caller gives up on the loop
CONNECTION_CLOSED = -32000  # the SDK's JSON-RPC code for a connection that ended


class ServerFailure(Exception):
    """The server timed out or is gone: the connection is closed, the episode cannot go on."""


# ------------------------------------------------------------------ the background loop

_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def _loop() -> asyncio.AbstractEventLoop:
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="looprl-mcp", daemon=True).start()
            _LOOP = loop
        return _LOOP


def _wait(coro: Awaitable[Any], timeout: float) -> Any:
    """Run `coro` on the background loop and wait at most `timeout` seconds for it."""
    future = asyncio.run_coroutine_threadsafe(coro, _loop())
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise TimeoutError(f"no answer within {timeout:g} s") from None


def import_sdk() -> Any:
    """The MCP SDK, or a clear EnvError saying how to install it."""
    try:
        import mcp
    except ImportError:
        raise EnvError("env.name=mcp needs the MCP SDK: pip install mcp") from None
    return mcp


def root_error(err: BaseException) -> BaseException:
    """The first leaf of an exception group (anyio's task groups wrap what they raise)."""
    while getattr(err, "exceptions", None):
        err = err.exceptions[0]
    return err


def describe(err: BaseException) -> str:
    err = root_error(err)
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


# ------------------------------------------------------------------ one connection


class Connection:
    """One session with the server `spec` (a command line or an http(s) URL)."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.is_url = spec.startswith(("http://", "https://"))
        # the server's stderr, read back for errors (closed with the object)
        self.stderr = None if self.is_url else tempfile.TemporaryFile("w+")  # noqa: SIM115
        self.alive = False
        self._jobs: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None

    def start(self, timeout: float = START_TIMEOUT_S) -> Connection:
        """Start the server (or open the session) and initialize it; EnvError if it fails,
        quoting the end of the server's stderr."""
        try:
            _wait(self._start(), timeout)
        except Exception as err:
            self._cancel()  # a server still starting is stopped too
            tail = self.stderr_tail()
            raise EnvError(
                f"MCP server {self.spec!r} did not start: {describe(err)}"
                + (f"\n--- its stderr ends:\n{tail}" if tail else "")
            ) from None
        return self

    def call(self, fn: Callable[[Any], Awaitable[Any]], timeout: float) -> Any:
        """`await fn(session)` on the connection's task, within `timeout` seconds. A timeout
        or a dead server closes the connection and raises ServerFailure; an error the
        server answers with (a JSON-RPC error) is raised as it is."""
        if not self.alive:
            raise ServerFailure("the connection to the server is closed")
        try:
            return _wait(self._submit(fn, timeout), timeout + GRACE_S)
        except TimeoutError as err:  # the loop itself did not answer: give up on it
            self._cancel()
            raise ServerFailure(f"no answer within {timeout:g} s") from err

    def close(self) -> None:
        """Stop serving (a process of ours is stopped); returns at once."""
        self.alive = False
        if self._jobs is not None:
            _loop().call_soon_threadsafe(self._jobs.put_nowait, None)

    def stderr_tail(self, chars: int = 2000) -> str:
        return "" if self.stderr is None else children.file_tail(self.stderr, chars)

    # ---------------------------------------------------------------- on the loop

    async def _start(self) -> None:
        self._jobs = asyncio.Queue()
        ready = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._serve(ready))
        await ready
        self.alive = True

    async def _submit(self, fn: Callable[[Any], Awaitable[Any]], timeout: float) -> Any:
        done = asyncio.get_running_loop().create_future()
        await self._jobs.put((fn, timeout, done))
        return await done

    def _cancel(self) -> None:
        self.alive = False
        if self._task is not None:
            _loop().call_soon_threadsafe(self._task.cancel)

    async def _serve(self, ready: asyncio.Future) -> None:
        """Open the transport and the session, then run the jobs in order until told to
        stop or the connection fails; leaving the contexts stops the server."""
        import anyio

        mcp = import_sdk()
        job = None
        try:
            async with contextlib.AsyncExitStack() as stack:
                streams = await stack.enter_async_context(self._transport())
                session = mcp.ClientSession(streams[0], streams[1])
                await stack.enter_async_context(session)
                await session.initialize()
                ready.set_result(None)
                while (job := await self._jobs.get()) is not None:
                    fn, timeout, done = job
                    try:
                        with anyio.fail_after(timeout):
                            result = await fn(session)
                    except TimeoutError:
                        done.set_exception(ServerFailure(f"no answer within {timeout:g} s"))
                        return
                    except Exception as err:
                        if getattr(err, "code", None) == CONNECTION_CLOSED:
                            done.set_exception(ServerFailure(f"the server is gone ({err})"))
                            return
                        done.set_exception(err)  # an error the server answered with
                    else:
                        done.set_result(result)
        except BaseException as err:
            if not ready.done():
                root = root_error(err)
                ready.set_exception(
                    root if isinstance(root, Exception) else Exception(describe(err))
                )
            if job is not None and not job[2].done():
                job[2].set_exception(ServerFailure(f"the connection failed: {describe(err)}"))
            if isinstance(err, asyncio.CancelledError | KeyboardInterrupt | SystemExit):
                raise
        finally:
            self.alive = False
            while self._jobs is not None and not self._jobs.empty():
                pending = self._jobs.get_nowait()
                if pending is not None and not pending[2].done():
                    pending[2].set_exception(ServerFailure("the connection is closed"))

    def _transport(self) -> Any:
        if self.is_url:
            from mcp.client import streamable_http

            # mcp 2 names it streamable_http_client; mcp 1 streamablehttp_client
            client = getattr(streamable_http, "streamable_http_client", None)
            return (client or streamable_http.streamablehttp_client)(self.spec)
        from mcp.client.stdio import StdioServerParameters, stdio_client

        words = shlex.split(self.spec)
        if words and words[0] in ("python", "python3"):
            words[0] = sys.executable  # the Python running looprl, with its packages
        # the server is the user's own program: it inherits the environment, as any child does
        params = StdioServerParameters(command=words[0], args=words[1:], env=dict(os.environ))
        return stdio_client(params, errlog=self.stderr)


def check_command(spec: Any) -> str:
    """`spec` if it names a server: an http(s) URL or a command line."""
    if not isinstance(spec, str) or not spec.strip():
        raise EnvError(
            "mcp: env.args.server is required: a command that starts the server "
            "over stdio ('python server.py') or its URL "
            "(http://host:port/mcp)"
        )
    try:
        shlex.split(spec)
    except ValueError as err:
        raise EnvError(f"mcp: server={spec!r} is not a command line: {err}") from None
    return spec.strip()


# ------------------------------------------------------------------ pools


class Pool:
    """Connections to one server for episodes, by isolation mode (module docstring)."""

    def __init__(self, spec: str, isolation: str, reset_tool: str | None) -> None:
        self.spec, self.isolation, self.reset_tool = spec, isolation, reset_tool
        self.idle: list[Connection] = []
        self.shared: Connection | None = None
        self.lock = threading.RLock()  # the shared path starts its server holding it
        self.open: set[Connection] = set()  # every connection not yet closed
        self.listing: list[dict[str, Any]] | None = None

    def tools(self) -> list[dict[str, Any]]:
        """The server's tools as MCP lists them (wire field names), listed once."""
        if self.listing is None:
            conn = self.checkout(reset=False)
            try:
                result = conn.call(lambda s: s.list_tools(), START_TIMEOUT_S)
            except Exception as err:
                self.checkin(conn)
                raise EnvError(
                    f"MCP server {self.spec!r} could not list its tools: {describe(err)}"
                ) from None
            self.listing = [t.model_dump(by_alias=True, exclude_none=True) for t in result.tools]
            self.checkin(conn)
        return self.listing

    def checkout(self, reset: bool = True, timeout: float = START_TIMEOUT_S) -> Connection:
        """A connection for one episode; in `reset` mode its reset tool is called first (a
        server found dead then is replaced once)."""
        if self.isolation == "shared":
            with self.lock:
                if self.shared is None or not self.shared.alive:
                    self.shared = self._new()
                return self.shared
        with self.lock:
            while self.idle and not self.idle[-1].alive:
                self.open.discard(self.idle.pop())
            conn = self.idle.pop() if self.idle else None
        conn = conn or self._new()
        if not (reset and self.isolation == "reset" and self.reset_tool):
            return conn
        try:
            self._reset(conn, timeout)
        except ServerFailure:  # it died while idle: one new server
            conn = self._new()
            self._reset(conn, timeout)
        return conn

    def checkin(self, conn: Connection) -> None:
        """An episode gives its connection back: kept for later episodes, or closed."""
        if self.isolation == "shared":
            return
        if self.isolation == "fresh" or not conn.alive:
            self.discard(conn)
            return
        with self.lock:
            self.idle.append(conn)

    def discard(self, conn: Connection) -> None:
        conn.close()
        with self.lock:
            self.open.discard(conn)
            if self.shared is conn:
                self.shared = None

    def close(self) -> None:
        with self.lock:
            conns, self.open, self.idle, self.shared = list(self.open), set(), [], None
        for conn in conns:
            conn.close()

    def _new(self) -> Connection:
        conn = Connection(self.spec).start()
        with self.lock:
            self.open.add(conn)
        return conn

    def _reset(self, conn: Connection, timeout: float) -> None:
        """Call the reset tool; a connection it fails on is given back (or dropped)."""
        try:
            result = conn.call(lambda s: s.call_tool(self.reset_tool, {}), timeout)
        except ServerFailure:
            self.discard(conn)
            raise
        except Exception:
            self.checkin(conn)
            raise
        wire = result.model_dump(by_alias=True, exclude_none=True)
        if wire.get("isError"):
            self.checkin(conn)
            raise EnvError(
                f"MCP server {self.spec!r}: the reset tool {self.reset_tool!r} "
                f"failed: {result_text(wire)}"
            )


# closed by close_all below, which also waits for the servers to stop
_POOLS: children.Children[Pool] = children.Children(Pool.close, close_at_exit=False)


def pool(spec: str, isolation: str, reset_tool: str | None) -> Pool:
    """The pool of (server, isolation, reset tool), made on first use."""
    key = (spec, isolation, reset_tool if isolation == "reset" else None)
    return _POOLS.get(key, lambda: Pool(*key), lambda _: True)


def close_all(wait_s: float = 10.0) -> None:
    """Close every pool's connections and wait (up to `wait_s`) for the servers to stop."""
    _POOLS.close_all()
    if _LOOP is None:
        return

    async def settle() -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if tasks:
            await asyncio.wait(tasks, timeout=wait_s)

    # exiting anyway if it fails: a stdio server also stops when its stdin closes with us
    with contextlib.suppress(Exception):
        _wait(settle(), wait_s + 1.0)


atexit.register(close_all)


# ------------------------------------------------------------------ results


def result_text(wire: dict[str, Any]) -> str:
    """A tool result as text: its text content joined; structured content (or any other
    content) as JSON when there is no text."""
    parts = []
    for item in wire.get("content") or []:
        kind = item.get("type")
        if kind == "text":
            parts.append(item.get("text", ""))
        elif kind == "resource" and "text" in (item.get("resource") or {}):
            parts.append(item["resource"]["text"])
        elif kind in ("image", "audio"):
            parts.append(f"[{kind}: {item.get('mimeType', 'unknown type')}]")
        else:
            parts.append(json.dumps(item, ensure_ascii=False, default=str))
    text = "\n".join(p for p in parts if p)
    if not text and wire.get("structuredContent") is not None:
        text = json.dumps(wire["structuredContent"], ensure_ascii=False, default=str)
    return text
