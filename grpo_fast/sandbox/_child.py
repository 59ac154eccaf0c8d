"""The sandbox's child program, run as ``python -I -S -B _child.py JOB_FILE`` by __init__.py (never
imported): it sets the limits, confines itself with what the kernel offers (landlock.py), stubs the unaudited calls,
installs the audit hook and runs the job: the completion, then for each test its import statements and the
expressions the parent asked for (asserts.py), whose values it reports as plain data (plain_data.py). It decides
nothing: it never sees a test's expected values and has no way to report a pass, so the completion, which shares
this interpreter and can take it over, can only change the values it reports. Standard library only: grpo_fast is
not importable here.
"""

import json, os, resource, sys
import signal, _posixsubprocess  # noqa: F401 (loaded now so that stub_unaudited_calls can stub their C functions)

# landlock.py and plain_data.py sit next to this file; its directory leaves sys.path again before any completion runs
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
from landlock import (  # noqa: E402
    DEVICE_READ_WRITE_PATHS, SYSTEM_READ_PATHS, deny_sockets, drop_capabilities, no_new_privileges,
    private_network, private_tmpfs, restrict,
)
from plain_data import MAX_VALUE_CHARS, Budget, NotPlain, to_tree  # noqa: E402
sys.path[:] = [path for path in sys.path if path != _HERE]

AF_UNIX = 1  # socket.AF_UNIX on Linux; importing socket just for it would slow every run down


def set_rlimits(rlimits):
    """Apply each limit as both soft and hard limit, capped at the current hard limit (only root may raise it)."""
    for name, value in rlimits.items():
        which = getattr(resource, name)
        hard = resource.getrlimit(which)[1]
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(which, (value, value))


def confine(workdir, job):
    """Namespaces and the tmpfs, no-new-privileges, Landlock, seccomp, no capabilities; returns the names of the layers
    in force. A layer the kernel has but that fails to apply raises: the run ends with status error rather than going
    ahead less confined."""
    layers = []
    skip = set(job["skip_layers"])
    if "namespaces" not in skip:
        if private_tmpfs(workdir, job["disk_bytes"], job["max_files"] + 1):  # + 1: the directory's own inode
            layers += ["user-namespace", "network-namespace", "disk-tmpfs"]
        elif private_network():
            layers.append("network-namespace")
    no_new_privileges()
    layers.append("no-new-privs")
    if "landlock" not in skip:
        # the stdlib (-S: no site-packages), the interpreter's shared libraries (libpython; a conda environment's
        # libsqlite3, libssl...) and the system's
        reads = [path for path in sys.path if os.path.exists(path)]
        reads += [os.path.join(prefix, lib) for prefix in {sys.base_prefix, sys.base_exec_prefix}
                  for lib in ("lib", "lib64")]
        reads += SYSTEM_READ_PATHS
        abi = restrict(reads, [workdir], list(DEVICE_READ_WRITE_PATHS))
        if abi:
            layers.append(f"landlock-{abi}")
    if "seccomp" not in skip and deny_sockets():
        layers.append("seccomp")
    drop_capabilities()
    layers.append("no-capabilities")
    return layers


def stub_unaudited_calls():
    """Replace the dangerous calls that raise no audit event with stubs that raise, in the C module and wherever it
    is re-exported; the audit hook then refuses to import those C modules afresh."""
    def blocked(*args, **kwargs):
        raise PermissionError("sandbox: this call is not allowed")

    for c_module, py_module, names in (
        ("posix", "os", ("mknod", "mkfifo", "pidfd_open")),
        ("_signal", "signal", ("pidfd_send_signal",)),
        ("_posixsubprocess", None, ("fork_exec",)),
    ):
        for module in (sys.modules[c_module], sys.modules.get(py_module)):
            for name in names:
                if module is not None and hasattr(module, name):
                    setattr(module, name, blocked)


def make_audit_hook(workdir):
    """The audit hook that confines this interpreter to ``workdir``. It fails closed: an error inside it blocks the
    event. Everything it uses is bound here, as the completion may rebind module attributes and builtins later."""
    realpath, isdir, isabs, join, fsdecode, readlink = (
        os.path.realpath, os.path.isdir, os.path.isabs, os.path.join, os.fsdecode, os.readlink)
    is_instance, devnull = isinstance, os.devnull
    blocked_events = frozenset({
        # creating or signalling processes
        "os.exec", "os.fork", "os.forkpty", "os.kill", "os.killpg", "os.posix_spawn", "os.system", "subprocess.Popen",
        # leaving the namespaces (3.12+), raising the limits, adding hooks
        "os.setns", "os.unshare", "resource.prlimit", "resource.setrlimit", "sys.addaudithook",
        # walking the heap or other threads' stacks, where the harness lives
        "gc.get_objects", "gc.get_referents", "gc.get_referrers", "sys._current_frames",
    })
    stubbed_modules = frozenset({"posix", "_signal", "_posixsubprocess"})
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    # events that change the file system -> ((index of a path argument, index of its dir_fd argument or None), ...)
    path_events = {
        "os.chmod": ((0, 2),), "os.chown": ((0, 3),), "os.link": ((0, 2), (1, 3)), "os.mkdir": ((0, 2),),
        "os.remove": ((0, 1),), "os.removexattr": ((0, None),), "os.rename": ((0, 2), (1, 3)),
        "os.rmdir": ((0, 1),), "os.setxattr": ((0, None),), "os.symlink": ((1, 2),), "os.truncate": ((0, None),),
        "os.utime": ((0, 3),),
    }

    def resolve(path, dir_fd=None):
        """The absolute path an event's path argument names (an int is an open file descriptor)."""
        if is_instance(path, int):
            return readlink(f"/proc/self/fd/{path}")
        path = fsdecode(path)
        if dir_fd is not None and dir_fd >= 0 and not isabs(path):
            path = join(readlink(f"/proc/self/fd/{dir_fd}"), path)
        return realpath(path)

    def inside(path):
        return path == workdir or path.startswith(workdir + "/")

    def deny(event, path=None):
        where = "" if path is None else f" on {path!r}"
        raise PermissionError(f"sandbox: {event}{where} is not allowed")

    def hook(event, args):
        if event in blocked_events or event.startswith("ctypes."):
            deny(event)
        elif event.startswith("socket.") and not (event == "socket.__new__" and args[1] == AF_UNIX):
            deny(event)
        elif event == "import" and args[0] in stubbed_modules:
            deny(event, args[0])
        elif event == "open" and not is_instance(args[0], int):  # re-wrapping a descriptor we hold is fine
            target, flags = resolve(args[0]), args[2]
            if target == "/proc" or target.startswith("/proc/"):
                deny(event, target)
            # a directory descriptor would let the *at() calls (dir_fd=...) reach outside
            if not inside(target) and target != devnull and (flags & write_flags or isdir(target)):
                deny(event, target)
        elif event in path_events:
            for path_index, dir_fd_index in path_events[event]:
                target = resolve(args[path_index], None if dir_fd_index is None else args[dir_fd_index])
                if not inside(target):
                    deny(event, target)

    return hook


def printable(text):
    """The first 200 characters of ``text`` in printable ASCII (it travels in a report line of bounded length)."""
    return "".join(c if " " <= c <= "~" else "?" for c in text[:200])


def describe(exc):
    """``Type: message`` of an exception, :func:`printable`."""
    try:
        return printable(f"{type(exc).__name__}: {exc}")
    except BaseException:  # a __str__ or a metaclass that raises
        return "an exception that cannot be described"


def run(code, tests, channel, layers):
    """Run the completion, then each test's steps in its namespace, reporting on the channel one JSON line each:
    the layers, how the completion ran (``{"code": "ok"}`` or ``"error"``), then per test ``{"i": i, "r": [...]}``
    with one outcome per ``eval`` step (``["v", tree]``, ``["x", raised]``, ``["n", why not plain]``), or
    ``{"i": i, "e": raised}`` when an import step raised."""
    # Bind what this function uses before the completion runs: an innocent completion that rebinds a builtin
    # (exec, say) must not break the report. (A hostile one can take this interpreter over: that changes nothing
    # but the values reported, which the parent judges.)
    write, run_code, evaluate, exit_now, failure, dumps = os.write, exec, eval, os._exit, BaseException, json.dumps
    # os._exit skips them: what the code printed must reach the pipe, before the line that lets the parent stop
    flushes = (sys.stdout.flush, sys.stderr.flush)

    def flush_output():
        for flush in flushes:
            try:
                flush()
            except failure:
                pass

    steps = [[(kind, compile(source, f"<test {i}>", kind)) for kind, source in test] for i, test in enumerate(tests)]

    def send(message):
        data = (dumps(message, separators=(",", ":")) + "\n").encode()
        while data:
            data = data[write(channel, data):]

    def outcome(expression, namespace, budget):
        try:
            value = evaluate(expression, namespace)
        except failure as exc:
            return ["x", describe(exc)]
        try:
            budget.spend(16)  # this outcome's framing
            return ["v", to_tree(value, budget)]
        except NotPlain as exc:
            return ["n", printable(str(exc))]
        except failure as exc:  # raised while draining an iterator, MemoryError, RecursionError...
            return ["n", "encoding it raised " + describe(exc)]

    module = type(sys)("solution")  # a module of its own, so that dataclasses and pickle find the completion's
    sys.modules["solution"] = module
    namespace = module.__dict__
    send({"layers": layers})
    try:
        run_code(compile(code, "<completion>", "exec"), namespace)
    except failure as exc:
        namespace.clear()  # free what the code allocated (a huge list, say) before reporting
        write(2, f"sandbox: the completion raised {describe(exc)}\n".encode())  # before the parent stops reading
        flush_output()
        send({"code": "error"})
        exit_now(0)
    flush_output()
    send({"code": "ok"})
    for i, test in enumerate(steps):
        budget, results = Budget(MAX_VALUE_CHARS), []
        try:
            for kind, step in test:
                if kind == "exec":
                    run_code(step, namespace)
                else:
                    results.append(outcome(step, namespace, budget))
            message = {"i": i, "r": results}
        except failure as exc:
            message = {"i": i, "e": describe(exc)}
        flush_output()
        send(message)
    exit_now(0)  # skip interpreter teardown: threads the completion started must not keep the process alive


def main(job_file):
    """Read and delete the job file, confine this interpreter, then run the job."""
    with open(job_file, encoding="utf-8") as f:
        job = json.load(f)
    os.remove(job_file)
    set_rlimits(job["rlimits"])
    workdir = os.path.realpath(os.getcwd())
    layers = ["rlimits", *confine(workdir, job)]
    stub_unaudited_calls()
    if "audit-hook" not in job["skip_layers"]:
        sys.addaudithook(make_audit_hook(workdir))
        layers.append("audit-hook")
    run(job["code"], job["tests"], job["channel"], layers)


if __name__ == "__main__":
    main(sys.argv[1])
