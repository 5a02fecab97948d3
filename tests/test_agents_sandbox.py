"""The code sandbox: every escape the issue names, each against a limit that could fail."""

import os
import socket
import subprocess
import sys
import threading

import pytest

from longrl.agents.sandbox import SandboxLimits, SandboxUnavailable, python, run_python


@pytest.fixture(scope="module")
def sandbox():
    try:
        run_python("pass")
    except SandboxUnavailable as e:
        pytest.skip(f"this OS cannot confine the sandbox (it refuses, as it should): {e}")


def test_runs_code_in_a_private_directory(sandbox):
    r = run_python("import os; open('a.txt', 'w').write('hi'); print(open('a.txt').read(), os.getcwd())")
    assert r.ok and r.stdout.split()[0] == "hi"
    workdir = r.stdout.split()[1]
    assert "longrl-sandbox-" in workdir and not os.path.exists(workdir)  # removed afterwards


def test_infinite_loop_hits_the_cpu_limit(sandbox):
    r = run_python("while True: pass", SandboxLimits(cpu_s=1, wall_s=20))
    assert not r.ok and r.exit_code < 0 and not r.timed_out and r.duration_s < 10


def test_sleeping_code_hits_the_wall_limit_and_its_group_dies(sandbox):
    code = "import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n" \
           "print('started', flush=True)\ntime.sleep(60)"
    r = run_python(code, SandboxLimits(wall_s=1.5))
    assert r.timed_out and "started" in r.stdout and r.duration_s < 10
    out = subprocess.run(["pgrep", "-f", "time.sleep\\(60\\)"], capture_output=True, text=True)
    assert out.stdout.strip() == ""  # the grandchild was killed with the group


def test_fork_bomb_is_contained(sandbox):
    code = "import os\nn = 0\nwhile True:\n    try:\n        os.fork(); n += 1\n    except OSError:\n        pass"
    r = run_python(code, SandboxLimits(wall_s=1.5, max_processes=16))
    assert r.timed_out or r.exit_code != 0
    assert subprocess.run(["pgrep", "-u", "65534" if os.geteuid() == 0 else str(os.getuid()), "-f", "main.py"],
                          capture_output=True, text=True).stdout.strip() == ""


def test_memory_hog_fails(sandbox):
    r = run_python("x = bytearray(1 << 31)\nprint('allocated')", SandboxLimits(memory_mib=256))
    assert not r.ok and "MemoryError" in r.stderr and "allocated" not in r.stdout


def test_no_network(sandbox):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    threading.Thread(target=lambda: server.accept(), daemon=True).start()
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=10)
    assert "connected" in plain.stdout  # the same code reaches the port outside the sandbox
    r = run_python(code)
    server.close()
    assert not r.ok and "connected" not in r.stdout and "OSError" in r.stderr


def test_no_writes_or_reads_outside_its_directory(sandbox, tmp_path):
    target = tmp_path / "outside.txt"
    os.chmod(tmp_path, 0o777)  # so that only the sandbox, not file permissions, stops the write
    r = run_python(f"open({str(target)!r}, 'w').write('x')")
    assert not r.ok and "PermissionError" in r.stderr and not target.exists()
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    os.chmod(secret, 0o644)
    r = run_python(f"print(open({str(secret)!r}).read())")
    assert not r.ok and "s3cret" not in r.stdout


def test_huge_output_is_truncated(sandbox):
    r = run_python("import sys\nfor _ in range(200): sys.stdout.write('y' * 100000)", SandboxLimits(max_output_bytes=1000))
    assert r.ok and r.output_truncated and len(r.stdout) == 1000 and r.output_bytes["stdout"] == 200 * 100000


def test_python_tool_reports_errors_as_text(sandbox):
    assert python("print(6 * 7)") == "42"
    text = python("raise ValueError('boom')")
    assert "ValueError: boom" in text and "[exit status 1]" in text
