"""Tests only: run a Python script as `python script.py` would, in a process forked from an interpreter that
imported torch and nothing else (a "zygote", one per environment and test process), instead of a fresh
interpreter importing torch again (seconds each on a loaded 2-core machine).

The zygote starts as `python -c` with the environment given (so that variables read at startup, such as
PYTHONWARNINGS, or at triton's import, such as TRITON_INTERPRET, are in place), from `/`, with no PYTHONPATH
unless given. Each script runs in a child forked from it: its own working directory, argv, `sys.path[0]` the
script's folder, stdout and stderr to files, `__main__` the script (runpy), exit handlers run at its end; the
exit status is the script's. The package and everything else are imported by the script itself.

`start` and `ask` are the line-of-JSON servers' two ends (this zygote's, and conftest's compiled_ahead's)."""
import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import types

_SERVER = r"""
import atexit, json, os, runpy, sys, traceback
import torch  # noqa: F401 (the one import the children share)
reply = os.fdopen(os.dup(1), "w")
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.chdir(req["cwd"])
            for fd, path in ((1, req["out"]), (2, req["err"])):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # (the requests' pipe is the zygote's alone)
            sys.stdin = open(os.devnull)
            sys.argv = list(req["argv"])
            sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
            try:
                runpy.run_path(sys.argv[0], run_name="__main__")
                code = 0
            except SystemExit as e:
                if e.code is None or isinstance(e.code, int):
                    code = e.code or 0
                else:
                    print(e.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
            atexit._run_exitfuncs()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    _, status = os.waitpid(pid, 0)
    reply.write(json.dumps(os.waitstatus_to_exitcode(status)) + "\n")
    reply.flush()
"""
_servers = []
_zygotes = {}


def start(code, env, cwd, stderr=None):
    """A server: `python -c code` in a session of its own (killed, with a child still running, by close() at
    exit or when `ask` times out), reading a line of JSON a request, writing a line of JSON a reply."""
    p = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=cwd, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True)
    if not _servers:
        atexit.register(close)
    _servers.append(p)
    return p


def ask(p, request, timeout, what):
    """The reply of server `p` to `request` (JSON-able); no reply in `timeout` s: the server is killed and
    AssertionError names `what`."""
    p.stdin.write(json.dumps(request) + "\n")
    p.stdin.flush()
    ready, _, _ = select.select([p.stdout], [], [], timeout)
    line = p.stdout.readline() if ready else ""
    if not line:
        _kill(p)
        raise AssertionError(f"{what}: no reply in {timeout} s (server exit {p.poll()})")
    return json.loads(line)


def _zygote(env):
    key = tuple(sorted(env.items()))
    p = _zygotes.get(key)
    if p is None or p.poll() is not None:
        p = _zygotes[key] = start(_SERVER, env, "/")
    return p


def run(argv, cwd, env, timeout=600):
    """argv[0]: the script's path, the rest its arguments; env: the environment the process starts with.
    Returns (returncode, stdout, stderr) as subprocess.run(capture_output=True, text=True) would."""
    with tempfile.TemporaryDirectory() as d:
        out, err = os.path.join(d, "out"), os.path.join(d, "err")
        code = ask(_zygote(env), dict(argv=[str(a) for a in argv], cwd=str(cwd), out=out, err=err), timeout,
                   f"zygote, the exit status of {argv}")
        with open(out) as fo, open(err) as fe:
            return types.SimpleNamespace(returncode=code, stdout=fo.read(), stderr=fe.read())


def _kill(p):
    try:
        os.killpg(p.pid, signal.SIGKILL)  # the server and a child still running
    except ProcessLookupError:
        pass
    p.wait()  # (reaped: poll() says it ended, and the next call starts another)


def close():
    for p in _servers:
        _kill(p)
    _servers.clear()
    _zygotes.clear()
