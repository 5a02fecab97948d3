"""Run model-written Python in a confined child process.

Each call gets a fresh private temporary directory (its working directory, removed afterwards) and a child that,
before it runs a line of the code:

- leads a new session, so the whole process group is killed (SIGKILL) on timeout and when the call returns;
- enters a new network namespace (no interfaces up: every connect fails), as a new user namespace when not root;
- restricts its filesystem with Landlock: writes only inside the temporary directory, reads only there and in the
  interpreter's own install (no project files, no home directory);
- drops to user ``nobody`` when it was root (so that the process limit binds);
- sets rlimits: CPU seconds, address space (memory), processes (fork bombs), file size;
- runs with an empty environment and ``python -I -S`` (no site-packages, no PYTHON* variables).

The wall-time limit is enforced by the parent; stdout/stderr are read concurrently and kept up to
``max_output_bytes`` each (the rest is drained and counted). Where the OS allows no network namespace or no
Landlock, :func:`run_python` refuses (``SandboxUnavailable``) instead of running the code unconfined.
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

REFUSED_EXIT = 97  # the launcher's exit status when it cannot confine the child


class SandboxUnavailable(RuntimeError):
    """This OS cannot confine the child as required (no network namespace or no Landlock); the message says why."""


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: int = 5  # CPU seconds (RLIMIT_CPU: SIGXCPU, then SIGKILL)
    wall_s: float = 10.0  # wall-clock seconds before the process group is killed
    memory_mib: int = 512  # address space (RLIMIT_AS)
    max_processes: int = 32  # RLIMIT_NPROC (of the sandbox user)
    file_size_mib: int = 16  # largest file the code may write (RLIMIT_FSIZE)
    max_output_bytes: int = 16384  # kept of stdout and of stderr each


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # negative: killed by that signal
    timed_out: bool  # the wall-time limit was hit
    output_truncated: bool
    duration_s: float
    output_bytes: dict = field(default_factory=dict)  # bytes written to each stream, kept or not

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


# The launcher runs in the child (python -I -S -c LAUNCHER CONFIG): it confines itself, then execs the code's
# interpreter. stdlib only; it reports a refusal on stderr with exit status REFUSED_EXIT.
_LAUNCHER = r'''
import ctypes, json, os, resource, sys
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def refuse(why):
    sys.stderr.write("sandbox refused: " + why + "\n"); sys.stderr.flush(); os._exit(97)
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
root = os.geteuid() == 0
uid, gid = os.getuid(), os.getgid()
if libc.unshare(CLONE_NEWNET if root else CLONE_NEWUSER | CLONE_NEWNET) != 0:
    refuse("no new network namespace (unshare: %s)" % os.strerror(ctypes.get_errno()))
if not root:
    for name, text in (("setgroups", "deny"), ("uid_map", "%d %d 1" % (uid, uid)), ("gid_map", "%d %d 1" % (gid, gid))):
        with open("/proc/self/" + name, "w") as f:
            f.write(text)
abi = libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
if abi < 1:
    refuse("no Landlock filesystem confinement (%s)" % os.strerror(ctypes.get_errno()))
READ = (1 << 0) | (1 << 2) | (1 << 3)  # execute, read file, read dir
ALL = (1 << 13) - 1 | ((1 << 13) if abi >= 2 else 0) | ((1 << 14) if abi >= 3 else 0)
class Ruleset(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64)]
class Beneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed", ctypes.c_uint64), ("fd", ctypes.c_int32)]
attr = Ruleset(ALL)
fd = libc.syscall(444, ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)), ctypes.c_uint32(0))
if fd < 0:
    refuse("landlock_create_ruleset: %s" % os.strerror(ctypes.get_errno()))
def allow(path, access):
    try:
        pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return
    rule = Beneath(access if os.path.isdir(path) else access & ((1 << 0) | (1 << 1) | (1 << 2) | (1 << 14)), pfd)
    if libc.syscall(445, fd, 1, ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
        refuse("landlock_add_rule %s: %s" % (path, os.strerror(ctypes.get_errno())))
    os.close(pfd)
for path in cfg["read"]:
    allow(path, READ)
for path in cfg["write"]:
    allow(path, ALL)
if root:
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
lim = cfg["limits"]
for res, value in ((resource.RLIMIT_CPU, lim["cpu_s"]), (resource.RLIMIT_AS, lim["memory_mib"] << 20),
                   (resource.RLIMIT_NPROC, lim["max_processes"]), (resource.RLIMIT_FSIZE, lim["file_size_mib"] << 20),
                   (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(res, (value, value))
if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS, required by landlock_restrict_self
    refuse("prctl(NO_NEW_PRIVS): %s" % os.strerror(ctypes.get_errno()))
if libc.syscall(446, fd, ctypes.c_uint32(0)) != 0:
    refuse("landlock_restrict_self: %s" % os.strerror(ctypes.get_errno()))
os.execv(cfg["python"], [cfg["python"], "-I", "-S", "-B", "main.py"])
'''


def _world_executable(path: str) -> bool:
    """Whether any user may run ``path`` (every directory above it searchable, the file readable and executable)."""
    parts = os.path.realpath(path).split(os.sep)
    dirs = [os.sep.join(parts[:i]) or os.sep for i in range(1, len(parts))]
    try:
        return all(os.stat(d).st_mode & 0o001 for d in dirs) and os.stat(path).st_mode & 0o005 == 0o005
    except OSError:
        return False


def code_interpreter() -> str:
    """The Python that runs the code: this one, or (when the child drops from root to ``nobody``, who may not be
    able to reach this one) the first system ``python3`` that any user may run."""
    own = os.path.realpath(sys.executable)
    if os.geteuid() != 0:
        return own
    for candidate in (own, "/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3"):
        if os.path.exists(candidate) and _world_executable(candidate):
            return os.path.realpath(candidate)
    raise SandboxUnavailable(f"running as root, the sandbox drops to user nobody, who cannot run {own} nor a system "
                             "python3: install python3 for all users or run longrl as a non-root user")


def _read_paths(interpreter: str) -> list[str]:
    """What the code's interpreter must read: its install (binary, stdlib, shared libraries) and /dev's basics."""
    prefix = os.path.dirname(os.path.dirname(interpreter))
    paths = {prefix + "/lib", os.path.dirname(interpreter), "/usr/lib", "/usr/local/lib", "/lib", "/lib64",
             "/usr/lib64", "/etc/ld.so.cache", "/dev/urandom", "/dev/null"}
    if interpreter == os.path.realpath(sys.executable):
        paths.add(sys.base_prefix)
    return sorted(p for p in paths if os.path.exists(p))


def _drain(stream, keep: int, out: dict, key: str) -> None:
    """Read ``stream`` to its end, keeping the first ``keep`` bytes in out[key] and counting all in out[key+'_n']."""
    kept, total = bytearray(), 0
    while True:
        chunk = stream.read(65536)
        if not chunk:
            break
        total += len(chunk)
        if len(kept) < keep:
            kept += chunk[:keep - len(kept)]
    out[key], out[key + "_n"] = bytes(kept), total


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), stdin: str = "") -> SandboxResult:
    """Run ``code`` as ``main.py`` in a confined child (see the module docstring); never raises for what the code
    does (errors, kills and timeouts are in the result). Raises SandboxUnavailable where confinement is impossible."""
    interpreter = code_interpreter()
    workdir = tempfile.mkdtemp(prefix="longrl-sandbox-")
    try:
        with open(os.path.join(workdir, "main.py"), "w") as f:
            f.write(code)
        if os.geteuid() == 0:  # the child runs as nobody: it owns its directory, and only that
            os.chown(workdir, 65534, 65534)
            os.chown(os.path.join(workdir, "main.py"), 65534, 65534)
        cfg = {"python": interpreter, "read": _read_paths(interpreter), "write": [workdir],
               "limits": {k: getattr(limits, k) for k in ("cpu_s", "memory_mib", "max_processes", "file_size_mib")}}
        start = time.perf_counter()
        proc = subprocess.Popen([os.path.realpath(sys.executable), "-I", "-S", "-c", _LAUNCHER, json.dumps(cfg)],
                                cwd=workdir, env={"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir},
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, close_fds=True)
        out: dict = {}
        readers = [threading.Thread(target=_drain, args=(s, limits.max_output_bytes, out, k), daemon=True)
                   for s, k in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))]
        for r in readers:
            r.start()
        try:
            proc.stdin.write(stdin.encode())
            proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        timed_out = False
        try:
            proc.wait(timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_group(proc.pid)  # also after a normal exit: no background child outlives the call
        proc.wait()
        for r in readers:
            r.join(timeout=5.0)
        duration = time.perf_counter() - start
        stderr = out.get("stderr", b"").decode(errors="replace")
        if proc.returncode == REFUSED_EXIT and stderr.startswith("sandbox refused:"):
            raise SandboxUnavailable(stderr.strip())
        sizes = {k: out.get(k + "_n", 0) for k in ("stdout", "stderr")}
        return SandboxResult(out.get("stdout", b"").decode(errors="replace"), stderr, proc.returncode, timed_out,
                             any(n > limits.max_output_bytes for n in sizes.values()), duration, sizes)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


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
