"""Run model-written Python in a confined child process, of which nothing outlives the call.

Each call starts :mod:`.sandbox_launcher`, which confines the code before it runs a line (see docs/agents.md,
"Running model-written code", for each guarantee and the test that checks it):

- its own PID namespace: the code's first process is a child of a PID-1 init that exits when the code's main
  process does, and the kernel then kills every process the code started (daemons, ``setsid`` children);
- its own mount namespace: the filesystem it sees is a read-only root holding only the interpreter's install
  and shared libraries (read-only binds) and ``/sandbox``, its working directory, a tmpfs capped at
  ``disk_mib`` (all files together) and ``disk_files``; nothing else exists for it (no ``stat``, no pathname unix
  socket, no /proc), and Landlock repeats the rule (reads only in those trees, writes only in /sandbox);
- its own network, IPC and UTS namespaces (no interface up) and, with Landlock ABI ≥ 4 and ≥ 6, no TCP, no
  abstract unix socket and no signal to any process outside the sandbox;
- a seccomp filter: no AF_UNIX socket, no io_uring, no new namespace (so no user namespace to regain
  capabilities in), no foreign-architecture or x32 system call;
- under root it runs as ``nobody``; otherwise inside a new user namespace, as the caller's uid with no
  capabilities. Either way it cannot address the caller or another sandbox (separate PID namespaces);
- rlimits: CPU seconds, address space, processes, file size; an empty environment, ``python -I -S``.

The wall-time limit is enforced by the caller (the launcher stops the namespace and reports back, so the call
returns only once every process is gone); stdout and stderr are read as they come, so what the code printed is
returned even when it was cut short. Where any step cannot be set up, :func:`run_python` raises
:class:`SandboxUnavailable` with the step and the OS's reason, and the code does not run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_launcher.py")
WORK_DIR = "/sandbox"  # the code's working directory, as it sees it
STOP_GRACE_S = 10.0  # after the wall limit, how long the launcher gets to take the namespace down


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot be set up here (the message names the step and the OS's reason); the code did not run."""


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: int = 5  # CPU seconds (RLIMIT_CPU: the code is killed at the limit)
    wall_s: float = 10.0  # wall-clock seconds before every process of the sandbox is killed
    memory_mib: int = 512  # address space of each process (RLIMIT_AS)
    max_processes: int = 32  # RLIMIT_NPROC (under root: of the user nobody, shared by concurrent sandboxes)
    file_size_mib: int = 16  # largest file the code may write (RLIMIT_FSIZE)
    disk_mib: int = 64  # all files of the working directory together (the size of its tmpfs)
    disk_files: int = 1024  # files and directories in the working directory (its tmpfs's inodes)
    max_output_bytes: int = 16384  # kept of stdout and of stderr each

    def __post_init__(self):
        for name in ("cpu_s", "wall_s", "memory_mib", "max_processes", "file_size_mib", "disk_mib", "disk_files",
                     "max_output_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
                    or (name != "wall_s" and value != int(value)):
                kind = "number" if name == "wall_s" else "integer"
                raise ValueError(f"SandboxLimits.{name}: expected a positive {kind}; got {value!r}")


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # negative: killed by that signal; None: stopped at the wall-time limit
    timed_out: bool  # the wall-time limit was hit
    output_truncated: bool
    duration_s: float
    output_bytes: dict = field(default_factory=dict)  # bytes written to each stream, kept or not

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


def _others_may_run(path: str) -> bool:
    """Whether ``path`` itself is readable and executable by any user (its parent directories need not be: the
    sandbox recreates them)."""
    try:
        return os.stat(path).st_mode & 0o005 == 0o005
    except OSError:
        return False


def _runs_as_nobody() -> bool:
    return os.geteuid() == 0


def code_interpreter() -> str:
    """The Python that runs the code: this one (its real file), or when the code runs as ``nobody`` and may not
    run this one, the first system ``python3`` that any user may run."""
    own = os.path.realpath(sys.executable)
    stdlib = os.path.join(os.path.dirname(os.path.dirname(own)), "lib")
    if not _runs_as_nobody() or (_others_may_run(own) and _others_may_run(stdlib)):
        return own
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3"):
        real = os.path.realpath(candidate)
        if os.path.exists(real) and _others_may_run(real) and \
                _others_may_run(os.path.join(os.path.dirname(os.path.dirname(real)), "lib")):
            return real
    raise SandboxUnavailable(f"running as root, the sandbox runs the code as user nobody, who may not run {own} nor "
                             "a system python3: install python3 for all users or run longrl as a non-root user")


DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")


def read_paths(interpreter: str) -> list[str]:
    """What the code's interpreter must read: its install (binary, stdlib, shared libraries), the system's
    libraries and loader cache, and /dev's basics. Symbolic links (``/lib -> usr/lib``) are kept as links, their
    targets listed too; a tree inside another listed tree is left out."""
    prefix = os.path.dirname(os.path.dirname(interpreter))
    wanted = [os.path.dirname(interpreter), prefix + "/lib", prefix + "/lib64", "/usr/lib", "/usr/lib64", "/lib",
              "/lib64", "/usr/local/lib", "/etc/ld.so.cache", *DEVICES]
    links, trees = set(), set()
    for path in wanted:
        if not os.path.lexists(path):
            continue
        if os.path.islink(path) and os.path.dirname(os.path.realpath(path)) != os.path.dirname(path):
            links.add(path)
        if os.path.exists(path):
            trees.add(os.path.realpath(path))
    kept = [t for t in sorted(trees) if not any(t.startswith(o + "/") for o in trees if o != t)]
    return sorted(links - set(kept)) + kept


class _Capture:
    """A stream read to its end in a thread; the first ``keep`` bytes kept as they arrive, all counted."""

    def __init__(self, stream, keep: int):
        self.kept, self.total, self.keep = bytearray(), 0, keep
        self.thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.thread.start()

    def _read(self, stream) -> None:
        while chunk := stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536):
            self.total += len(chunk)
            if len(self.kept) < self.keep:
                self.kept += chunk[:self.keep - len(self.kept)]

    def text(self) -> str:
        return bytes(self.kept).decode(errors="replace")


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), stdin: str = "") -> SandboxResult:
    """Run ``code`` as ``main.py`` in a confined child (see the module docstring); never raises for what the code
    does (errors, kills and timeouts are in the result). Raises SandboxUnavailable where confinement cannot be
    set up, naming the step and the reason."""
    interpreter = code_interpreter()
    try:
        host_dir = tempfile.mkdtemp(prefix="longrl-sandbox-")
    except OSError as e:
        raise SandboxUnavailable(f"cannot create the sandbox's temporary directory: {e}") from e
    try:
        return _run(code, limits, stdin, interpreter, host_dir)
    except OSError as e:
        raise SandboxUnavailable(f"cannot start the sandbox: {e}") from e
    finally:
        shutil.rmtree(host_dir, ignore_errors=True)


def _run(code: str, limits: SandboxLimits, stdin: str, interpreter: str, host_dir: str) -> SandboxResult:
    code_path, root = os.path.join(host_dir, "main.py"), os.path.join(host_dir, "root")
    with open(os.open(code_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(code)
    os.mkdir(root, 0o700)
    read = read_paths(interpreter)
    cfg = {"python": interpreter, "code_path": code_path, "root": root, "work": WORK_DIR, "read": read,
           "read_write_files": ["/dev/null", "/dev/zero"], "caller_pid": os.getpid(),
           "backstop_s": limits.wall_s + 2 * STOP_GRACE_S,
           "limits": {k: getattr(limits, k) for k in ("cpu_s", "memory_mib", "max_processes", "file_size_mib",
                                                      "disk_mib", "disk_files")}}
    report_r, report_w = os.pipe()
    try:
        cfg["report_fd"] = report_w
        start = time.perf_counter()
        proc = subprocess.Popen([os.path.realpath(sys.executable), "-I", "-S", "-B", LAUNCHER, json.dumps(cfg)],
                                cwd="/", env={"PATH": "/usr/bin:/bin"}, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(report_w,),
                                start_new_session=True, close_fds=True)
        os.close(report_w)
        report_w = None
        out, err = _Capture(proc.stdout, limits.max_output_bytes), _Capture(proc.stderr, limits.max_output_bytes)
        # fed from a thread: code that never reads a large stdin must not hold the call past its wall limit
        threading.Thread(target=_feed, args=(proc.stdin, stdin.encode()), daemon=True).start()
        timed_out = False
        try:
            proc.wait(timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.terminate()  # the launcher kills the namespace's init, then waits until nothing is left
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                _kill_group(proc.pid)
                proc.wait()
        report = _read_report(report_r)
        for capture in (out, err):  # every writer is gone: the readers reach the end at once
            capture.thread.join(timeout=STOP_GRACE_S)
        duration = time.perf_counter() - start
    finally:
        os.close(report_r)
        if report_w is not None:
            os.close(report_w)
    if "refused" in report:
        raise SandboxUnavailable(report["refused"])
    if "exit" not in report and not timed_out:
        raise SandboxUnavailable(f"the sandbox launcher ended without a report (exit status {proc.returncode}): "
                                 f"{err.text()[-2000:]}")
    sizes = {"stdout": out.total, "stderr": err.total}
    return SandboxResult(out.text(), err.text(), None if timed_out else report["exit"], timed_out,
                         any(n > limits.max_output_bytes for n in sizes.values()), duration, sizes)


def _feed(stream, data: bytes) -> None:
    try:
        stream.write(data)
        stream.close()
    except OSError:  # the code exited without reading it all
        pass


def _read_report(fd: int) -> dict:
    data = b""
    while chunk := os.read(fd, 65536):
        data += chunk
    try:
        return json.loads(data.decode().splitlines()[0]) if data.strip() else {}
    except (ValueError, IndexError):
        return {}


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def python(code: str) -> str:
    """Run a Python program in a sandbox and return what it printed.

    Args:
        code: The complete Python program to run (standard library only; print the results you need).
    """
    result = run_python(code)
    text = result.stdout
    if result.stderr:
        text += ("\n" if text else "") + result.stderr
    if result.timed_out:
        text += "\n[timed out]"
    elif result.exit_code not in (0, None):
        text += f"\n[exit status {result.exit_code}]"
    if result.output_truncated:
        text += "\n[output truncated]"
    return text.strip()
