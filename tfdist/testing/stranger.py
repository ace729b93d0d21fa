"""A stranger against a running job: every port the job listens on, and whether an op runs through it.

    python -m tfdist.testing.stranger --pid PID --out probe.json --evidence_dir DIR
    python -m tfdist.testing.stranger --table DIR    # the docs' table from saved records

Watches process PID and its descendants until they have all ended. Each TCP port one of
them listens on is probed once, as soon as it appears, from this host's network: this
process connects, and where a connection is accepted its child process tries the op
(the watcher never loads TensorFlow, whose import would stall its polls: `Prober`). The
probe is the attack TensorFlow's
gRPC server admits: a `tf.compat.v1.Session("grpc://127.0.0.1:PORT")` that runs
`tf.io.write_file` (unpinned, then on each `/job:worker/replica:0/task:I`). The file is
the evidence: the probe's op ran if and only if it exists afterwards.

Each record: the listening process, the address it binds, the port, whether its network
is this process's ("host") or another ("private"), who holds it, and the probe's
outcome (attributed to the port: a gRPC session opened through the rendezvous's short-
lived socket reaches the TensorFlow server that takes the same port next): "refused"
(no connection: nothing listens there in our network), "op ran", "op failed: ...", or
"no answer" (a session that neither ran nor failed within PROBE_SECONDS: gRPC retries a
server that went away, or a port that is not gRPC, without end).
With --until_op_runs the watch ends as soon as one probe's op ran (the job keeps
running: its caller ends it), so proving an open door takes no longer than the probe.
Linux only: it reads /proc. Used by tests/test_stranger.py, which also writes the
docs' table from these records.
"""

import argparse
import dataclasses
import json
import os
import socket
import struct
import subprocess
import sys
import time
from typing import Dict, List, Optional, Set

LISTEN = "0A"          # /proc/net/tcp's state code for a listening socket
POLL_SECONDS = 0.1
CONNECT_SECONDS = 2.0
OP_TIMEOUT_MS = 4000
# How long, after the job ended (or an op ran), the watch waits for the probes still
# running. A probe's session to a server that is gone, or to a port that does not speak
# gRPC, can wait without end (the CI run where the prober outlived the job by 120 s).
PROBE_SECONDS = 30.0


@dataclasses.dataclass
class Listener:
    pid: int
    process: str
    address: str
    port: int
    network: str            # "host" (this prober's) or "private" (another namespace)
    what: str = ""          # who holds the socket (see `owner`)
    interfaces: List[str] = dataclasses.field(default_factory=list)   # in its network
    probe: str = ""
    seen_at: float = 0.0    # seconds from the watch's start to the poll that found it

    @property
    def key(self):
        return (self.pid, self.network, self.address, self.port)


# --------------------------------------------------------------------------- /proc

def descendants(root: int) -> List[int]:
    """root and every process below it, alive now."""
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            parent = _parent_of(int(entry))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        if os.path.exists(f"/proc/{pid}"):
            found.append(pid)
            todo.extend(children.get(pid, []))
    return found


def _parent_of(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return int(text[text.rindex(")") + 2:].split()[1])   # after "(comm) state"


def _socket_inodes(pid: int) -> Set[int]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _decode_address(text: str) -> tuple:
    """/proc/net/tcp's "0100007F:1F90" (little-endian words) -> ("127.0.0.1", 8080)."""
    hex_address, hex_port = text.split(":")
    raw = bytes.fromhex(hex_address)
    words = b"".join(struct.pack("<I", struct.unpack(">I", raw[i:i + 4])[0])
                     for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, words), int(hex_port, 16)


def network_of(pid: int) -> Optional[str]:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def listeners_of(pid: int) -> List[Listener]:
    """The TCP sockets process pid listens on (read in its own network namespace)."""
    inodes = _socket_inodes(pid)
    namespace = network_of(pid)
    if not inodes or namespace is None:
        return []
    network = "host" if namespace == network_of(os.getpid()) else "private"
    try:
        with open(f"/proc/{pid}/comm") as f:
            process = f.read().strip()
    except OSError:
        return []
    found = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == LISTEN and int(fields[9]) in inodes:
                address, port = _decode_address(fields[1])
                found.append(Listener(pid, process, address, port, network,
                                      owner(process, address), interfaces_of(pid)))
    return found


def interfaces_of(pid: int) -> List[str]:
    """The network interfaces of pid's network namespace."""
    try:
        with open(f"/proc/{pid}/net/dev") as f:
            return [line.split(":")[0].strip() for line in f.read().splitlines()[2:]]
    except OSError:
        return []


def owner(process: str, address: str) -> str:
    """Who listens, from what each binds: Open MPI's runtime is its own process; in a
    worker, TensorFlow's gRPC server is what binds every interface ("::" dual-stack, or
    0.0.0.0), while tfdist's ring and rendezvous bind the worker's own address
    (tcp_ring.listen, rendezvous.wait_for_peers: the rendezvous holds the TF_CONFIG port
    until TensorFlow's server takes it)."""
    if process.startswith(("prte", "orte", "mpirun", "prted")):
        return f"Open MPI runtime ({process})"
    if address in ("::", "0.0.0.0"):
        return "TensorFlow gRPC server"
    return "tfdist ring or rendezvous"


# --------------------------------------------------------------------------- the probe

def try_op(port: int, evidence: str, prober: "Prober") -> str:
    """Connects to 127.0.0.1:port from here; if it answers, the prober's child runs the
    write through TF."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=CONNECT_SECONDS).close()
    except OSError:
        return "refused"
    return prober.try_op(port, evidence)


class Prober:
    """The child process that tries the op (`--serve_probes`): it loads TensorFlow while the
    job starts, then takes "ID PORT EVIDENCE" lines on stdin and answers "ID OUTCOME" on
    stdout, each probe in a thread of its own.

    Why a child: importing TensorFlow holds the GIL for seconds at a time (the dlopen of its
    libraries: 8 s without a poll measured on a loaded 2-core machine), which in the watcher
    stalled its /proc polls long enough to miss a short job's ports entirely (the CI run
    where a 40-step job's probe saw no door). Why one, started at once: a child per port
    imported TensorFlow only after its port appeared, and the open-door test's job trained
    that much longer (121 s in a CI run, against 25 s with the import overlapping start-up).
    """

    def __init__(self, tasks: int):
        import threading
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tfdist.testing.stranger", "--serve_probes",
             f"--tasks={tasks}"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True)
        self.outcomes: Dict[int, str] = {}
        self.ended = False
        self.changed = threading.Condition()
        self.requests = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            request, _, outcome = line.rstrip("\n").partition(" ")
            if not request.isdigit():   # not an answer (a library printing): never a verdict
                continue
            with self.changed:
                self.outcomes[int(request)] = outcome
                self.changed.notify_all()
        with self.changed:
            self.ended = True
            self.changed.notify_all()

    def try_op(self, port: int, evidence: str) -> str:
        with self.changed:
            self.requests += 1
            request = self.requests
            try:
                self.process.stdin.write(f"{request} {port} {evidence}\n")
                self.process.stdin.flush()
            except OSError:   # the child is gone: no answer
                return f"probe process ended with code {self.process.poll()}"
            self.changed.wait_for(lambda: request in self.outcomes or self.ended)
            return self.outcomes.get(request,
                                     f"probe process ended with code {self.process.poll()}")

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


def serve_probes(tasks: int) -> None:
    """The child's side of Prober."""
    import importlib
    import threading
    importlib.import_module("tensorflow")   # now, while the job starts
    answering = threading.Lock()

    def answer(request, port, evidence):
        outcome = run_op(int(port), evidence, tasks)
        with answering:
            print(f"{request} {outcome}", flush=True)

    for line in sys.stdin:
        request, port, evidence = line.rstrip("\n").split(" ", 2)
        threading.Thread(target=answer, args=(request, port, evidence), daemon=True).start()


def run_op(port: int, evidence: str, tasks: int) -> str:
    """In the child: a session to the port that runs `tf.io.write_file` (unpinned, then
    on each worker task)."""
    import tensorflow as tf
    errors = []
    for device in [None] + [f"/job:worker/replica:0/task:{i}" for i in range(tasks)]:
        graph = tf.Graph()
        with graph.as_default():
            with tf.device(device):
                write = tf.io.write_file(evidence, "written by a stranger")
        config = tf.compat.v1.ConfigProto(operation_timeout_in_ms=OP_TIMEOUT_MS)
        try:
            with tf.compat.v1.Session(f"grpc://127.0.0.1:{port}", graph=graph,
                                      config=config) as session:
                session.run(write)
        except Exception as error:   # any failure means: not through this door
            errors.append(f"{device or 'unpinned'}: {type(error).__name__}")
            continue
        if os.path.exists(evidence):
            return "op ran"
    return "op failed: " + "; ".join(errors)


def watch(root: int, evidence_dir: str, tasks: int, deadline: float,
          until_op_runs: bool = False) -> List[Listener]:
    """Probes every socket root's processes listen on, once each, as it appears (each in a
    thread of its own: a slow door must not hide the next), until they have all ended
    (or, with until_op_runs, until one probe's op ran)."""
    import threading
    seen: Dict[tuple, Listener] = {}
    probes = []
    started, polls, longest_poll_gap, last_poll = time.monotonic(), 0, 0.0, time.monotonic()
    prober = Prober(tasks)   # this process never imports TensorFlow (see Prober)

    def probe(listener):
        evidence = os.path.join(evidence_dir, f"port{listener.port}.txt")
        outcome = try_op(listener.port, evidence, prober)
        if not listener.probe:   # not already given up on (below)
            listener.probe = outcome

    def an_op_ran():
        return any(listener.probe == "op ran" for listener in seen.values())

    while os.path.exists(f"/proc/{root}") and time.monotonic() < deadline:
        if until_op_runs and an_op_ran():
            break
        now = time.monotonic()
        polls, longest_poll_gap, last_poll = polls + 1, max(longest_poll_gap, now - last_poll), now
        for pid in descendants(root):
            for listener in listeners_of(pid):
                if listener.key not in seen:
                    listener.seen_at = round(time.monotonic() - started, 2)
                    seen[listener.key] = listener
                    probes.append(threading.Thread(target=probe, args=(listener,), daemon=True))
                    probes[-1].start()
        time.sleep(POLL_SECONDS)
    # The probes left get PROBE_SECONDS in all, not each: the watch's end must not grow
    # with the number of ports.
    stop_waiting = time.monotonic() + PROBE_SECONDS
    for thread in probes:
        thread.join(max(stop_waiting - time.monotonic(), 0.0))
    for listener in seen.values():
        if not listener.probe:
            listener.probe = f"no answer within {PROBE_SECONDS:.0f} s"
    prober.close()
    # What a test needs to tell "nothing listened" from "the watch did not look".
    print(f"stranger: watched {time.monotonic() - started:.1f} s in {polls} polls (longest "
          f"gap {longest_poll_gap:.2f} s); {len(seen)} listening socket(s)", file=sys.stderr)
    return list(seen.values())


def table(records_dir: str) -> str:
    """The docs' table from the records tests/test_stranger.py saved (one JSON file per
    mode, spaces written as "+"), in markdown; identical sockets of several workers are
    one row with their count."""
    lines = ["| mode | port held by | binds | its network's interfaces | the probe's op | sockets |",
             "|---|---|---|---|---|---|"]
    for name in sorted(os.listdir(records_dir)):
        with open(os.path.join(records_dir, name)) as f:
            records = json.load(f)
        mode = name[:-len(".json")].replace("+", " ")
        if not records:
            lines.append(f"| {mode} | (nothing listens) | | | | 0 |")
        rows: Dict[tuple, int] = {}
        for r in records:
            where = "private" if r["network"] == "private" else "this host's"
            row = (r["what"], r["address"], f"{where}: {', '.join(r['interfaces'])}",
                   r["probe"].split(":")[0])
            rows[row] = rows.get(row, 0) + 1
        for row, count in sorted(rows.items()):
            lines.append(f"| {mode} | {' | '.join(row)} | {count} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", metavar="DIR", help="print the markdown table of the "
                        "records saved in DIR, and nothing else")
    parser.add_argument("--pid", type=int, help="the job's first process")
    parser.add_argument("--out", help="JSON records written here")
    parser.add_argument("--evidence_dir", help="where the probe's op would write its file")
    parser.add_argument("--tasks", type=int, default=2, help="TF tasks to try pinning to")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--serve_probes", action="store_true", help="(the watcher's child) "
                        "try the op on each 'ID PORT EVIDENCE' line of stdin")
    parser.add_argument("--until_op_runs", action="store_true", help="end the watch (not "
                        "the job) as soon as one probe's op ran")
    args = parser.parse_args(argv)
    if args.table:
        print(table(args.table))
        return 0
    if args.serve_probes:
        serve_probes(args.tasks)
        return 0
    if not (args.pid and args.out and args.evidence_dir):
        parser.error("--pid, --out and --evidence_dir are required to watch a job")
    records = watch(args.pid, args.evidence_dir, args.tasks,
                    time.monotonic() + args.timeout, args.until_op_runs)
    with open(args.out, "w") as f:
        json.dump([dataclasses.asdict(r) for r in records], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
