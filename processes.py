"""Several processes of one program on this machine: launched together, watched, stopped together.

``run_local`` runs refimpl.py's ``--local-processes N``: N copies on 127.0.0.1, one jax.distributed job. Gloo writes
"[Gloo] Rank N is connected to M peer ranks" to file descriptor 1 from several threads, mid-line: ``hide_native_stdout``
sends a child's native output to /dev/null; ``without_gloo_chatter`` strips the notes from a line.

Imports: the standard library only. Imported by refimpl.py.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

LOCAL_CHILD = "REFIMPL_LOCAL_CHILD"  # set by run_local in the processes it starts
GLOO_CHATTER = re.compile(r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. "
                          r"Expected number of connected peer ranks is : \d+")


def run_local(base: list[str], count: int, *, passthrough: int, name: str = "refimpl.py") -> int:
    """Runs ``base + ["--process-id", str(i)]`` for i = 0..count-1, each in its own process group on CPU devices
    (JAX_PLATFORMS=cpu: several processes must not share one accelerator). Shows process 0's output as it comes, the
    others' only when they fail. Returns 0 when all have exited 0, or as soon as one fails: then prints its last lines,
    stops the rest and returns its exit status (1 for one killed by a signal). When process 0 alone exits with
    ``passthrough`` it has said why itself, last: that status is returned after its output, with nothing added. Every
    process group is killed whatever happens."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **{LOCAL_CHILD: "1"})
    children, errors = [], []
    try:
        for i in range(count):
            errors.append(tempfile.TemporaryFile("w+"))
            children.append(subprocess.Popen(base + ["--process-id", str(i)], env=env, start_new_session=True,
                                             stdout=subprocess.PIPE if i == 0 else subprocess.DEVNULL,
                                             stderr=subprocess.PIPE if i == 0 else errors[-1], text=True))
        forwards = [threading.Thread(target=forward, args=(stream, target), daemon=True)
                    for stream, target in ((children[0].stdout, sys.stdout), (children[0].stderr, sys.stderr))]
        for thread in forwards:
            thread.start()
        while True:
            codes = [child.poll() for child in children]
            failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
            if failed or all(code == 0 for code in codes):
                if codes[0] is not None:  # process 0's last words come before anything said of it
                    for thread in forwards:
                        thread.join()  # the streams end when process 0 has exited
                if not failed or failed == [0] and codes[0] == passthrough:
                    return codes[0]
                return _report_failure(failed[0], codes[failed[0]], errors, name)
            time.sleep(0.1)
    finally:
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        for log in errors:
            log.close()


def _report_failure(i: int, code: int, errors: list, name: str) -> int:
    how = f"exited with status {code}" if code > 0 else f"was killed by signal {signal.Signals(-code).name}"
    if i:
        errors[i].seek(0)
        tail = [line for line in map(without_gloo_chatter, errors[i].read().splitlines()) if line.strip()][-5:]
        print("\n".join(tail), file=sys.stderr)
    print(f"{name}: error: local process {i} {how}; stopping the others", file=sys.stderr)
    return code if code > 0 else 1


def hide_native_stdout() -> None:
    """Python's prints keep going to stdout; what native code writes to file descriptor 1 goes to /dev/null."""
    sys.stdout.flush()
    python_stdout = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    sys.stdout = os.fdopen(python_stdout, "w", buffering=1)


def without_gloo_chatter(line: str) -> str:
    """``line`` without gloo's "[Gloo] Rank N is connected" notes (C++ writes them mid-line)."""
    return GLOO_CHATTER.sub("", line)


def forward(stream, target) -> None:
    """Copies a child's output to ours, without the collective library's connection notes."""
    for line in stream:
        line = without_gloo_chatter(line)
        if line.strip():
            target.write(line if line.endswith("\n") else line + "\n")
            target.flush()


def strip_options(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """``argv`` without the given options and their values (``--x v`` or ``--x=v``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in names:
            skip = True
        elif not any(arg.startswith(name + "=") for name in names):
            out.append(arg)
    return out
