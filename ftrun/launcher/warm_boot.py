"""The bootstrap of a warm worker interpreter (see :mod:`ftrun.launcher.warm`).

Run by the launcher as ``PYTHON -u -c STUB THIS_FILE FD LAUNCHER_PID MODE TARGET IMPORTS
LEARNED``
(:data:`STUB` runs this file in a namespace of its own, so that emptying ``__main__`` for the
script leaves the bootstrap's functions working). Standard library only, and no ``ftrun``: the
interpreter must hold nothing the rank's own ``python -u script.py`` would not.

1. Die with the launcher (parent-death signal, as ``ftrun._exec`` does for a cold worker);
   put ``sys.path[0]`` where ``python -u TARGET`` puts it; hold what it writes to fds 1 and 2
   in memory files (the rank's streams are not known yet).
2. Import torch and the modules named in IMPORTS, then send ``R`` (ready) on socket FD.
3. Block for one request on FD: a JSON document (environment, working directory, argv) and
   two file descriptors (the rank's stdout and stderr). End of file: the pool is closing,
   exit 0. While it waits, once the file LEARNED exists (the torch modules the job's ranks
   had imported by their first finished step, noted by :mod:`ftrun.rank.progress`; empty:
   none), import those too, warnings silenced: a rank imports much of torch lazily in its
   first steps (``DistributedDataParallel``'s constructor imports ``torch._dynamo``,
   800-odd modules: 2.4-4.5 s on this project's CPUs), which a replacement would otherwise
   pay while the survivors wait for it in their first collective. Only modules the same
   script's ranks imported, so the rank this interpreter becomes would import them too.
4. Become the rank: the output held so far written to the rank's streams and those streams
   put on fds 1 and 2, the environment replaced whole, the working directory set, every
   descriptor the bootstrap opened closed (those torch's import opened stay open, as in a
   cold worker), ``__main__`` emptied to what ``python script``
   gives it, ``sys.argv`` set. Then run the script (or ``-m`` module) and exit as
   ``python -u script`` would: ``SystemExit`` as is, an uncaught exception printed by
   ``sys.excepthook`` without the bootstrap's frames and exit code 1, an uncaught
   ``KeyboardInterrupt`` ending the process by SIGINT.

Parked (``FTRUN_PARKED_WORKERS``): the first request says ``park`` and carries the job's
environment without the rank's identity (no output descriptors). The interpreter runs the
script right away, with ``os.environ`` guarded so that reading an identity variable (the
request's ``hidden`` names) raises, until the script calls its ``@ftrun.resilient`` function:
:func:`ftrun.rank.resilient.run` then calls the ``unpark`` of module ``_ftrun_parked``, which
says ``P`` on FD and blocks for the second request (the rank's environment and streams, as in
step 3) and makes the process that rank (step 4's environment, directory and streams). An
exception before that (an identity read, a crash) is printed to the launcher's streams and
ends the interpreter with :data:`PARK_REFUSED`; the pool then stops parking.
"""

import atexit
import builtins
import ctypes
import json
import os
import select
import signal
import socket
import sys
import types
import warnings
from collections.abc import MutableMapping

STUB = ("import sys; g = {'__name__': 'ftrun_warm_boot', '__file__': sys.argv[1]}; "
        "exec(compile(open(sys.argv[1]).read(), sys.argv[1], 'exec'), g); g['main'](sys.argv[2:])")
# The request: JSON up to this size (an environment is rarely over 100 KiB).
MAX_REQUEST = 4 << 20
_PR_SET_PDEATHSIG = 1
PARK_REFUSED = 3  # exit code: a parked interpreter that failed before its rank came


class IdentityRead(RuntimeError):
    """A parked interpreter's script read the rank's identity before @ftrun.resilient."""


class _GuardedEnviron(MutableMapping):
    """``os.environ`` while parked: the identity variables raise :class:`IdentityRead`."""

    def __init__(self, real, hidden):
        self._real = real
        self._hidden = frozenset(hidden)

    def _check(self, key):
        if key in self._hidden:
            raise IdentityRead(
                f"ftrun parked worker: the script reads {key} before its @ftrun.resilient "
                "function runs, where a parked interpreter has no rank yet; parked workers "
                "are off for this job (FTRUN_PARKED_WORKERS): read it inside that function")

    def __getitem__(self, key):
        self._check(key)
        return self._real[key]

    def __contains__(self, key):
        self._check(key)
        return key in self._real

    def get(self, key, default=None):
        self._check(key)
        return self._real.get(key, default)

    def __setitem__(self, key, value):
        self._real[key] = value

    def __delitem__(self, key):
        del self._real[key]

    def __iter__(self):
        return iter(self._real)

    def __len__(self):
        return len(self._real)

    def copy(self):
        return dict(self._real)


def _tie_to_launcher(launcher_pid: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != launcher_pid:
        raise SystemExit(f"ftrun warm worker: launcher {launcher_pid} is gone")


def _hold_output() -> list[tuple[int, int]]:
    """Point fds 1 and 2 at memory files; returns (fd, the original's copy) pairs."""
    held = []
    for fd in (1, 2):
        saved = os.dup(fd)
        mem = os.memfd_create(f"ftrun-warm-{fd}", os.MFD_CLOEXEC)
        os.dup2(mem, fd)
        os.close(mem)
        held.append((fd, saved))
    return held


def _release_output(held: list[tuple[int, int]], targets: list[int]) -> None:
    """Write what fds 1 and 2 received so far to ``targets`` and put those on fds 1 and 2."""
    for (fd, saved), target in zip(held, targets, strict=True):
        os.lseek(fd, 0, os.SEEK_SET)
        while True:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            view = memoryview(chunk)
            while view:
                view = view[os.write(target, view):]
        os.dup2(target, fd)
        os.close(saved)


def _receive(sock: socket.socket) -> tuple[dict, list[int]]:
    msg, fds, _flags, _addr = socket.recv_fds(sock, MAX_REQUEST, 2)
    if not msg:
        raise SystemExit(0)  # the pool closed this interpreter unused
    return json.loads(msg), fds


def _await_request(sock: socket.socket) -> tuple[dict, list[int]]:
    """Step 3: the next request, importing the learned modules meanwhile (once)."""
    while _learned["path"]:
        ready, _, _ = select.select([sock], [], [], WAIT_POLL_S)
        if ready:
            break
        if os.path.exists(_learned["path"]):
            _import_learned(_learned["path"], sock)
    return _receive(sock)


def _import_learned(path: str, sock: socket.socket) -> None:
    """Import the ``torch`` modules listed in ``path`` (one per line) until a request
    arrives on ``sock`` (the rank imports the rest itself); a module that fails is left for
    the rank to import (or fail on) itself."""
    _learned["path"] = ""
    try:
        with open(path, encoding="utf-8") as f:
            names = [n.strip() for n in f]
    except OSError:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names:
            if (name != "torch" and not name.startswith("torch.")) or name in sys.modules:
                continue
            if select.select([sock], [], [], 0)[0]:
                return  # the rank is wanted now
            try:
                __import__(name)
            except Exception:  # noqa: BLE001, S112 - the rank's own import says why
                continue


def _main_namespace(path: str | None) -> dict:
    """``__main__``'s namespace emptied to what ``python path`` starts with (``-m`` when
    ``path`` is None: runpy fills it in)."""
    from importlib.machinery import SourceFileLoader

    namespace = sys.modules["__main__"].__dict__
    namespace.clear()
    namespace.update(__name__="__main__", __doc__=None, __package__=None, __spec__=None,
                     __annotations__={}, __builtins__=builtins,
                     __loader__=None if path is None else SourceFileLoader("__main__", path))
    if path is not None:
        namespace.update(__file__=path, __cached__=None)
    return namespace


def _exit_like_python(exc: BaseException, skip: set[str]) -> None:
    """End as the interpreter ends on an uncaught ``exc``, without this file's frames."""
    if isinstance(exc, SystemExit):
        raise exc
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in skip:
        tb = tb.tb_next
    exc = exc.with_traceback(tb)
    # As the interpreter's own print does, and so that the exception (its frames: the model,
    # the process group) lives until the interpreter's finalization, as in a cold worker:
    # freed here, a process group's destructor may wait for peers blocked on this rank.
    sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb
    if sys.version_info >= (3, 12):
        sys.last_exc = exc
    sys.excepthook(type(exc), exc, tb)
    if isinstance(exc, KeyboardInterrupt):
        _interrupted.append(True)  # _die_by_sigint, registered first, runs last at exit
    raise SystemExit(1)


_interrupted: list[bool] = []


def _die_by_sigint() -> None:
    if _interrupted:
        sys.stdout.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)


_learned = {"path": ""}  # LEARNED: the file to import from while waiting ("" once done)
WAIT_POLL_S = 0.25  # how often a waiting interpreter looks for LEARNED


def main(argv: list[str]) -> None:
    sock_fd, launcher_pid, mode, target, imports, learned = argv
    _learned["path"] = learned
    _tie_to_launcher(int(launcher_pid))
    atexit.register(_die_by_sigint)  # first, so that it runs last (after torch's, the script's)
    script = mode == "script"
    sys.path[0] = os.path.dirname(os.path.realpath(target)) if script else os.getcwd()
    held = _hold_output()
    try:
        import torch  # noqa: F401 - the point of a warm interpreter

        for name in filter(None, imports.split(",")):
            __import__(name)
        sock = socket.socket(fileno=int(sock_fd))
        try:
            sock.sendall(b"R")
        except OSError:
            pass  # the launcher took this interpreter before it was ready: the request waits
        request, fds = _await_request(sock)
    except BaseException:
        _release_output(held, [held[0][1], held[1][1]])  # the launcher's log shows why
        raise
    parked = bool(request.get("park"))
    if parked:
        _park(sock, held, request)
    else:
        _become_rank(sock, held, request, fds)
    skip = {"<string>", __file__}  # the stub's frame and this file's
    args = request["argv"]
    sys.orig_argv = list(request["orig_argv"])
    if script:
        path = os.path.abspath(target)
        namespace = _main_namespace(path)
        sys.argv = [target, *args]
        with open(path, "rb") as f:
            code = compile(f.read(), path, "exec", dont_inherit=True)
        try:
            exec(code, namespace)
        except BaseException as e:
            _park_failed(e, skip)
            _exit_like_python(e, skip)
        _park_failed(None, skip)
    else:
        import runpy

        _main_namespace(None)
        sys.argv = ["-m", *args]
        try:
            runpy._run_module_as_main(target, alter_argv=True)  # what `python -m` calls
        except BaseException as e:
            _park_failed(e, skip)
            _exit_like_python(e, skip)
        _park_failed(None, skip)


def _become_rank(sock: socket.socket, held: list, request: dict, fds: list) -> None:
    """Step 4's setting up: the rank's streams, environment and working directory."""
    _release_output(held, fds)
    sock.close()
    for fd in fds:
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])


_parking: dict = {}  # while parked: the socket, held output and real environment


def _park(sock: socket.socket, held: list, request: dict) -> None:
    """Run the script without a rank: the identity guarded, ``_ftrun_parked.unpark`` ready."""
    real = os.environ
    real.clear()
    real.update(request["env"])
    os.chdir(request["cwd"])
    os.environ = _GuardedEnviron(real, request.get("hidden") or ())  # noqa: B003 - a guard
    _parking.update(sock=sock, held=held, real=real)
    module = types.ModuleType("_ftrun_parked")
    module.unpark = _unpark
    sys.modules["_ftrun_parked"] = module


def _unpark() -> None:
    """Called by ``@ftrun.resilient`` on entry: wait for the rank, then become it."""
    sys.modules.pop("_ftrun_parked", None)
    sock, held, real = _parking.pop("sock"), _parking.pop("held"), _parking.pop("real")
    os.environ = real  # noqa: B003 - the guard goes: the same environment again
    try:
        sock.sendall(b"P")
    except OSError:
        pass  # the request may be waiting already
    try:
        request, fds = _await_request(sock)
    except BaseException:
        _release_output(held, [held[0][1], held[1][1]])  # the launcher's log shows why
        raise
    _become_rank(sock, held, request, fds)
    sys.orig_argv = list(request["orig_argv"])


def _park_failed(exc, skip: set) -> None:
    """The script ended (``exc``: raised) while still parked: say why on the launcher's
    streams and exit with PARK_REFUSED."""
    if "held" not in _parking:
        return
    held = _parking.pop("held")
    os.environ = _parking.pop("real")  # noqa: B003 - the guard goes
    _parking.clear()
    _release_output(held, [held[0][1], held[1][1]])
    if exc is not None and not isinstance(exc, SystemExit):
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in skip:
            tb = tb.tb_next
        sys.excepthook(type(exc), exc, tb)
    else:
        print("ftrun parked worker: the script ended without calling its @ftrun.resilient "
              "function; parked workers are off for this job", file=sys.stderr, flush=True)
    raise SystemExit(PARK_REFUSED)
