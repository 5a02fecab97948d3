"""The sandbox's launcher: started as a script (``python -I -S -B sandbox_launcher.py CONFIG``) by
:mod:`longrl.agents.sandbox`, it confines itself and execs the code's interpreter. Standard library only; it
imports nothing of longrl. Three processes:

  P  this script as started (the caller's uid): enters new mount, PID, network, IPC and UTS namespaces (as root,
     directly; otherwise, or where root may not, inside a new user namespace), forks C, waits for it, and writes
     one JSON line to the report descriptor: {"exit": n} (the code's exit status, -signal when killed),
     {"stopped": true} (SIGTERM from the caller, its death, or the wall-time backstop) or {"refused": why}.
  C  PID 1 of the new PID namespace: builds the code's filesystem (a read-only tmpfs root holding read-only binds
     of the interpreter's trees, and /sandbox, a tmpfs capped at the disk quota), pivots into it, forks D, reaps
     every process and exits when D does. The kernel then kills whatever is left in the namespace, and P's wait
     returns only once all of it is gone.
  D  the code: drops to its uid, sets rlimits, no_new_privs, Landlock (files, TCP, abstract unix sockets,
     signals), a seccomp filter (no AF_UNIX sockets, no io_uring, no new namespaces), and execs python main.py.

A step that fails is a refusal naming the step and the OS's reason: the code never runs unconfined.
"""

import ctypes
import json
import os
import platform
import resource
import signal
import sys

CFG = json.loads(sys.argv[1]) if __name__ == "__main__" else {}
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
libc.unshare.argtypes = [ctypes.c_int]
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
CLONE_NEWCGROUP, CLONE_NEWTIME = 0x02000000, 0x00000080
NAMESPACES = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 1, 38, 22
SANDBOX_UID = 65534  # nobody: the code's uid under root

# (audit arch, pivot_root, socket, clone, unshare, setns) per machine; clone3 and io_uring are 435, 425-427 on both
ARCHES = {"x86_64": (0xC000003E, 155, 41, 56, 272, 308), "aarch64": (0xC00000B7, 41, 198, 220, 97, 268)}


class Refused(Exception):
    """A confinement step failed; the message names it and the OS's reason."""


def _check(ret: int, what: str) -> None:
    if ret < 0:
        raise Refused(f"{what}: {os.strerror(ctypes.get_errno())}")


def _arch():
    try:
        return ARCHES[platform.machine()]
    except KeyError:
        raise Refused(f"no seccomp filter for the {platform.machine()} architecture") from None


def _mount(source, target, fstype, flags, data, what):
    def enc(text):
        return None if text is None else text.encode()

    _check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), what)


# ------------------------------------------------------------------------------------------------ P: namespaces

def _mapped(kind: str, ident: int) -> bool:
    """Whether ``ident`` is mapped in this user namespace's /proc/self/{uid,gid}_map."""
    with open(f"/proc/self/{kind}_map") as f:
        return any(int(a) <= ident < int(a) + int(n) for a, _, n in (line.split() for line in f))


def enter_namespaces() -> dict:
    """New namespaces for the children; the code's (uid, gid) inside and whether it runs as real root's ``nobody``
    (``root``) or inside a new user namespace (``user``)."""
    euid, egid = os.geteuid(), os.getegid()
    reasons = []
    if euid == 0 and _mapped("uid", SANDBOX_UID) and _mapped("gid", SANDBOX_UID):
        if libc.unshare(NAMESPACES) == 0:
            return {"mode": "root", "uid": SANDBOX_UID, "gid": SANDBOX_UID}
        reasons.append(f"unshare as root: {os.strerror(ctypes.get_errno())}")
    if libc.unshare(NAMESPACES | CLONE_NEWUSER) != 0:
        reasons.append(f"unshare with a new user namespace: {os.strerror(ctypes.get_errno())}")
        raise Refused("no new namespaces (" + "; ".join(reasons) + ")")
    uid, gid = euid or SANDBOX_UID, egid or SANDBOX_UID  # never root inside: no capabilities after exec
    try:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {euid} 1"), ("gid_map", f"{gid} {egid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    except OSError as e:
        raise Refused(f"user namespace mapping: {e.strerror}") from None
    return {"mode": "user", "uid": uid, "gid": gid}


def parent() -> dict:
    state = {"child": None, "stopped": False}

    def stop(signum, frame):
        state["stopped"] = True
        if state["child"]:
            os.kill(state["child"], signal.SIGKILL)  # C is PID 1 of the namespace: everything in it dies

    for s in (signal.SIGTERM, signal.SIGALRM, signal.SIGHUP, signal.SIGINT):
        signal.signal(s, stop)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)  # the caller died: stop
    if os.getppid() != CFG["caller_pid"]:
        return {"stopped": True}
    signal.setitimer(signal.ITIMER_REAL, CFG["backstop_s"])
    ids = enter_namespaces()
    r, w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        os.close(r)
        init(w, ids)
    state["child"] = pid
    if state["stopped"]:
        os.kill(pid, signal.SIGKILL)
    os.close(w)
    os.waitpid(pid, 0)  # returns once C has exited, i.e. once its whole PID namespace is gone
    signal.setitimer(signal.ITIMER_REAL, 0)
    text = b""
    while chunk := os.read(r, 65536):
        text += chunk
    lines = text.decode(errors="replace").splitlines()
    refusals = [line[len("refused: "):] for line in lines if line.startswith("refused: ")]
    if refusals:
        raise Refused(refusals[0])
    if state["stopped"]:
        return {"stopped": True}
    exits = [int(line.split()[1]) for line in lines if line.startswith("exit ")]
    if not exits:
        raise Refused("the sandbox's init process ended without the code's status")
    return {"exit": exits[0]}


# ------------------------------------------------------------------------------------------------ C: the file tree

def _preserved_flags(path: str) -> int:
    """Mount flags of ``path``'s mount that a read-only remount must keep (a user namespace may not clear them)."""
    f = os.statvfs(path).f_flag
    pairs = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
             (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME))
    return sum(ms for st, ms in pairs if f & st)


def _bind_read_only(root: str, path: str) -> None:
    target = root + path
    os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
    if os.path.islink(path):  # /lib -> usr/lib: the link itself; its target is bound on its own
        os.symlink(os.readlink(path), target)
        return
    if os.path.isdir(path):
        os.makedirs(target, mode=0o755, exist_ok=True)
    else:
        open(target, "w").close()
    _mount(path, target, None, MS_BIND | MS_REC, None, f"bind {path}")
    _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | _preserved_flags(path), None,
           f"make {path} read-only")


def build_root(ids: dict) -> None:
    """The code's whole view of the filesystem: the read trees (read-only) and /sandbox (its quota'd tmpfs)."""
    root = CFG["root"]
    with open(CFG["code_path"], "rb") as f:
        code = f.read()
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None, "make the mounts private")
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=755", "mount the new root")
    for path in CFG["read"]:
        _bind_read_only(root, path)
    work = root + CFG["work"]
    os.mkdir(work, 0o700)
    lim = CFG["limits"]
    _mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={lim['disk_mib']}m,nr_inodes={lim['disk_files']},mode=700", "mount the work directory")
    os.chown(work, ids["uid"], ids["gid"])
    main = os.path.join(work, "main.py")
    with open(main, "wb") as f:
        f.write(code)
    os.chown(main, ids["uid"], ids["gid"])
    os.makedirs(root + "/dev", mode=0o755, exist_ok=True)
    os.symlink(CFG["work"], root + "/dev/shm")  # POSIX semaphores (multiprocessing) live in the quota'd directory
    _mount(None, root, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None, "make the root read-only")
    os.chdir(root)
    _check(libc.syscall(_arch()[1], b".", b"."), "pivot_root")
    _check(libc.umount2(b".", MNT_DETACH), "detach the old root")
    os.chdir("/")


def init(w: int, ids: dict) -> None:
    """C, PID 1 of the namespace (never returns)."""
    try:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        for s in signal.valid_signals():  # the code may signal PID 1: it ignores everything (SIGCHLD: to reap)
            if s not in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
                signal.signal(s, signal.SIG_IGN)
        build_root(ids)
        pid = os.fork()
        if pid == 0:
            run_code(w, ids)
        while True:  # orphans re-parent to PID 1: reap them all until the code's own process ends
            done, status = os.waitpid(-1, 0)
            if done == pid:
                os.write(w, f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
                os._exit(0)
    except Refused as e:
        os.write(w, f"refused: {e}\n".encode())
    except BaseException as e:  # noqa: BLE001 - reported as a refusal, never run unconfined
        os.write(w, f"refused: sandbox init failed: {type(e).__name__}: {e}\n".encode())
    os._exit(1)


# ------------------------------------------------------------------------------------------------ D: the code

LL_EXECUTE, LL_WRITE_FILE, LL_READ_FILE, LL_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
LL_TRUNCATE, LL_IOCTL_DEV = 1 << 14, 1 << 15
LL_FILE_RIGHTS = LL_EXECUTE | LL_WRITE_FILE | LL_READ_FILE | LL_TRUNCATE | LL_IOCTL_DEV  # what a file rule may hold
LL_NET_BIND_TCP, LL_NET_CONNECT_TCP = 1 << 0, 1 << 1
LL_SCOPE_ABSTRACT_UNIX, LL_SCOPE_SIGNAL = 1 << 0, 1 << 1


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed", ctypes.c_uint64), ("fd", ctypes.c_int32)]


def landlock(read: list[str], write: list[str], read_write_files: list[str]) -> None:
    """Files: read (and execute) only under ``read``, anything only under ``write``; no TCP bind or connect
    (ABI ≥ 4); no abstract unix socket or signal out of the sandbox (ABI ≥ 6)."""
    abi = libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    if abi < 1:
        raise Refused(f"no Landlock filesystem confinement ({os.strerror(ctypes.get_errno())})")
    fs = (1 << 13) - 1 | (1 << 13 if abi >= 2 else 0) | (LL_TRUNCATE if abi >= 3 else 0) | \
        (LL_IOCTL_DEV if abi >= 5 else 0)
    attr = _RulesetAttr(fs, LL_NET_BIND_TCP | LL_NET_CONNECT_TCP if abi >= 4 else 0,
                        LL_SCOPE_ABSTRACT_UNIX | LL_SCOPE_SIGNAL if abi >= 6 else 0)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    fd = libc.syscall(444, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    _check(fd, "landlock_create_ruleset")
    rules = [(p, LL_EXECUTE | LL_READ_FILE | LL_READ_DIR) for p in read]
    rules += [(p, LL_READ_FILE | LL_WRITE_FILE) for p in read_write_files] + [(p, fs) for p in write]
    for path, access in rules:
        pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        rule = _PathBeneath(access if os.path.isdir(path) else access & LL_FILE_RIGHTS & fs, pfd)
        _check(libc.syscall(445, fd, 1, ctypes.byref(rule), ctypes.c_uint32(0)), f"landlock_add_rule {path}")
        os.close(pfd)
    _check(libc.syscall(446, fd, ctypes.c_uint32(0)), "landlock_restrict_self")
    os.close(fd)


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def seccomp_program() -> list[tuple[int, int, int, int]]:
    """The filter (classic BPF over struct seccomp_data: nr at 0, arch at 4, args[0] at 16):
    another architecture's calls kill the process; x32 calls, clone3 → ENOSYS (libc falls back to clone);
    socket(AF_UNIX, ...) → EACCES; clone with a namespace flag, unshare, setns, io_uring_* → EPERM."""
    arch, _, sys_socket, sys_clone, sys_unshare, sys_setns = _arch()
    def ld(k):  # BPF_LD|BPF_W|BPF_ABS: the 32-bit word at offset k
        return 0x20, 0, 0, k

    def jeq(k, jt, jf):  # BPF_JMP|BPF_JEQ|BPF_K: skip jt instructions if equal, else jf
        return 0x15, jt, jf, k

    def ret(k):  # BPF_RET|BPF_K
        return 0x06, 0, 0, k

    allow, kill = 0x7FFF0000, 0x80000000
    eperm, eacces, enosys = (0x00050000 | e for e in (1, 13, 38))  # SECCOMP_RET_ERRNO
    ns_flags = CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET | \
        CLONE_NEWCGROUP | CLONE_NEWTIME
    prog = [ld(4), jeq(arch, 1, 0), ret(kill), ld(0)]
    if platform.machine() == "x86_64":
        prog += [(0x35, 0, 1, 0x40000000), ret(enosys)]  # BPF_JGE: the x32 ABI's numbers
    for nr, action in ((435, enosys), (sys_unshare, eperm), (sys_setns, eperm), (425, eperm), (426, eperm),
                       (427, eperm)):
        prog += [jeq(nr, 0, 1), ret(action)]
    prog += [jeq(sys_socket, 0, 4), ld(16), jeq(1, 0, 1), ret(eacces), ret(allow)]  # AF_UNIX = 1
    prog += [jeq(sys_clone, 0, 4), ld(16), (0x45, 0, 1, ns_flags), ret(eperm), ret(allow)]  # BPF_JSET
    return prog + [ret(allow)]


def seccomp() -> None:
    prog = seccomp_program()
    filters = (_SockFilter * len(prog))(*[_SockFilter(*ins) for ins in prog])
    fprog = _SockFprog(len(prog), filters)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    _check(libc.prctl(PR_SET_SECCOMP, 2, ctypes.addressof(fprog), 0, 0), "seccomp filter")


def run_code(w: int, ids: dict) -> None:
    """D: confine this process and exec the code (never returns)."""
    try:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        for s in signal.valid_signals():  # C ignores signals; ignored dispositions would survive exec
            if s not in (signal.SIGKILL, signal.SIGSTOP):
                signal.signal(s, signal.SIG_DFL)
        os.chdir(CFG["work"])
        if ids["mode"] == "root":
            os.setgroups([])
        os.setresgid(ids["gid"], ids["gid"], ids["gid"])
        os.setresuid(ids["uid"], ids["uid"], ids["uid"])
        lim = CFG["limits"]
        for res, value in ((resource.RLIMIT_CPU, lim["cpu_s"]), (resource.RLIMIT_AS, lim["memory_mib"] << 20),
                           (resource.RLIMIT_NPROC, lim["max_processes"]),
                           (resource.RLIMIT_FSIZE, lim["file_size_mib"] << 20), (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(res, (value, value))
        _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
        landlock([p for p in CFG["read"] if p not in CFG["read_write_files"]], [CFG["work"]],
                 CFG["read_write_files"])
        seccomp()
        python = CFG["python"]
        os.execve(python, [python, "-I", "-S", "-B", "main.py"],
                  {"PATH": "/usr/bin:/bin", "HOME": CFG["work"], "TMPDIR": CFG["work"]})
    except Refused as e:
        os.write(w, f"refused: {e}\n".encode())
    except BaseException as e:  # noqa: BLE001 - reported as a refusal, never run unconfined
        os.write(w, f"refused: sandbox setup failed: {type(e).__name__}: {e}\n".encode())
    os._exit(97)


def main() -> None:
    try:
        result = parent()
    except Refused as e:
        result = {"refused": str(e)}
    except BaseException as e:  # noqa: BLE001
        result = {"refused": f"sandbox launcher failed: {type(e).__name__}: {e}"}
    os.write(CFG["report_fd"], (json.dumps(result) + "\n").encode())
    os._exit(0)


if __name__ == "__main__":
    main()
