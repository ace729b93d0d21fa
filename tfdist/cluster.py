"""TF_CONFIG, Slurm and DTENSOR_* parsing, building and validation.

Pure Python on purpose: the launcher, `tfdist tf-config` and Slurm/Kubernetes
start-up scripts call this before (or instead of) importing TensorFlow, which
costs seconds. A bad cluster description then fails in milliseconds with a
message that shows the received value, instead of a gRPC hang minutes later.

Conventions follow TensorFlow's `multi_worker_util`:
- task types are chief, worker, ps and evaluator; at most one chief and one
  evaluator; the evaluator may be absent from the cluster;
- MultiWorkerMirroredStrategy ranks: the chief is 0, worker i is i + #chief;
- the chief is the `chief` task, or worker 0 when the cluster has no chief.
"""

import dataclasses
import ipaddress
import json
import logging
import os
import re
import socket
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence, Union

from tfdist.errors import UsageError, require

TASK_TYPES = ("chief", "worker", "ps", "evaluator")
TRAINING_TYPES = ("chief", "worker")   # the tasks that hold replicas under MWMS
DEFAULT_PORT = 29500                   # Slurm/Kubernetes examples; any free port works
NETWORK_ENV = "TFDIST_NETWORK"   # set by `tfdist launch`: "private" or "host" (tfdist.netns)
_servers_announced: List[str] = []
DTENSOR_VARIABLES = ("DTENSOR_CLIENT_ID", "DTENSOR_NUM_CLIENTS", "DTENSOR_JOB_NAME", "DTENSOR_JOBS")


# --------------------------------------------------------------------------- addresses

def decimal(text) -> Optional[int]:
    """The non-negative integer `text` spells in ASCII digits (spaces around allowed),
    else None. Not str.isdigit(): it also accepts "²" and "١", and int() refuses the
    first and would let a typo through as the second."""
    text = str(text).strip()
    return int(text) if text.isascii() and text.isdigit() else None


def split_address(address: str, where: str = "address") -> tuple:
    """Splits "host:port" (IPv6 as "[::1]:port") into (host, port), or raises UsageError."""
    require(isinstance(address, str), f"{where} must be a \"host:port\" string, got {address!r}.")
    host, sep, port_text = address.strip().rpartition(":")
    require(bool(sep) and bool(host) and decimal(port_text) is not None and port_text.strip() == port_text,
            f"{where} {address!r} is not \"host:port\" (e.g. \"10.0.0.1:2222\" or \"[::1]:2222\").")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    else:
        require(":" not in host, f"{where} {address!r}: write an IPv6 host in brackets, e.g. \"[::1]:2222\".")
    require(bool(host) and not re.search(r"[\s\[\],/]", host),
            f"{where} {address!r} has an invalid host {host!r}.")
    port = int(port_text)
    require(1 <= port <= 65535, f"{where} {address!r} has port {port}; valid ports are 1..65535.")
    return host, port


def join_address(host: str, port: int) -> str:
    """The inverse of split_address: brackets IPv6 hosts the way gRPC expects."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _check_addresses(addresses: Sequence[str], where: str, labels: Sequence[str] = ()) -> None:
    """Validates every "host:port" and rejects duplicates, naming both positions."""
    seen: Dict[str, str] = {}
    for position, address in enumerate(addresses):
        label = labels[position] if labels else f"{where}[{position}]"
        split_address(address, label)
        key = address.strip().lower()
        require(key not in seen,
                f"Duplicate address {address!r} in {where}: {seen.get(key)} and {label}. "
                f"Every task needs its own host:port.")
        seen[key] = label


def is_local_host(host: str) -> bool:
    """True for hosts that name this machine (so their ports can be checked here)."""
    host = host.strip("[]").lower()
    if host in ("localhost", "::1", "0.0.0.0", "::"):
        return True
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        pass
    own = socket.gethostname().lower()
    return host in (own, own.split(".")[0])


# --------------------------------------------------------------------------- TF_CONFIG

@dataclasses.dataclass(frozen=True)
class TFConfig:
    """A validated TF_CONFIG. `cluster` maps task type -> list of "host:port"."""
    cluster: Dict[str, List[str]]
    task_type: str
    task_index: int
    rpc_layer: Optional[str] = None

    @property
    def num_workers(self) -> int:
        """Processes that train under MultiWorkerMirroredStrategy (chief + workers)."""
        return sum(len(self.cluster.get(kind, [])) for kind in TRAINING_TYPES)

    @property
    def worker_addresses(self) -> List[str]:
        """Training tasks in rank order: the chief (rank 0) first, then workers."""
        return [address for kind in TRAINING_TYPES for address in self.cluster.get(kind, [])]

    @property
    def is_chief(self) -> bool:
        # The evaluator is not counted: it does not train or write checkpoints.
        if self.task_type == "chief":
            return True
        return self.task_type == "worker" and self.task_index == 0 and "chief" not in self.cluster

    @property
    def rank(self) -> Optional[int]:
        """This task's replica-group rank, or None for ps/evaluator tasks."""
        if self.task_type not in TRAINING_TYPES:
            return None
        offset = 0 if self.task_type == "chief" else len(self.cluster.get("chief", []))
        return offset + self.task_index

    @property
    def address(self) -> Optional[str]:
        """This task's own host:port (None for an evaluator outside the cluster)."""
        tasks = self.cluster.get(self.task_type, [])
        return tasks[self.task_index] if self.task_index < len(tasks) else None

    def to_dict(self) -> dict:
        config = {"cluster": self.cluster,
                  "task": {"type": self.task_type, "index": self.task_index}}
        if self.rpc_layer:
            config["rpc_layer"] = self.rpc_layer
        return config

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))


def parse_tf_config(text: Union[str, Mapping]) -> TFConfig:
    """Parses and validates TF_CONFIG (a JSON string or an already-decoded dict)."""
    config = _decode(text)
    cluster = _validated_cluster(config.get("cluster"), text)
    task_type, task_index = _validated_task(config.get("task"), cluster, text)
    rpc_layer = config.get("rpc_layer")
    require(rpc_layer is None or isinstance(rpc_layer, str),
            f"TF_CONFIG \"rpc_layer\" must be a string like \"grpc\", got {rpc_layer!r}.")
    return TFConfig(cluster, task_type, task_index, rpc_layer)


def _shown(text) -> str:
    """The received value for an error message, cut so one paragraph stays readable."""
    shown = text if isinstance(text, str) else json.dumps(text, default=str)
    return repr(shown if len(shown) <= 300 else shown[:300] + "...")


def _decode(text) -> dict:
    if isinstance(text, Mapping):
        return dict(text)
    require(isinstance(text, str) and text.strip() != "",
            "TF_CONFIG is empty; expected JSON like "
            '{"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker", "index": 0}}.')
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise UsageError(f"TF_CONFIG is not valid JSON ({error.msg} at line {error.lineno} "
                         f"column {error.colno}). Received: {_shown(text)}.") from None
    require(isinstance(config, dict), f"TF_CONFIG must be a JSON object, got {_shown(text)}.")
    return config


def _validated_cluster(cluster, text) -> Dict[str, List[str]]:
    require(cluster is not None,
            f"TF_CONFIG has no \"cluster\" key; it needs "
            f"{{\"cluster\": {{\"worker\": [\"host:port\", ...]}}, \"task\": {{...}}}}. Received: {_shown(text)}.")
    require(isinstance(cluster, dict) and cluster,
            f"TF_CONFIG \"cluster\" must be a non-empty object of task type -> [\"host:port\", ...], "
            f"got {cluster!r}.")
    for kind, tasks in cluster.items():
        require(kind in TASK_TYPES,
                f"TF_CONFIG cluster has unknown task type {kind!r}. Valid types: {', '.join(TASK_TYPES)}.")
        require(isinstance(tasks, list) and tasks,
                f"TF_CONFIG cluster[{kind!r}] must be a non-empty list of \"host:port\", got {tasks!r}.")
    for kind in ("chief", "evaluator"):
        require(len(cluster.get(kind, [])) <= 1,
                f"TF_CONFIG cluster has {len(cluster.get(kind, []))} {kind!r} tasks; at most one is allowed: "
                f"{cluster[kind] if kind in cluster else ''}.")
    require(any(kind in cluster for kind in TRAINING_TYPES),
            f"TF_CONFIG cluster has no \"chief\" or \"worker\" task, got types {sorted(cluster)}.")
    addresses = [address for kind in cluster for address in cluster[kind]]
    labels = [f"TF_CONFIG task {kind}:{i} address" for kind in cluster for i in range(len(cluster[kind]))]
    _check_addresses(addresses, "the TF_CONFIG cluster", labels)
    return {kind: [address.strip() for address in tasks] for kind, tasks in cluster.items()}


def _validated_task(task, cluster, text) -> tuple:
    require(isinstance(task, dict) and "type" in task,
            f"TF_CONFIG has no \"task\": {{\"type\": ..., \"index\": ...}} saying which task this process is "
            f"(task types in the cluster: {', '.join(cluster)}). Received: {_shown(text)}.")
    kind, index = task.get("type"), task.get("index", 0)
    require(kind in TASK_TYPES,
            f"TF_CONFIG task type {kind!r} is unknown. Valid types: {', '.join(TASK_TYPES)}.")
    require(kind in cluster or kind == "evaluator",
            f"TF_CONFIG task type {kind!r} is not in the cluster, whose types are: {', '.join(cluster)}.")
    require(isinstance(index, int) and not isinstance(index, bool),
            f"TF_CONFIG task index must be an integer, got {index!r}.")
    count = len(cluster.get(kind, [])) or 1   # an evaluator outside the cluster is task 0
    require(0 <= index < count,
            f"TF_CONFIG task index {index} is outside the cluster: {kind!r} has {count} task(s), "
            f"so the valid range is 0..{count - 1}.")
    return kind, index


def check_own_port_free(tf_config: Union[TFConfig, str, Mapping]) -> None:
    """Fails fast when this task's port is taken, instead of letting TensorFlow hang.

    Only checks hosts that are this machine; a remote host's ports cannot be
    probed by binding. Binds the wildcard address with SO_REUSEADDR, as TF's
    gRPC server does, so a lingering TIME_WAIT connection is not a false alarm.
    """
    config = tf_config if isinstance(tf_config, TFConfig) else parse_tf_config(tf_config)
    if config.address is None:
        return
    host, port = split_address(config.address)
    if not is_local_host(host):
        return
    label = f"{config.task_type}:{config.task_index}"
    if not port_is_free(port, ipv6=":" in host):
        raise UsageError(
            f"port {port} of task {label} is already taken by another process "
            f"(address {config.address!r}). Stop that process, or give this task another port "
            f"in TF_CONFIG (tfdist launch picks free ports itself).")


def port_is_free(port: int, ipv6: bool = False) -> bool:
    """True if a server could bind `port` on every interface right now."""
    family, anywhere = (socket.AF_INET6, "::") if ipv6 else (socket.AF_INET, "0.0.0.0")
    try:
        probe = socket.socket(family, socket.SOCK_STREAM)
    except OSError:   # e.g. IPv6 disabled: nothing could bind there, nothing to report
        return True
    with probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((anywhere, port))
        except OSError:
            return False
    return True


def build_tf_config(hosts: Sequence[str], index: int, chief: bool = False) -> dict:
    """TF_CONFIG (as a dict) for rank `index` of a cluster of `hosts` ("host:port").

    chief=True: hosts[0] is the "chief" task and the rest are workers 0..n-2.
    chief=False: all are workers and worker 0 acts as chief (TensorFlow's rule).
    The rank of every task equals its position in `hosts` either way.
    """
    hosts = [host.strip() for host in hosts]
    require(len(hosts) > 0, "The host list is empty; give at least one \"host:port\".")
    _check_addresses(hosts, "the host list")
    require(isinstance(index, int) and 0 <= index < len(hosts),
            f"Index {index!r} is outside the cluster of {len(hosts)} host(s); "
            f"the valid range is 0..{len(hosts) - 1}.")
    if chief:
        cluster = {"chief": hosts[:1]}
        if len(hosts) > 1:
            cluster["worker"] = hosts[1:]
        task = {"type": "chief", "index": 0} if index == 0 else {"type": "worker", "index": index - 1}
    else:
        cluster = {"worker": hosts}
        task = {"type": "worker", "index": index}
    return {"cluster": cluster, "task": task}


# --------------------------------------------------------------------------- host lists

def expand_hostlist(text: str) -> List[str]:
    """Expands a Slurm-style host list: "node[01-03,07],gpu5" -> node01..node03, node07, gpu5.

    Zero padding is kept, several bracket groups multiply ("r[1-2]n[1-2]"), and
    text after a bracket is kept ("job-[0-3].svc:2222"), which also serves
    Kubernetes pod names.
    """
    require(isinstance(text, str) and text.strip() != "", f"Empty host list {text!r}.")
    hosts: List[str] = []
    for item in _split_top_level(text.strip()):
        require(item != "", f"Host list {text!r} has an empty entry (a stray comma).")
        hosts.extend(_expand_item(item, text))
    return hosts


def _split_top_level(text: str) -> List[str]:
    items, depth, current = [], 0, ""
    for char in text:
        depth += (char == "[") - (char == "]")
        require(depth in (0, 1), f"Host list {text!r} has unbalanced or nested brackets.")
        if char == "," and depth == 0:
            items.append(current.strip())
            current = ""
        else:
            current += char
    require(depth == 0, f"Host list {text!r} has an unclosed '['.")
    items.append(current.strip())
    return items


def _expand_item(item: str, text: str) -> List[str]:
    start = item.find("[")
    if start < 0:
        return [item]
    end = item.index("]", start)
    prefix, ranges, rest = item[:start], item[start + 1:end], item[end + 1:]
    return [prefix + value + tail
            for value in _expand_ranges(ranges, text)
            for tail in _expand_item(rest, text)]


def _expand_ranges(ranges: str, text: str) -> List[str]:
    values = []
    for part in ranges.split(","):
        low, _, high = part.strip().partition("-")
        high = high or low
        require(decimal(low) is not None and decimal(high) is not None,
                f"Host list {text!r}: bracket range {part!r} is not N or N-M with digits.")
        require(int(low) <= int(high), f"Host list {text!r}: range {part!r} runs backwards.")
        width = len(low) if low.startswith("0") else 0   # "01-10" keeps two digits
        values.extend(str(number).zfill(width) for number in range(int(low), int(high) + 1))
    return values


def with_port(hosts: Sequence[str], port: Optional[int]) -> List[str]:
    """Appends `port` to hosts given without one; hosts with a port keep theirs."""
    result = []
    for host in hosts:
        has_port = re.search(r":\d+$", host) and (host.count(":") == 1 or host.startswith("["))
        if has_port or port is None:
            result.append(host)
        else:
            result.append(join_address(host, port))
    return result


# --------------------------------------------------------------------------- Slurm

class SlurmTask(NamedTuple):
    hosts: List[str]   # "host:port" per task, in SLURM_PROCID order
    index: int         # this task's SLURM_PROCID


def from_slurm_env(env: Mapping[str, str], port: int = DEFAULT_PORT) -> SlurmTask:
    """Derives the cluster's "host:port" list and this task's index from Slurm variables.

    Call it inside `srun` (one process per task). Several tasks on one node get
    ports port, port+1, ... Ranks follow Slurm's default block distribution
    (node 0 holds tasks 0..k-1); `srun --distribution=cyclic` is not supported.
    """
    require(1 <= port <= 65535, f"--port must be in 1..65535, got {port}.")
    procid = _slurm_int(env, "SLURM_PROCID", "Run this inside `srun` (one task per process).")
    ntasks = _slurm_int(env, "SLURM_STEP_NUM_TASKS", None) if "SLURM_STEP_NUM_TASKS" in env else \
        _slurm_int(env, "SLURM_NTASKS", "Run this inside `srun` or an sbatch job.")
    nodelist_var = next((name for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
                         if env.get(name)), None)
    require(nodelist_var is not None,
            "SLURM_STEP_NODELIST / SLURM_JOB_NODELIST is not set. Run this inside `srun` or an sbatch job.")
    nodes = expand_hostlist(env[nodelist_var])
    per_node = _tasks_per_node(env, len(nodes), ntasks)
    hosts = [join_address(node, port + local) for node, count in zip(nodes, per_node) for local in range(count)]
    require(len(hosts) == ntasks,
            f"Slurm says {ntasks} task(s) but {nodelist_var}={env[nodelist_var]!r} with tasks per node "
            f"{per_node} gives {len(hosts)}.")
    require(0 <= procid < ntasks, f"SLURM_PROCID={procid} is outside 0..{ntasks - 1} (SLURM_NTASKS={ntasks}).")
    return SlurmTask(hosts, procid)


def _slurm_int(env: Mapping[str, str], name: str, hint: Optional[str]) -> int:
    value = env.get(name)
    require(value is not None, f"{name} is not set. {hint}")
    number = decimal(value)
    require(number is not None, f"{name} must be a non-negative integer, got {value!r}.")
    return number


def _tasks_per_node(env: Mapping[str, str], num_nodes: int, ntasks: int) -> List[int]:
    """Parses SLURM_(STEP_)TASKS_PER_NODE ("2(x3),1"); without it, tasks spread evenly."""
    text = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not text:
        require(ntasks % num_nodes == 0,
                f"{ntasks} Slurm task(s) do not spread evenly over {num_nodes} node(s) and "
                f"SLURM_TASKS_PER_NODE is not set.")
        return [ntasks // num_nodes] * num_nodes
    counts = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        require(match is not None, f"SLURM_TASKS_PER_NODE={text!r} is not like \"2(x3),1\".")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    require(len(counts) == num_nodes,
            f"SLURM_TASKS_PER_NODE={text!r} describes {len(counts)} node(s) but the node list has {num_nodes}.")
    return counts


# --------------------------------------------------------------------------- a pipeline across workers

def pipeline_stage_devices(num_workers: int, devices_per_worker: int, num_stages: int,
                           kind: str = "CPU") -> List[str]:
    """The devices of a pipeline whose stages live in different workers, replica after
    replica (stage k of replica r at index r*S + k): the W/S groups of S consecutive
    workers each hold one pipeline per local device, stage k of replica (g, d) on task
    g*S + k, device d (tfdist/parallel/pipeline/cluster.py). Pure Python: the planner
    names devices with it too."""
    return [f"/job:worker/replica:0/task:{group * num_stages + k}/device:{kind}:{local}"
            for group in range(num_workers // num_stages) for local in range(devices_per_worker)
            for k in range(num_stages)]


# --------------------------------------------------------------------------- the environment's clusters

class ClusterDescription(NamedTuple):
    """A cluster that this process's environment says it belongs to."""
    variable: str             # the variable that describes it, as a message should name it
    num_workers: int          # training processes in it
    rank: Optional[int]       # this process's rank there; None for a task that does not train


def clusters_in_environment(env: Mapping[str, str]) -> List[ClusterDescription]:
    """Every cluster that TF_CONFIG, Slurm's srun or DTENSOR_* describe, validated.

    Pure Python and cheap, so entry points ask before TensorFlow is imported.
    Slurm counts only under srun (SLURM_STEP_NUM_TASKS): a batch script or an
    salloc shell also has SLURM_NTASKS and SLURM_PROCID=0 but is one process,
    whatever the allocation's size.
    """
    found = []
    if env.get("TF_CONFIG"):
        config = parse_tf_config(env["TF_CONFIG"])
        found.append(ClusterDescription("TF_CONFIG", config.num_workers, config.rank))
    if "SLURM_STEP_NUM_TASKS" in env and "SLURM_PROCID" in env:
        tasks = _slurm_int(env, "SLURM_STEP_NUM_TASKS", None)
        found.append(ClusterDescription("SLURM_STEP_NUM_TASKS", tasks,
                                        _slurm_int(env, "SLURM_PROCID", None)))
    dtensor = validate_dtensor_env(env)
    if dtensor is not None:
        found.append(ClusterDescription("DTENSOR_JOBS", dtensor.num_clients, dtensor.client_id))
    found += mpi_worlds_in_environment(env)
    return found


# What MPI launchers set in each rank: (size variable, rank variable). Open MPI's mpirun
# sets the first pair; MPICH's mpiexec and srun --mpi=pmi2 the second (srun --mpi=pmix
# sets PMIX_RANK only, and Slurm's own variables above).
MPI_WORLD_VARIABLES = (("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"), ("PMI_SIZE", "PMI_RANK"))


def mpi_worlds_in_environment(env: Mapping[str, str]) -> List[ClusterDescription]:
    """The MPI world an MPI launcher started this process in (tfdist.parallel.mpi)."""
    for size_name, rank_name in MPI_WORLD_VARIABLES:
        if size_name in env:
            hint = f"MPI launchers set it beside {size_name}."
            return [ClusterDescription(size_name, _slurm_int(env, size_name, hint),
                                       _slurm_int(env, rank_name, hint))]
    return []


# --------------------------------------------------------------------------- DTensor

@dataclasses.dataclass(frozen=True)
class DTensorEnv:
    client_id: int
    num_clients: int
    job_name: str
    jobs: List[str]


def dtensor_env(addresses: Sequence[str], client_id: int, job_name: str = "worker") -> Dict[str, str]:
    """The DTENSOR_* variables for client `client_id` of a multi-client DTensor run."""
    addresses = list(addresses)
    require(len(addresses) > 0, "DTensor needs at least one client address.")
    _check_addresses(addresses, "the DTensor client addresses")
    require(isinstance(client_id, int) and 0 <= client_id < len(addresses),
            f"DTensor client id {client_id!r} is outside 0..{len(addresses) - 1}.")
    require(bool(job_name) and "/" not in job_name and ":" not in job_name,
            f"DTensor job name must be a plain name like \"worker\", got {job_name!r}.")
    return {"DTENSOR_CLIENT_ID": str(client_id),
            "DTENSOR_NUM_CLIENTS": str(len(addresses)),
            "DTENSOR_JOB_NAME": job_name,
            "DTENSOR_JOBS": ",".join(addresses)}


def keras_distribution_env(addresses: Sequence[str], process_id: int) -> Dict[str, str]:
    """The variables keras.distribution.initialize() reads (KERAS_DISTRIBUTION_JOB_ADDRESSES,
    _NUM_PROCESSES, _PROCESS_ID) for the same clients as dtensor_env: a Keras program
    under `tfdist launch --dtensor` calls initialize() with no arguments
    (tfdist.keras_distribution turns them into its DTensor clients)."""
    addresses = list(addresses)
    return {"KERAS_DISTRIBUTION_JOB_ADDRESSES": ",".join(addresses),
            "KERAS_DISTRIBUTION_NUM_PROCESSES": str(len(addresses)),
            "KERAS_DISTRIBUTION_PROCESS_ID": str(process_id)}


def validate_dtensor_env(env: Mapping[str, str]) -> Optional[DTensorEnv]:
    """Validates the DTENSOR_* variables in `env`; None when none is set (local mode).

    TF 2.21 derives the number of clients from DTENSOR_JOBS; DTENSOR_NUM_CLIENTS
    is still checked against it because older code and docs set it.
    """
    if not any(name in env for name in DTENSOR_VARIABLES):
        return None
    jobs_text = env.get("DTENSOR_JOBS", "")
    jobs = [job.strip() for job in jobs_text.split(",")] if jobs_text.strip() else []
    if jobs:
        _check_addresses(jobs, "DTENSOR_JOBS")
    num_clients = len(jobs) or 1
    declared = env.get("DTENSOR_NUM_CLIENTS")
    if declared is not None:
        require((decimal(declared) or 0) >= 1,
                f"DTENSOR_NUM_CLIENTS must be an integer >= 1, got {declared!r}.")
        require(decimal(declared) == num_clients,
                f"DTENSOR_NUM_CLIENTS={declared} but DTENSOR_JOBS lists {len(jobs)} client(s) "
                f"({jobs_text!r}); TensorFlow uses one DTENSOR_JOBS entry per client.")
    client = env.get("DTENSOR_CLIENT_ID", "0")
    require(decimal(client) is not None,
            f"DTENSOR_CLIENT_ID must be an integer >= 0, got {client!r}.")
    require(decimal(client) < num_clients,
            f"DTENSOR_CLIENT_ID={client} is outside 0..{num_clients - 1} "
            f"(DTENSOR_JOBS has {num_clients} client(s)).")
    job_name = env.get("DTENSOR_JOB_NAME", "worker" if num_clients > 1 else "localhost")
    require(bool(job_name.strip()) and "/" not in job_name,
            f"DTENSOR_JOB_NAME must be a plain name like \"worker\", got {job_name!r}.")
    return DTensorEnv(decimal(client), num_clients, job_name, jobs)


def announce_grpc_server(address: str, what: str) -> None:
    """Says once per process, before TensorFlow starts `what`'s gRPC server, that it will
    listen on every interface: TensorFlow binds "0.0.0.0:<port>" whatever host TF_CONFIG or
    DTENSOR_JOBS names (grpc_server_lib.cc; no bind option, no credentials), and whoever
    reaches the port can run any operation in this process. Silent under `tfdist launch`:
    in its private network nothing outside the job reaches the port, and under
    --network=host the launcher has said it once for every worker."""
    if os.environ.get(NETWORK_ENV) or _servers_announced:
        return
    _servers_announced.append(address)
    host, port = split_address(address)
    logging.getLogger("tfdist").warning(
        "%s: TensorFlow's gRPC server of this process will listen on port %d of every "
        "interface (its address is %s, but TensorFlow binds all of them), and whoever reaches "
        "that port can run operations in this process: reading and writing files, changing "
        "the model. Allow the port only from the job's hosts (a firewall rule or a private "
        "network); on one host, `tfdist launch` runs the workers in a private network.",
        what, port, address)
