"""Kernel confinement for the code sandbox's child process: Landlock, a private user, mount and network namespace
with a size-limited tmpfs as its directory, a seccomp filter without sockets, no-new-privileges, no capabilities.

The sandbox's child (``python -I -S``, where grpo_fast is not importable) imports this file as a top-level module
(see ``_child.py``), so it uses the standard library only, and at import time defines constants and
functions and nothing else.

Landlock (Linux >= 5.13) is asked only for the access rights the running kernel's ABI knows, as the kernel
documentation's best-effort example does: file-system rights from ABI 1 (refer: 2, truncate: 3, device ioctl: 5),
TCP bind and connect from ABI 4, signal and abstract-unix-socket scoping from ABI 6. Struct layouts
(``include/uapi/linux/landlock.h``): ``landlock_ruleset_attr {u64 handled_access_fs, handled_access_net, scoped}``,
``landlock_path_beneath_attr {u64 allowed_access; s32 parent_fd}`` packed.
"""

import ctypes
import errno
import os
import struct

# Landlock's syscall numbers are the same on x86_64, aarch64 and every architecture on the unified syscall table.
_SYS_LANDLOCK_CREATE_RULESET, _SYS_LANDLOCK_ADD_RULE, _SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
_LANDLOCK_CREATE_RULESET_VERSION = 1
_LANDLOCK_RULE_PATH_BENEATH = 1

# LANDLOCK_ACCESS_FS_*
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_REMOVE_DIR, FS_REMOVE_FILE, FS_MAKE_CHAR, FS_MAKE_DIR = 1 << 4, 1 << 5, 1 << 6, 1 << 7
FS_MAKE_REG, FS_MAKE_SOCK, FS_MAKE_FIFO, FS_MAKE_BLOCK, FS_MAKE_SYM = 1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1  # LANDLOCK_ACCESS_NET_*
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1  # LANDLOCK_SCOPE_*

# ABI -> the file-system rights it added
_FS_RIGHTS_BY_ABI = {1: (1 << 13) - 1, 2: FS_REFER, 3: FS_TRUNCATE, 5: FS_IOCTL_DEV}
_FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV  # those a rule on a file takes
_READ = FS_READ_FILE | FS_READ_DIR
# the sandbox's own directory: everything but executing and making device nodes
_WRITE = (_READ | FS_WRITE_FILE | FS_REMOVE_DIR | FS_REMOVE_FILE | FS_MAKE_DIR | FS_MAKE_REG | FS_MAKE_SOCK
          | FS_MAKE_FIFO | FS_MAKE_SYM | FS_REFER | FS_TRUNCATE)

# The system directories the interpreter's C extensions load shared libraries from, and the few files it or libc
# reads; the interpreter's own (its sys.path, its prefixes' lib directories) are added by the caller.
SYSTEM_READ_PATHS = ("/lib", "/lib32", "/lib64", "/usr/lib", "/usr/lib32", "/usr/lib64", "/usr/local/lib",
                     "/etc/ld.so.cache", "/etc/localtime", "/usr/share/zoneinfo", "/dev/urandom", "/dev/random",
                     "/dev/zero")
DEVICE_READ_WRITE_PATHS = ("/dev/null",)

_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REC, _MS_PRIVATE = 0x2, 0x4, 0x8, 0x4000, 0x40000
_PR_SET_NO_NEW_PRIVS = 38
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _check(result: int, what: str) -> int:
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")
    return result


def abi_version() -> int:
    """The Landlock ABI version the running kernel offers; 0 where it has none (or it is disabled at boot)."""
    try:
        libc = _libc()
    except OSError:
        return 0
    version = libc.syscall(_SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0),
                           ctypes.c_uint32(_LANDLOCK_CREATE_RULESET_VERSION))
    return max(int(version), 0)


def handled_rights(abi: int) -> tuple[int, int, int]:
    """``(handled_access_fs, handled_access_net, scoped)``: every right the given ABI knows."""
    fs = 0
    for level, rights in _FS_RIGHTS_BY_ABI.items():
        if abi >= level:
            fs |= rights
    net = NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0
    return fs, net, scoped


def restrict(read_paths: list[str], write_paths: list[str], device_paths: list[str]) -> int:
    """Confine this process and its future children with Landlock; returns the ABI used (0: no Landlock here).

    Reading is allowed under ``read_paths``, reading and writing (creating, removing, renaming, linking) under
    ``write_paths``, reading and writing the device files ``device_paths``; nothing executes, every TCP bind and
    connect is refused (ABI >= 4), and signals and abstract unix sockets cannot reach outside the sandbox
    (ABI >= 6). Paths that do not exist are skipped. Needs no-new-privileges (:func:`no_new_privileges`) first.
    """
    abi = abi_version()
    if abi == 0:
        return 0
    libc = _libc()
    fs, net, scoped = handled_rights(abi)
    attr = struct.pack("=QQQ", fs, net, scoped)
    size = 8 if abi < 4 else 16 if abi < 6 else 24  # the struct as the kernel of that ABI knows it
    ruleset = libc.syscall(_SYS_LANDLOCK_CREATE_RULESET, attr, ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0 and ctypes.get_errno() == errno.EINVAL and scoped:
        # some vendor kernels claim ABI 6 without the scopes: keep the rest rather than run without Landlock
        ruleset = libc.syscall(_SYS_LANDLOCK_CREATE_RULESET, attr[:16], ctypes.c_size_t(16), ctypes.c_uint32(0))
    ruleset = _check(ruleset, "landlock_create_ruleset")
    try:
        for paths, rights in ((read_paths, _READ), (write_paths, _WRITE),
                              (device_paths, FS_READ_FILE | FS_WRITE_FILE | FS_TRUNCATE)):
            for path in paths:
                _add_path_rule(libc, ruleset, path, rights & fs)
        # TCP ports get no rule: with the net rights handled, every bind and connect is refused
        _check(libc.syscall(_SYS_LANDLOCK_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)), "landlock_restrict_self")
    finally:
        os.close(ruleset)
    return abi


def _add_path_rule(libc: ctypes.CDLL, ruleset: int, path: str, rights: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        if not os.path.isdir(path):
            rights &= _FILE_RIGHTS  # the kernel refuses directory rights on a file
        rule = struct.pack("=Qi", rights, fd)  # landlock_path_beneath_attr is packed: 12 bytes
        _check(libc.syscall(_SYS_LANDLOCK_ADD_RULE, ruleset, ctypes.c_int(_LANDLOCK_RULE_PATH_BENEATH), rule,
                            ctypes.c_uint32(0)), f"landlock_add_rule({path!r})")
    finally:
        os.close(fd)


def no_new_privileges() -> None:
    """``prctl(PR_SET_NO_NEW_PRIVS)``: no exec can grant privileges again (set-uid bits, file capabilities)."""
    _check(_libc().prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


def drop_capabilities() -> None:
    """Clear the effective, permitted and inheritable capability sets (the ambient set follows)."""
    header = struct.pack("=Ii", _LINUX_CAPABILITY_VERSION_3, 0)
    data = bytes(24)  # two __user_cap_data_struct {u32 effective, permitted, inheritable}, all zero
    _check(_libc().capset(header, data), "capset")


# seccomp: struct seccomp_data {int nr; u32 arch; ...}; classic BPF opcodes; native architectures and the numbers of
# socket(2) there (io_uring_setup is 425 on both)
_AUDIT_ARCH_SOCKET = {"x86_64": (0xC000003E, 41), "aarch64": (0xC00000B7, 198)}
_SYS_IO_URING_SETUP = 425
# System calls that change a file's metadata: Landlock (up to ABI 7) has no access right for them, and the uid maps to
# itself in the user namespace, so a process run as a file's owner (root, often) could chmod, chown, touch or set
# extended attributes on files anywhere. Nothing a test of model-written code needs. Per architecture (x86_64 has the
# legacy chmod/chown/utime calls; aarch64 only the *at forms): chmod family, chown family, utime family, xattr setters
# and removers (also the 6.13 *xattrat calls), file_setattr (6.17).
_METADATA_SYSCALLS = {
    "x86_64": (90, 91, 268, 452, 92, 93, 94, 260, 132, 235, 261, 280, 188, 189, 190, 197, 198, 199, 463, 466, 469),
    "aarch64": (52, 53, 452, 55, 54, 88, 5, 6, 7, 14, 15, 16, 463, 466, 469),
}
_X32_SYSCALL_BIT = 0x40000000
_BPF_LD_W_ABS, _BPF_JEQ_K, _BPF_JGE_K, _BPF_RET_K = 0x20, 0x15, 0x35, 0x06
_SECCOMP_RET_ALLOW, _SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2


def deny_sockets() -> bool:
    """A seccomp filter that fails with ``EACCES``: ``socket(2)`` and ``io_uring_setup(2)`` (``socketpair(2)``, which
    asyncio needs, stays allowed), the system calls that change file metadata (``_METADATA_SYSCALLS``: chmod, chown,
    utime, xattr), and every system call of a foreign ABI (i386 through ``int 0x80``, x32). Landlock (up to ABI 7)
    covers none of these: not connecting to a named unix socket (a Docker or D-Bus socket), not UDP, not metadata;
    without ``socket(2)`` no socket reaches anything. False on other architectures and on kernels without seccomp
    filters. Needs no-new-privileges.
    """
    machine = os.uname().machine
    arch = _AUDIT_ARCH_SOCKET.get(machine)
    if arch is None:
        return False
    audit_arch, sys_socket = arch
    denied = (sys_socket, _SYS_IO_URING_SETUP, *_METADATA_SYSCALLS[machine])
    n = len(denied)
    deny = _SECCOMP_RET_ERRNO | errno.EACCES
    program = [  # (code, jump if true, jump if false, k); jumps count the instructions skipped
        (_BPF_LD_W_ABS, 0, 0, 4),  # A = seccomp_data.arch
        (_BPF_JEQ_K, 0, n + 3, audit_arch),  # a foreign ABI: to the final deny
        (_BPF_LD_W_ABS, 0, 0, 0),  # A = seccomp_data.nr
        (_BPF_JGE_K, n + 1, 0, _X32_SYSCALL_BIT),
        *((_BPF_JEQ_K, n - i, 0, nr) for i, nr in enumerate(denied)),  # each: past the rest and the allow
        (_BPF_RET_K, 0, 0, _SECCOMP_RET_ALLOW),
        (_BPF_RET_K, 0, 0, deny),
    ]
    filters = ctypes.create_string_buffer(b"".join(struct.pack("=HBBI", *op) for op in program))
    fprog = struct.pack("@HP", len(program), ctypes.addressof(filters))  # struct sock_fprog, native alignment
    if _libc().prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, fprog, 0, 0) != 0:
        if ctypes.get_errno() == errno.EINVAL:  # a kernel built without seccomp filters
            return False
        _check(-1, "prctl(PR_SET_SECCOMP)")
    return True


def private_tmpfs(directory: str, size_bytes: int, max_inodes: int) -> bool:
    """Move into user, mount and network namespaces of our own and mount a tmpfs of ``size_bytes`` and
    ``max_inodes`` inodes on ``directory`` (then enter it); False, changing nothing, where the kernel refuses
    unprivileged user namespaces.

    The uid and gid map to themselves, so files keep their owner. The tmpfs lives as long as the process: what the
    child writes never reaches the disk and is gone when it exits. The network namespace has only a loopback
    device, which is down.
    """
    libc = _libc()
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNS | _CLONE_NEWNET) != 0:
        return False
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    # nothing mounted here may propagate back into the parent's mount namespace
    _check(libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "mount(/, MS_PRIVATE)")
    options = f"size={size_bytes},nr_inodes={max_inodes},mode=0700,uid={uid},gid={gid}".encode()
    _check(libc.mount(b"tmpfs", os.fsencode(directory), b"tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, options),
           f"mount(tmpfs on {directory!r})")
    os.chdir(directory)  # the working directory was the directory under the new mount
    return True


def private_network() -> bool:
    """A network namespace of our own (a loopback device, down); False where the kernel refuses (non-root)."""
    return _libc().unshare(_CLONE_NEWNET) == 0
