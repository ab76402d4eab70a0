"""Run a command and measure it: its exit status, output and peak resident memory.

The peak is the `ru_maxrss` that `wait4` returns for that one process: its own high-water
mark (file pages it mapped and touched included), and that of any child it waited for (a
compiler building kernels on a cold cache counts: build them first). It is taken by a
small launcher interpreter that forks and waits for the command, because Linux counts in
a child's `ru_maxrss` the high-water mark of the memory it ran in before `exec`: forked
(or vforked, as `subprocess` does) straight from a bench holding gigabytes, every command
would report at least the bench's own peak. From the launcher, that floor is the
launcher's few megabytes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

# argv: REPORT_FILE COMMAND... ; writes "<exit code> <ru_maxrss in KiB>" to REPORT_FILE.
LAUNCHER = """
import os, sys
pid = os.fork()
if pid == 0:
    try:
        os.execvp(sys.argv[2], sys.argv[2:])
    except OSError as exc:
        print(f"cannot run {sys.argv[2]}: {exc}", file=sys.stderr, flush=True)
    os._exit(127)
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(f"{os.waitstatus_to_exitcode(status)} {usage.ru_maxrss}")
"""


@dataclass(frozen=True)
class MeasuredRun:
    returncode: int
    stdout: str
    stderr: str
    peak_rss_bytes: int  # the command's own ru_maxrss (Linux reports KiB)
    timed_out: bool = False

    def failure(self, what: str, tail_chars: int = 2000) -> str:
        """One line saying how `what` failed, with the end of its error output."""
        how = "timed out" if self.timed_out else f"exited with status {self.returncode}"
        tail = self.stderr.strip()[-tail_chars:].replace("\n", " | ")
        return f"{what} {how}: {tail or '(no error output)'}"


def run_measured(command: Sequence[str], timeout_s: float) -> MeasuredRun:
    """Run `command` to its end (killed, with the launcher, after `timeout_s`), its output
    in files (a pipe could fill and stall it)."""
    with (
        tempfile.TemporaryFile() as out,
        tempfile.TemporaryFile() as err,
        tempfile.TemporaryDirectory() as folder,
    ):
        report = os.path.join(folder, "report")
        launcher = [sys.executable, "-c", LAUNCHER, report, *command]
        # A session of its own: a timeout kills the launcher and the command together.
        proc = subprocess.Popen(launcher, stdout=out, stderr=err, start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            timed_out = True
        returncode, peak_kib = proc.returncode, 0
        if os.path.exists(report):
            with open(report, encoding="utf-8") as f:
                code, peak = f.read().split()
            returncode, peak_kib = int(code), int(peak)
        out.seek(0)
        err.seek(0)
        return MeasuredRun(
            returncode=returncode,
            stdout=out.read().decode(errors="replace"),
            stderr=err.read().decode(errors="replace"),
            peak_rss_bytes=peak_kib * 1024,
            timed_out=timed_out,
        )
