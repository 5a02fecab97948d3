"""The code sandbox: each line of docs/agents.md's "Running model-written code" and each escape issue 41 lists, run
against the sandbox and asserted blocked (each with a control showing the same code succeeds outside, where that
makes sense). Where the OS cannot confine, the module skips with the sandbox's own reason."""

import ast
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from longrl.agents import sandbox as sandbox_module
from longrl.agents.sandbox import SandboxLimits, SandboxUnavailable, python, run_python
from longrl.agents.sandbox_launcher import seccomp_program

SANDBOX_PY = Path(sandbox_module.__file__)


@pytest.fixture(scope="module")
def sandbox():
    try:
        run_python("pass")
    except SandboxUnavailable as e:
        pytest.skip(f"this OS cannot confine the sandbox (it refuses, as it should): {e}")


def _code_processes() -> list[int]:
    """Host pids of every sandboxed code process now running (their command line ends in ``-I -S -B main.py``)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "cmdline").read_bytes().endswith(b"-I\0-S\0-B\0main.py\0"):
                pids.append(int(entry.name))
        except OSError:
            pass
    return pids


def _code_running(marker: str) -> list[int]:
    """Host pids of the sandboxed code processes whose main.py holds ``marker`` (not other callers' sandboxes)."""
    return [pid for pid in _code_processes() if marker.encode() in _main_py_of(pid)]


def _alive_with(marker: str) -> list[str]:
    """Command lines of processes running anywhere on the host that contain ``marker``."""
    out = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True, check=False).stdout
    return [line for line in out.splitlines() if line.strip()]


def _wait_until(predicate, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


# ------------------------------------------------------------------------------------------ runs, and cleans up

def test_runs_code_in_a_private_directory_removed_afterwards(sandbox):
    before = set(Path(tempfile.gettempdir()).glob("longrl-sandbox-*"))
    r = run_python("import os; open('a.txt', 'w').write('hi'); print(open('a.txt').read(), os.getcwd())")
    assert r.ok and r.stdout.split() == ["hi", "/sandbox"]
    assert set(Path(tempfile.gettempdir()).glob("longrl-sandbox-*")) == before  # its host directory is removed


def test_stdlib_subprocesses_and_multiprocessing_work_inside(sandbox):
    code = textwrap.dedent("""
        import multiprocessing, subprocess, sys
        print(subprocess.run([sys.executable, '-c', 'print(5)'], capture_output=True, text=True).stdout.strip())
        if __name__ == '__main__':
            with multiprocessing.get_context('fork').Pool(2) as pool:
                print(pool.map(abs, [-1, -2]))
    """)
    r = run_python(code)
    assert r.ok, r.stderr
    assert r.stdout.split("\n")[:2] == ["5", "[1, 2]"]


def test_python_tool_reports_errors_as_text(sandbox):
    assert python("print(6 * 7)") == "42"
    text = python("raise ValueError('boom')")
    assert "ValueError: boom" in text and "[exit status 1]" in text


def test_limits_are_checked():
    with pytest.raises(ValueError, match="SandboxLimits.disk_mib"):
        SandboxLimits(disk_mib=0)
    with pytest.raises(ValueError, match="SandboxLimits.wall_s"):
        SandboxLimits(wall_s=float("nan"))


# ------------------------------------------------------------------------------------ nothing outlives the call

def test_background_processes_die_with_the_call_and_its_output_is_returned(sandbox):
    """The issue's case: a ``setsid`` daemon (and a double-forked one) holding stdout open; the code printed and
    exited. The call ends when the code does, returns what it printed, and leaves no process behind."""
    marker = "longrl-daemon-7c1f"
    code = textwrap.dedent(f"""
        import os, subprocess, sys
        print('printed before exiting', flush=True)
        subprocess.Popen([sys.executable, '-c', 'import os, time; os.setsid(); time.sleep(60)', '{marker}'],
                         start_new_session=True)
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', '{marker}'])
            os._exit(0)
    """)
    r = run_python(code, SandboxLimits(wall_s=30))
    assert r.ok and not r.timed_out, r.stderr  # ended by the code's exit, not by the wall limit
    assert r.stdout == "printed before exiting\n"
    assert _alive_with(marker) == []


def test_wall_limit_keeps_the_output_and_kills_every_process(sandbox):
    marker = "longrl-sleeper-4b2e"
    code = textwrap.dedent(f"""
        import subprocess, sys, time
        subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', '{marker}'], start_new_session=True)
        print('started', flush=True)
        time.sleep(60)
    """)
    r = run_python(code, SandboxLimits(wall_s=1.5))
    assert r.timed_out and r.exit_code is None and r.stdout == "started\n"
    assert _alive_with(marker) == []


def test_the_sandbox_stops_when_its_caller_dies(sandbox, tmp_path):
    marker = "longrl-orphan-91d0"
    caller = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        from longrl.agents.sandbox import SandboxLimits, run_python
        run_python("import time\\nprint('x', flush=True)\\ntime.sleep(60) # {marker}", SandboxLimits(wall_s=60))
    """)], env={**os.environ, "TMPDIR": str(tmp_path)})  # (a killed caller cannot remove its temporary directory)
    try:
        assert _wait_until(lambda: _code_running(marker) != []), "the sandboxed code never started"
        caller.kill()
        caller.wait()
        assert _wait_until(lambda: _code_running(marker) == [])
    finally:
        caller.kill()


def _main_py_of(pid: int) -> bytes:
    """The code a sandboxed process runs (its /sandbox/main.py, through /proc/PID/root)."""
    try:
        return Path(f"/proc/{pid}/root/sandbox/main.py").read_bytes()
    except OSError:
        return b""


# ------------------------------------------------------------------------------------------- no one to signal

def test_code_cannot_signal_or_trace_its_caller(sandbox):
    """The issue's case: the code SIGKILLs the process that called it. A caller process runs code that kills it
    (by pid, by every pid it may signal with -1, and PID 1), then says it is alive."""
    attack = textwrap.dedent("""
        import ctypes, os, signal
        libc = ctypes.CDLL(None, use_errno=True)
        results = []
        for target in (CALLER, -1, 1, os.getppid() or 1):
            try:
                os.kill(target, signal.SIGKILL)
                results.append('sent')
            except OSError as e:
                results.append(type(e).__name__)
        results.append(libc.ptrace(16, CALLER, 0, 0))  # PTRACE_ATTACH
        results.append(libc.ptrace(16, 1, 0, 0))
        print(results)
    """)
    caller = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import os
        from longrl.agents.sandbox import run_python
        r = run_python({attack!r}.replace('CALLER', str(os.getpid())))
        print('caller alive;', r.stdout.strip(), r.stderr.strip()[-300:])
    """)], capture_output=True, text=True, timeout=120, check=False)
    assert caller.returncode == 0, caller.stderr
    assert caller.stdout.startswith("caller alive;"), caller.stdout
    results = ast.literal_eval(caller.stdout.split(";", 1)[1].strip().splitlines()[0])
    assert results[0] == "ProcessLookupError"  # the caller's pid does not exist in the sandbox
    assert results[4:] == [-1, -1]  # ptrace refused


def test_code_cannot_signal_another_sandbox(sandbox):
    """The issue's case (as root, the code could kill any process of the sandbox user): sandbox B signals sandbox
    A's processes by their host pids, every pid it may signal, and PID 1; A runs on to its end."""
    results = {}
    victim = threading.Thread(target=lambda: results.update(a=run_python(
        "import time\nprint('A started', flush=True)\ntime.sleep(3)\nprint('A done')  # victim-3a1f",
        SandboxLimits(wall_s=30))))
    victim.start()
    try:
        assert _wait_until(lambda: _code_running("victim-3a1f") != [])
        targets = _code_running("victim-3a1f")
        r = run_python(textwrap.dedent(f"""
            import os
            for pid in {targets} + [-1, 1]:
                try:
                    os.kill(pid, 9)
                except OSError:
                    pass
            print('B done')
        """))
    finally:
        victim.join()
    assert results["a"].ok and results["a"].stdout == "A started\nA done\n"
    assert r.ok or r.exit_code == -9  # (B may only have killed itself, where A's host pid is a pid of B's)


# ------------------------------------------------------------------------------------------------ no network

def test_no_network_tcp_udp_or_abstract_unix(sandbox):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind(f"\0longrl-sandbox-test-{os.getpid()}")
    abstract.listen(1)
    code = textwrap.dedent(f"""
        import socket
        for name, connect in (
                ('tcp', lambda: socket.create_connection(('127.0.0.1', {port}), timeout=2)),
                ('udp', lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', {port}))),
                ('abstract', lambda: socket.socket(socket.AF_UNIX).connect('\\0longrl-sandbox-test-{os.getpid()}'))):
            try:
                connect()
                print(name, 'connected')
            except OSError as e:
                print(name, 'refused', e.errno)
    """)
    try:
        plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=False)
        assert "tcp connected" in plain.stdout and "abstract connected" in plain.stdout  # reachable outside
        r = run_python(code)
    finally:
        server.close()
        abstract.close()
    assert r.ok and "connected" not in r.stdout and r.stdout.count("refused") == 3, r.stdout + r.stderr


def test_no_pathname_unix_socket(sandbox, tmp_path):
    """The issue's case: a listener on the host received a message through a pathname unix socket."""
    path = tmp_path / "host.sock"
    os.chmod(tmp_path, 0o777)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    os.chmod(path, 0o777)
    listener.listen(1)
    received = []

    def serve():
        listener.settimeout(15)
        try:
            conn, _ = listener.accept()
            received.append(conn.recv(100))
            conn.close()
        except OSError:
            pass

    code = f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({str(path)!r})\ns.sendall(b'escaped')"
    try:
        threading.Thread(target=serve, daemon=True).start()
        subprocess.run([sys.executable, "-c", code], check=True, timeout=30)  # the control reaches it
        assert _wait_until(lambda: received == [b"escaped"], 10)
        received.clear()
        threading.Thread(target=serve, daemon=True).start()
        r = run_python(code)
        own = run_python("import socket\ns = socket.socket(socket.AF_UNIX)\ns.bind('/sandbox/own.sock')")
    finally:
        listener.close()
    assert not r.ok and "PermissionError" in r.stderr and received == []
    assert not own.ok and "PermissionError" in own.stderr  # no unix socket of its own either


# ---------------------------------------------------------------------------------------------- the filesystem

def test_no_reads_stat_or_writes_outside_its_trees(sandbox, tmp_path):
    os.chmod(tmp_path, 0o777)
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    os.chmod(secret, 0o644)
    target = tmp_path / "outside.txt"
    attempts = textwrap.dedent(f"""
        ('read', lambda: open({str(secret)!r}).read()),
        ('stat', lambda: os.stat({str(secret)!r})),
        ('stat-dir', lambda: os.stat({str(tmp_path)!r})),
        ('stat-project', lambda: os.stat({os.getcwd()!r})),
        ('write', lambda: open({str(target)!r}, 'w').write('x')),
        ('proc', lambda: open('/proc/1/environ').read()),
    """)
    inside_only = "('write-lib', lambda: open('/usr/lib/longrl-planted', 'w').write('x')),"  # (not run outside)
    code = "import os\nfor name, attempt in [{}]:\n    try:\n        print(name, 'ok', attempt())\n" \
           "    except OSError as e:\n        print(name, 'blocked', type(e).__name__)"
    plain = subprocess.run([sys.executable, "-c", code.format(attempts)], capture_output=True, text=True,
                           timeout=30, check=False)
    assert "read ok s3cret" in plain.stdout and "stat ok" in plain.stdout  # readable outside the sandbox
    target.unlink(missing_ok=True)
    r = run_python(code.format(attempts + inside_only))
    assert r.ok, r.stderr
    assert "s3cret" not in r.stdout and " ok " not in r.stdout and r.stdout.count("blocked") == 7, r.stdout
    assert not target.exists() and not Path("/usr/lib/longrl-planted").exists()


def test_total_disk_quota_and_file_size_limit(sandbox):
    """The issue's case: 180 MiB in 12 files (each under the per-file limit) was accepted. The directory's total is
    capped (ENOSPC: 12 files of 6 MiB, each under the 8 MiB file limit, against 32 MiB), as is each file (EFBIG)."""
    code = textwrap.dedent("""
        import errno
        written = 0
        try:
            for i in range(12):
                with open(f'f{i}', 'wb') as f:
                    for _ in range(6):
                        f.write(b'x' * (1 << 20))
                        f.flush()
                        written += 1
        except OSError as e:
            print('total stopped at', written, errno.errorcode[e.errno])
        try:
            open('big', 'wb').write(b'x' * (9 << 20))
        except OSError as e:
            print('file stopped', errno.errorcode[e.errno])
    """)
    r = run_python(code, SandboxLimits(disk_mib=32, file_size_mib=8))
    assert r.ok, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("total stopped at") and lines[0].endswith("ENOSPC")
    assert int(lines[0].split()[3]) <= 32
    assert lines[1] in ("file stopped EFBIG", "file stopped ENOSPC")


def test_too_many_files_is_refused(sandbox):
    code = "import errno\nn = 0\ntry:\n    while True:\n        open(f'f{n}', 'w').close(); n += 1\n" \
           "except OSError as e:\n    print(n, errno.errorcode[e.errno])"
    r = run_python(code, SandboxLimits(disk_files=64))
    assert r.ok and r.stdout.split()[1] == "ENOSPC" and int(r.stdout.split()[0]) < 64


# --------------------------------------------------------------------------------------------- system calls

def test_no_new_namespaces_or_io_uring(sandbox):
    code = textwrap.dedent("""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        print(libc.unshare(0x10000000), ctypes.get_errno())  # CLONE_NEWUSER
        print(libc.syscall(425, 8, ctypes.create_string_buffer(120)), ctypes.get_errno())  # io_uring_setup
    """)
    r = run_python(code)
    assert r.ok and r.stdout.split() == ["-1", "1", "-1", "1"], r.stdout + r.stderr


def test_seccomp_program_jumps_stay_inside_it():
    prog = seccomp_program()
    assert prog[-1] == (0x06, 0, 0, 0x7FFF0000)  # ends by allowing
    for i, (code, jt, jf, _) in enumerate(prog):
        if code & 0x07 == 0x05:  # a jump: both targets inside the program
            assert i + 1 + max(jt, jf) < len(prog)


# ----------------------------------------------------------------------------------------------- resource limits

def test_infinite_loop_hits_the_cpu_limit(sandbox):
    r = run_python("while True: pass", SandboxLimits(cpu_s=1, wall_s=60))
    assert not r.ok and r.exit_code < 0 and not r.timed_out


def test_fork_bomb_is_contained(sandbox):
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass  # bomb-77c2"
    r = run_python(code, SandboxLimits(wall_s=1.5, max_processes=16))
    assert r.timed_out or r.exit_code != 0
    assert _code_running("bomb-77c2") == []


def test_memory_hog_fails(sandbox):
    r = run_python("x = bytearray(1 << 31)\nprint('allocated')", SandboxLimits(memory_mib=256))
    assert not r.ok and "MemoryError" in r.stderr and "allocated" not in r.stdout


def test_unread_stdin_does_not_hold_the_call(sandbox):
    r = run_python("print('ignored stdin')", stdin="x" * (4 << 20))
    assert r.ok and r.stdout == "ignored stdin\n"
    assert run_python("import sys\nprint(len(sys.stdin.read()))", stdin="abc").stdout == "3\n"


def test_huge_output_is_truncated(sandbox):
    r = run_python("import sys\nfor _ in range(200): sys.stdout.write('y' * 100000)",
                   SandboxLimits(max_output_bytes=1000))
    assert r.ok and r.output_truncated and len(r.stdout) == 1000 and r.output_bytes["stdout"] == 200 * 100000


# ------------------------------------------------------------------ another user, root in a user namespace, refusals

NONROOT_SCRIPT = textwrap.dedent("""
    import importlib.util, json, os, sys
    spec = importlib.util.spec_from_file_location("sbx", sys.argv[1])
    sbx = importlib.util.module_from_spec(spec)
    sys.modules["sbx"] = sbx
    spec.loader.exec_module(sbx)
    out = {"euid": os.geteuid()}
    try:
        r = sbx.run_python("import os\\nprint(os.getuid())\\nos.kill(%d, 9)" % os.getpid())
        out["kill"] = r.stderr.strip().splitlines()[-1]
        r = sbx.run_python("import os\\nos.stat(%r)" % sys.argv[1])
        out["stat"] = r.stderr.strip().splitlines()[-1]
        r = sbx.run_python("import subprocess, sys\\nprint('hi', flush=True)\\n"
                           "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', 'longrl-nr-5e'],"
                           " start_new_session=True)")
        out["daemon_stdout"] = r.stdout
        out["written"] = sbx.run_python("n = 0\\ntry:\\n    while True:\\n        open('f%d' % n, 'wb')"
                                        ".write(bytes(8 << 20)); n += 1\\nexcept OSError:\\n    print(n * 8)",
                                        sbx.SandboxLimits(disk_mib=40)).stdout.strip()
    except sbx.SandboxUnavailable as e:
        out["unavailable"] = str(e)
    except OSError as e:
        out["oserror"] = repr(e)
    print(json.dumps(out))
""")


def _as_nobody(*prefix: str, shell: str | None = None) -> dict:
    """NONROOT_SCRIPT's findings, run by the system python3 as user nobody (``prefix``: a command around it)."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root (to run as another user) and setpriv")
    system_python = shutil.which("python3", path="/usr/bin:/bin")
    if not system_python or os.stat(os.path.realpath(system_python)).st_mode & 0o005 != 0o005:
        pytest.skip("needs a python3 that user nobody may run")
    if not all(os.stat(d).st_mode & 0o001 for d in [*SANDBOX_PY.parents]) or not os.stat(SANDBOX_PY).st_mode & 0o004:
        pytest.skip(f"user nobody may not read {SANDBOX_PY}")
    run = [system_python, "-c", NONROOT_SCRIPT, str(SANDBOX_PY)]
    cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *prefix,
           *(["sh", "-c", f"{shell} && exec \"$@\"", "sh"] if shell else []), *run]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd="/", check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_as_a_non_root_user_the_escapes_are_blocked(sandbox):
    """The issue's case: as a non-root user the code could SIGKILL the calling process."""
    got = _as_nobody()
    assert "unavailable" not in got, got
    assert got["kill"].startswith("ProcessLookupError")  # the caller lives (it printed the JSON)
    assert got["stat"].startswith("FileNotFoundError")
    assert got["daemon_stdout"] == "hi\n" and _alive_with("longrl-nr-5e") == []
    assert int(got["written"]) <= 40


def test_root_in_a_user_namespace_runs_confined_or_refuses_cleanly(sandbox):
    """The issue's case: under rootless root (uid 0 of a user namespace where nobody is not mapped) the refusal was
    a raw OSError. Here the sandbox nests its own user namespace and runs; where it cannot it must refuse."""
    if not shutil.which("unshare"):
        pytest.skip("needs unshare(1)")
    got = _as_nobody("unshare", "--user", "--map-root-user")
    assert got["euid"] == 0 and "oserror" not in got, got
    if "unavailable" not in got:
        assert got["kill"].startswith("ProcessLookupError") and got["stat"].startswith("FileNotFoundError")
        assert int(got["written"]) <= 40


def test_without_user_namespaces_it_refuses_with_the_reason(sandbox):
    """A user namespace whose children may not create user namespaces (user.max_user_namespaces=0 there, set
    inside it only): run_python raises SandboxUnavailable naming the step and the OS's reason."""
    if not shutil.which("unshare"):
        pytest.skip("needs unshare(1)")
    got = _as_nobody("unshare", "--user", "--map-root-user",
                     shell="echo 0 > /proc/sys/user/max_user_namespaces")
    assert "oserror" not in got and "unavailable" in got, got
    assert "new user namespace" in got["unavailable"] and "No space left on device" in got["unavailable"]


def test_an_unusable_temporary_directory_is_a_refusal(sandbox, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))
    with pytest.raises(SandboxUnavailable, match="temporary directory"):
        run_python("print(1)")
