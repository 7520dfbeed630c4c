"""A warm start for the tests' Python launches (helpers.run_python: `python -m ddptrain ...`, test scripts,
`python -c ...`, torchrun's launcher).

Every CLI launch of the suite used to be a fresh interpreter that imported torch and torch._dynamo (which
torch.optim imports when an optimizer is built): ~2.5 s of CPU before the first line of ddptrain ran, paid
by some 300 launches. The zygote is one process, started once per test session, that has imported those
and nothing of ddptrain; each launch is a fork of it that then becomes what a fresh `python ARGS` would
be: the caller's environment, working directory, stdio, argv and sys.path, fresh random seeds,
ddptrain imported from the checkout, and an exit that runs the same shutdown (non-daemon threads joined,
atexit handlers, stdio flushed) but for the interpreter's teardown. The launched process is still a real
process with its own pid (`run` waits for it, `start` gives a Popen-like handle to signal); the forkservers
it starts are forks of it too (`_spawn_or_fork_forkserver`), and everything else starts as before.

What a fork cannot reproduce falls back to a fresh interpreter (`Zygote.accepts`): an environment that
torch or Python read at import and that differs from the zygote's (thread counts, PYTHON* flags, torch's
logging), and anything a test runs with `fresh=True`.

Protocol, over a Unix socket: the client sends one JSON request (argv, env, cwd) with its stdin, stdout and
stderr as file descriptors; the zygote answers the child's pid, then its exit code. The zygote serves until
its stdin (a pipe from the test session) closes.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import locale
import multiprocessing.util
import os
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# What a training launch imports anyway and what costs the time; ddptrain itself is imported by each child,
# from the checkout, so no module-level state of it is shared between launches.
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.distributed.elastic.multiprocessing",
           "torch.distributed.launcher.api", "numpy", "safetensors.torch")

# Read at import or interpreter start by Python, torch or OpenMP: a launch whose value differs from the
# zygote's cannot be a fork of it.
# PYTHONPATH is one: a sitecustomize.py on it runs at the start of an interpreter (tests/odd_node has one).
_IMPORT_TIME_PREFIXES = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "LD_", "TORCH_LOGS", "TORCH_CPP_LOG",
                         "TORCHDYNAMO", "TORCHINDUCTOR", "CUDA_", "LC_", "LANG")

_MAX_REQUEST = 1 << 20


# ---- the zygote ------------------------------------------------------------------------------------------

def accepts(env: dict[str, str], zygote_env: dict[str, str]) -> bool:
    """Whether a launch with `env` can be a fork of a zygote started with `zygote_env`."""
    keys = {k for k in (*env, *zygote_env) if k.startswith(_IMPORT_TIME_PREFIXES)}
    return all(env.get(k) == zygote_env.get(k) for k in keys)


def serve(address: str) -> None:
    """Serve launches on the socket at `address` until stdin closes (the session ended, cleanly or not: an xdist
    worker leaves without running its atexit), then remove the socket's directory."""
    try:
        _serve(address)
    finally:
        shutil.rmtree(os.path.dirname(address), ignore_errors=True)


def _serve(address: str) -> None:
    import importlib

    started_with = dict(os.environ)

    for name in PRELOAD:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()  # the preloaded objects stay out of every child's collections (and its copy-on-write pages)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(sys.stdin.fileno(), selectors.EVENT_READ)
    waiting: dict[int, socket.socket] = {}  # child pid -> the connection that waits for its exit code
    print("ready", flush=True)
    while True:
        for key, _ in selector.select(timeout=0.02):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                try:
                    pid = _start(conn, listener, waiting, started_with)
                    if pid:
                        waiting[pid] = conn
                except (OSError, ValueError) as exc:  # a client that went away, a request cut short
                    print(f"zygote: dropped a request: {exc!r}", file=sys.stderr)
                    conn.close()
            elif not os.read(sys.stdin.fileno(), 4096):  # the session ended
                return
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                with conn, contextlib.suppress(OSError):  # (a client past its timeout has gone)
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())


def _start(conn: socket.socket, listener: socket.socket, waiting: dict[int, socket.socket],
           started_with: dict[str, str]) -> int:
    """Fork a child for the request on `conn` and answer its pid; 0 (and "refused") for a fresh interpreter."""
    data, fds, _, _ = socket.recv_fds(conn, _MAX_REQUEST, 3)
    request = json.loads(data)
    if not accepts(request["env"], started_with):
        for fd in fds:
            os.close(fd)
        conn.sendall(b"refused\n")
        conn.close()
        return 0
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        for other in (listener, *waiting.values()):
            other.close()
        conn.close()
        _become(request, fds)  # never returns
    for fd in fds:
        os.close(fd)
    conn.sendall(f"{pid}\n".encode())
    return pid


def _become(request: dict, fds: list[int]) -> None:
    """In the forked child: turn into `python ARGS` as a fresh interpreter would run it."""
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        if request.get("new_session"):
            os.setsid()  # Popen(start_new_session=True)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        import random

        import numpy

        random.seed()
        numpy.random.seed()
        multiprocessing.util.spawnv_passfds = _spawn_or_fork_forkserver
        code = _run_main(request["args"])
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


_spawnv_passfds = multiprocessing.util.spawnv_passfds


def _spawn_or_fork_forkserver(path: str, args: list[str], passfds) -> int:
    """multiprocessing's way to start its forkserver (and resource tracker), in a launch forked from the zygote.

    The `--nproc` launcher starts a forkserver for its workers (parallel.launch.WORKER_PRELOAD), and each
    trainer with loader workers one for them (data.pipeline.worker_context): fresh interpreters that import
    torch again, ~2.5 s of CPU each, on the launch's critical path. A process that has torch already and no
    native threads forks it instead, and the fork runs the very command the interpreter would have run, with
    only the descriptors it would have had and the signal dispositions an exec leaves.
    """
    if "multiprocessing.forkserver import main" not in args[-1] or _native_threads():
        return _spawnv_passfds(path, args, passfds)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1  # (a failure before the command runs)
    try:
        keep = {0, 1, 2, *map(int, passfds)}
        for fd in map(int, os.listdir("/proc/self/fd")):
            if fd not in keep:
                with contextlib.suppress(OSError):
                    os.close(fd)
        for sig in range(1, signal.NSIG):  # an exec resets caught signals and keeps ignored ones
            with contextlib.suppress(OSError, ValueError):
                if callable(signal.getsignal(sig)):
                    signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh interpreter starts
        import threading
        from multiprocessing import forkserver

        forkserver._forkserver._lock = threading.Lock()  # held by the launcher's ensure_running at the fork
        # Importing it is what it does (leave the job's signals): a preload must run it again, as afresh.
        sys.modules.pop("ddptrain.parallel.forkserver", None)
        code = _exit_status(lambda: exec(args[-1], {"__name__": "__main__"}))
    finally:
        os._exit(code)


def _native_threads() -> bool:
    """Whether this process has threads that Python did not start (gloo's): one of them entering Python at a
    fork can leave the child hung on CPython 3.11 before 3.11.10 (see data.pipeline.fork_is_safe). Python's
    own threads (ddptrain's launcher watch, blocked in select) are safe to fork beside."""
    import threading

    return len(os.listdir("/proc/self/task")) > threading.active_count()


def _run_main(args: list[str]) -> int:
    """Run `python ARGS` (`-m MODULE ...`, `-c CODE ...` or `SCRIPT ...`) with the argv and sys.path[0] a fresh
    interpreter gives it (the rest of sys.path, from the same PYTHONPATH, is the zygote's); its exit status."""
    import runpy
    import threading
    import types

    if args[0] == "-m":
        sys.argv, sys.path[0] = ["-m", *args[2:]], os.getcwd()  # run_module puts the module's file in argv[0]
        main = lambda: runpy.run_module(args[1], run_name="__main__", alter_sys=True)  # noqa: E731
    elif args[0] == "-c":
        sys.argv, sys.path[0] = ["-c", *args[2:]], ""
        module = sys.modules["__main__"] = types.ModuleType("__main__")
        main = lambda: exec(compile(args[1], "<string>", "exec"), module.__dict__)  # noqa: E731
    else:
        sys.argv, sys.path[0] = list(args), os.path.dirname(os.path.realpath(args[0]))
        main = lambda: runpy.run_path(args[0], run_name="__main__")  # noqa: E731
    code = _exit_status(main)
    try:  # what the interpreter does at exit: join non-daemon threads, run atexit handlers, flush stdio
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    return code


def _exit_status(run) -> int:
    """Run `run()` as an interpreter runs its main module: the exit status of its SystemExit (its message on
    stderr), 1 with the traceback printed for any other exception, else 0."""
    try:
        run()
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return (exc.code or 0) & 0xFF
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


# ---- the client (the test session) -----------------------------------------------------------------------

class Zygote:
    """One per test session, started on first use."""

    def __init__(self, env: dict[str, str], cwd: Path, preload: tuple[str, ...] = ()):
        """`preload`: modules imported beside PRELOAD's, for launches that all import them (the bench's Llamas)."""
        self._dir = tempfile.mkdtemp(prefix="ddptrain-zygote-")
        self.address = os.path.join(self._dir, "socket")
        self.env = dict(env)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"import zygote; zygote.PRELOAD += {preload!r}; zygote.serve({self.address!r})"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self.env, cwd=cwd)
        line = self.proc.stdout.readline()
        if line.strip() != b"ready":
            raise RuntimeError(f"the test zygote did not start (exit {self.proc.wait()})")
        atexit.register(self.close)

    def accepts(self, env: dict[str, str]) -> bool:
        return accepts(env, self.env)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.alive():
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        self.proc.stdout.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def run(self, args: list[str], *, env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
        """`python ARGS` as subprocess.run(..., capture_output=True, text=True) runs it, but for one
        thing: once the process has exited, what it started gets `AFTER_EXIT_S` to finish writing rather than
        until it closes the pipes. A trainer whose loader workers share tensors by file name has torch start a
        torch_shm_manager, which inherits every descriptor and outlives it by ~2 s, writing nothing."""
        cmd = [sys.executable, *args]
        reply, pid, out_r, err_r = self._launch(args, env, cwd, new_session=False)
        chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
        try:
            code = _collect(chunks, reply, time.monotonic() + timeout)
        except subprocess.TimeoutExpired:
            _kill(pid)
            _collect(chunks, reply, time.monotonic() + 5, quiet=True)
            raise subprocess.TimeoutExpired(cmd, timeout, _text(chunks[out_r]), _text(chunks[err_r])) from None
        finally:
            for fd in chunks:
                os.close(fd)
            reply.close()
        return subprocess.CompletedProcess(cmd, code, _text(chunks[out_r]), _text(chunks[err_r]))

    def start(self, args: list[str], *, env: dict[str, str], cwd: Path) -> WarmProcess:
        """`python ARGS` in the background, in a session of its own, as
        subprocess.Popen(..., stdout=PIPE, stderr=PIPE, text=True, start_new_session=True) starts it."""
        reply, pid, out_r, err_r = self._launch(args, env, cwd, new_session=True)
        return WarmProcess([sys.executable, *args], reply, pid, out_r, err_r)

    def _launch(self, args: list[str], env: dict[str, str], cwd: Path, new_session: bool):
        """Fork a launch with /dev/null for stdin and new pipes for stdout and stderr: (the zygote's reply, the
        child's pid, the pipes' read ends)."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        try:
            reply, pid = _request(self.address, args, env, str(cwd), [null, out_w, err_w], new_session)
        finally:
            for fd in (null, out_w, err_w):
                os.close(fd)
        if reply is None:
            os.close(out_r)
            os.close(err_r)
            raise RuntimeError(f"the test zygote refused a launch with this environment: {env}")
        return reply, pid, out_r, err_r

    def shim(self, directory: Path, module: str = "ddptrain") -> Path:
        """An executable `directory/MODULE` that runs `python -m MODULE ARGS` as a fork of this zygote (put the
        directory first on PATH): for tests that run shell commands, such as every documented one."""
        script = directory / module
        script.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                          f"import zygote\nzygote.forward({self.address!r}, ['-m', {module!r}])\n")
        script.chmod(0o755)
        return script


AFTER_EXIT_S = 0.5


class WarmProcess:
    """A background launch forked from the zygote, with the part of subprocess.Popen's interface the tests use
    (pid, returncode, poll, wait, communicate, send_signal, kill); its output is read by `communicate`."""

    def __init__(self, args: list[str], reply: _Reply, pid: int, out_r: int, err_r: int):
        self.args, self.pid, self.returncode = args, pid, None
        self._reply, self._out, self._err = reply, out_r, err_r
        self._chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
        self._closed = False

    def poll(self) -> int | None:
        if self.returncode is None:
            line = self._reply.line()
            if line is not None:
                self.returncode = int(line)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            select.select([self._reply.conn], [], [], left)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        if not self._closed:
            deadline = time.monotonic() + (timeout if timeout is not None else 365 * 86400)
            try:
                self.returncode = _collect(self._chunks, self._reply, deadline, code=self.returncode)
            except subprocess.TimeoutExpired:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            for fd in self._chunks:
                os.close(fd)
            self._reply.close()
            self._closed = True
        return _text(self._chunks[self._out]), _text(self._chunks[self._err])

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)



class _Reply:
    """The zygote's answers on a connection, a line at a time: the child's pid, then its exit code."""

    def __init__(self, conn: socket.socket):
        self.conn, self._buffer = conn, b""

    def fileno(self) -> int:
        return self.conn.fileno()

    def line(self) -> bytes | None:
        """A whole line if one has arrived (reading what is there without waiting), else None."""
        if b"\n" not in self._buffer:
            self.conn.setblocking(False)
            try:
                while data := self.conn.recv(4096):
                    self._buffer += data
                else:  # the zygote closed the connection
                    if b"\n" not in self._buffer:
                        raise RuntimeError("the test zygote closed the connection before the launch's exit code")
            except BlockingIOError:
                pass
            finally:
                self.conn.setblocking(True)
        if b"\n" not in self._buffer:
            return None
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def wait_line(self) -> bytes:
        while (line := self.line()) is None:
            select.select([self.conn], [], [])
        return line

    def close(self) -> None:
        self.conn.close()


def _request(address: str, args: list[str], env: dict[str, str], cwd: str, fds: list[int],
             new_session: bool = False):
    """Send a launch; (the zygote's reply, the child's pid), or (None, None) where the zygote refused it."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(address)
    request = json.dumps({"args": args, "env": env, "cwd": cwd, "new_session": new_session}).encode()
    socket.send_fds(conn, [request], fds)
    reply = _Reply(conn)
    line = reply.wait_line()
    if line.strip() == b"refused":
        reply.close()
        return None, None
    return reply, int(line)


def forward(address: str, prefix: list[str]) -> None:
    """The shim's body: `python PREFIX ARGS` for this process's ARGS, stdio and environment, run by the zygote;
    its exit code. A launch the zygote refuses runs in a fresh interpreter instead."""
    args = [*prefix, *sys.argv[1:]]
    reply, pid = _request(address, args, dict(os.environ), os.getcwd(), [0, 1, 2])
    if reply is None:
        os.execv(sys.executable, [sys.executable, *args])
    code = int(reply.wait_line())
    if code < 0:  # killed by a signal: so is the shim
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


def _collect(chunks: dict[int, list[bytes]], reply: _Reply, deadline: float, quiet: bool = False,
             code: int | None = None) -> int | None:
    """Read the pipes into `chunks` until the child's exit code (`code` if known already) has come and its
    pipes closed (or AFTER_EXIT_S passed since); the exit code. TimeoutExpired past `deadline` (None if
    `quiet`)."""
    selector = selectors.DefaultSelector()
    for fd in chunks:
        selector.register(fd, selectors.EVENT_READ)
    if code is None:
        selector.register(reply, selectors.EVENT_READ)
    until = deadline if code is None else min(deadline, time.monotonic() + AFTER_EXIT_S)
    try:
        while code is None or selector.get_map():  # (the reply leaves the map with the exit code)
            left = until - time.monotonic()
            if left <= 0:
                if code is not None or quiet:
                    break
                raise subprocess.TimeoutExpired("ddptrain", 0)
            for key, _ in selector.select(timeout=left):
                if key.fileobj is reply:
                    line = reply.line()
                    if line is not None:
                        code, until = int(line), min(deadline, time.monotonic() + AFTER_EXIT_S)
                        selector.unregister(reply)
                    continue
                data = os.read(key.fd, 65536)
                if data:
                    chunks[key.fd].append(data)
                else:
                    selector.unregister(key.fd)
    finally:
        selector.close()
    return code


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _text(chunks: list[bytes]) -> str:
    # subprocess's text mode: the locale's encoding, universal newlines
    text = b"".join(chunks).decode(locale.getpreferredencoding(False))
    return text.replace("\r\n", "\n").replace("\r", "\n")


_zygote: Zygote | None = None


def zygote(env: dict[str, str], cwd: Path) -> Zygote:
    """The session's zygote for launches in `env`, started (again) when there is none alive or the session's
    environment changed where the zygote's imports read it (a test's import of scikit-learn sets KMP_*)."""
    global _zygote
    if _zygote is not None and not (_zygote.alive() and _zygote.accepts(env)):
        _zygote.close()
        _zygote = None
    if _zygote is None:
        _zygote = Zygote(env, cwd)
    return _zygote
