"""Run Python scripts as ``python SCRIPT ARGS`` would, without paying for
``import torch`` (and Inductor, matplotlib, ...) in each.

A *zygote* process imports the heavy modules once; each script then runs in a
child forked from it, as ``__main__``, with its own argv, working directory,
stdout and stderr, and its exit status comes back as a process's would. A
script therefore still cannot leak state into the next one (each child is
gone when it ends), only the import is shared. The benchmark smoke tests run
about twenty scripts per worker; each paid 5-10 s of CPU time for its imports
alone.

Fork is POSIX-only; elsewhere :func:`run` falls back to a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

# What the zygote imports before it forks: what most benchmark scripts import.
PRELOAD = ("torch", "torch._dynamo", "torch._inductor.compile_fx", "triton", "tabulate",
           "matplotlib.pyplot", "flashfuse")

_ZYGOTE_SOURCE = r"""
import atexit, importlib, json, os, runpy, sys
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception:  # a missing optional module: the script imports what it needs
        pass
channel_in, channel_out = sys.stdin, sys.stdout
channel_out.write("ready\n"); channel_out.flush()
for line in channel_in:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:  # the child: become `python script args`
        code = 1
        try:
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
            os.dup2(os.open(req["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
            os.chdir(req["cwd"])
            sys.argv = list(req["argv"])
            sys.path[0] = os.path.dirname(os.path.abspath(req["argv"][0]))
            try:
                runpy.run_path(req["argv"][0], run_name="__main__")
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if not isinstance(e.code, (int, type(None))):
                    print(e.code, file=sys.stderr)
            except BaseException:
                import traceback
                traceback.print_exc()
                code = 1
            atexit._run_exitfuncs()
        finally:
            try:
                sys.stdout.flush(); sys.stderr.flush()
            finally:
                os._exit(code)
    channel_out.write(json.dumps({"pid": pid}) + "\n"); channel_out.flush()
    _, status = os.waitpid(pid, 0)
    rc = os.waitstatus_to_exitcode(status)
    channel_out.write(json.dumps({"rc": rc}) + "\n"); channel_out.flush()
"""


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


class _Zygote:
    def __init__(self, env: dict):
        self.env = env
        self.proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE_SOURCE, *PRELOAD], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the script runner's zygote did not start")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _reply(self, timeout: float):
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the script runner's zygote died")
        return json.loads(line)

    def run(self, argv: list, cwd: str, timeout: float) -> Result:
        with tempfile.TemporaryDirectory() as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            self.proc.stdin.write(json.dumps(dict(argv=argv, cwd=cwd, out=out, err=err)) + "\n")
            self.proc.stdin.flush()
            pid = self._reply(60)["pid"]
            reply = self._reply(timeout)
            if reply is None:
                os.kill(pid, signal.SIGKILL)
                self._reply(60)
                raise subprocess.TimeoutExpired(argv, timeout)
            return Result(reply["rc"], open(out).read(), open(err).read())


_zygotes: dict = {}


def run(script: str, *args: str, cwd: str, env: dict, timeout: float = 300) -> Result:
    """Run ``python script args`` in ``cwd``; ``env`` is the environment of
    the zygote, so one zygote serves each distinct environment."""
    argv = [script, *args]
    if not hasattr(os, "fork"):
        proc = subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
        return Result(proc.returncode, proc.stdout, proc.stderr)
    key = tuple(sorted(env.items()))
    zygote = _zygotes.get(key)
    if zygote is None or not zygote.alive():
        zygote = _zygotes[key] = _Zygote(env)
    return zygote.run(argv, cwd, timeout)
