"""The `tfdist` console script: one small handler per subcommand.

    tfdist launch --workers N [--devices_per_worker K] [--max_restarts R] [--dtensor]
                  [--dry_run] [--start_timeout S] [--host H] [--grace_period G] -- COMMAND...
    tfdist tf-config --hosts HOST:PORT,... --index I [--chief] [--port P]
    tfdist tf-config --slurm [--port P] [--chief]
    tfdist doctor
    tfdist plan --devices N --memory_per_device SIZE [--model ... | --params P] [--json]

Subcommands live in SUBCOMMANDS (name -> Subcommand); each handler gets its own
argv and imports what it needs lazily, so `tfdist tf-config` never pays for
importing TensorFlow. A `UsageError` from any handler is printed as one
paragraph on stderr and the exit status is 2.
"""

import dataclasses
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
from typing import Callable, Dict, List, Optional, Sequence

from tfdist import cluster
from tfdist.errors import ArgumentParser, UsageError, require, run_command

NVIDIA_SMI_TIMEOUT_SECONDS = 10


# --------------------------------------------------------------------------- launch

def launch_command(argv: List[str]) -> int:
    from tfdist import launch
    return launch.launch(argv)


# --------------------------------------------------------------------------- tf-config

def tf_config_command(argv: List[str]) -> int:
    """Prints the TF_CONFIG JSON (one line) for one rank of a real cluster."""
    parser = ArgumentParser(
        prog="tfdist tf-config", description=tf_config_command.__doc__,
        epilog="With --collective=tcp across hosts, also give every worker the same "
               "TFDIST_JOB_SECRET (the ring refuses to start without it): "
               "export TFDIST_JOB_SECRET=$(python -c 'import secrets; "
               "print(secrets.token_hex(32))') once per job, shared as a Kubernetes Secret or "
               "exported in the sbatch script; `tfdist launch` sets it itself.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--hosts", help="HOST:PORT,... in rank order; Slurm-style ranges expand: "
                                        "'train-[0-3].svc:2222'")
    source.add_argument("--slurm", action="store_true",
                        help="derive hosts and index from SLURM_* variables (run inside srun)")
    parser.add_argument("--index", type=int, help="this process's rank (required with --hosts)")
    parser.add_argument("--port", type=int, default=None,
                        help=f"port for hosts given without one (--slurm default: {cluster.DEFAULT_PORT}; "
                             f"several tasks on one node use PORT, PORT+1, ...)")
    parser.add_argument("--chief", action="store_true",
                        help="make the first host a 'chief' task (default: all 'worker', worker 0 is chief)")
    args = parser.parse_args(argv)
    hosts, index = _tf_config_hosts_and_index(args)
    config = cluster.build_tf_config(hosts, index, chief=args.chief)
    print(cluster.parse_tf_config(config).to_json())
    return 0


def _tf_config_hosts_and_index(args):
    if args.slurm:
        require(args.index is None, f"--index comes from SLURM_PROCID with --slurm; got --index {args.index}.")
        task = cluster.from_slurm_env(os.environ, cluster.DEFAULT_PORT if args.port is None else args.port)
        return task.hosts, task.index
    require(args.index is not None, "--index is required with --hosts (this process's rank, 0-based).")
    require(args.port is None or 1 <= args.port <= 65535, f"--port must be in 1..65535, got {args.port}.")
    return cluster.with_port(cluster.expand_hostlist(args.hosts), args.port), args.index


# --------------------------------------------------------------------------- doctor

DOCTOR_PACKAGES = (("Keras", "keras"), ("tensorflow-datasets", "tensorflow-datasets"), ("absl", "absl-py"))


class Doctor:
    """Prints one report section at a time; problems are collected, never raised."""

    def __init__(self, out=sys.stdout):
        self.out = out
        self.problems: List[str] = []

    def line(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def problem(self, text: str) -> None:
        self.problems.append(text)
        self.line(f"  PROBLEM: {text}")

    def run(self) -> int:
        tf = self.versions()
        if tf is not None:
            self.devices(tf)
            self.nccl(tf)
        self.interconnect()
        self.mpi()
        self.cluster_environment()
        self.line()
        if self.problems:
            self.line(f"{len(self.problems)} problem(s) found.")
            return 1
        self.line("No problems found.")
        return 0

    def versions(self):
        self.line("Versions")
        self.line(f"  Python: {platform.python_version()} ({sys.executable})")
        tf = None
        try:
            import tensorflow as tf
            self.line(f"  TensorFlow: {tf.__version__}")
        except Exception as error:   # any failure to import is what the doctor is for
            self.problem(f"TensorFlow cannot be imported: {type(error).__name__}: {error}")
        for label, distribution in DOCTOR_PACKAGES:
            self.line(f"  {label}: {_installed_version(distribution)}")
        return tf

    def devices(self, tf) -> None:
        self.line("Devices")
        physical = tf.config.list_physical_devices()
        for kind in sorted({device.device_type for device in physical}):
            names = [device.name for device in physical if device.device_type == kind]
            self.line(f"  physical {kind}: {len(names)} ({', '.join(names)})")
        simulated = os.environ.get("TFDIST_SIMULATE_DEVICES")
        if simulated is None:
            self.line("  TFDIST_SIMULATE_DEVICES: not set")
            return
        if cluster.decimal(simulated) is None:
            self.problem(f"TFDIST_SIMULATE_DEVICES must be an integer >= 0, got {simulated!r}.")
            return
        try:
            if int(simulated) > 0:
                from tfdist import devices
                devices.simulate_cpus(int(simulated))
            count = len(tf.config.list_logical_devices("CPU"))
            self.line(f"  TFDIST_SIMULATE_DEVICES={simulated}: {count} logical CPU device(s)")
        except UsageError as error:
            self.problem(str(error))

    def nccl(self, tf) -> None:
        self.line("NCCL")
        info = dict(tf.sysconfig.get_build_info())
        gpus = len(tf.config.list_physical_devices("GPU"))
        if not tf.test.is_built_with_cuda():
            self.line("  not available: this TensorFlow is built without CUDA "
                      "(CPU workers all-reduce with TF's ring over gRPC, or faster with "
                      "tfdist's --collective=tcp, and =shm on one host)")
            return
        built = f"CUDA {info.get('cuda_version', '?')}, cuDNN {info.get('cudnn_version', '?')}"
        if gpus:
            self.line(f"  available: TensorFlow built with {built}; {gpus} GPU(s) visible")
        else:
            self.line(f"  built in (TensorFlow built with {built}) but no GPU is visible")

    def interconnect(self) -> None:
        self.line("GPU interconnect")
        if shutil.which("nvidia-smi") is None:
            self.line("  nvidia-smi not found (no NVIDIA driver here): skipped")
            return
        try:
            result = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                                    timeout=NVIDIA_SMI_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            self.problem(f"`nvidia-smi topo -m` did not answer within {NVIDIA_SMI_TIMEOUT_SECONDS} s.")
            return
        except OSError as error:
            self.problem(f"`nvidia-smi topo -m` could not run: {error}")
            return
        text = (result.stdout or result.stderr).rstrip()
        for row in text.splitlines():
            self.line(f"  {row}")
        if result.returncode:
            self.problem(f"`nvidia-smi topo -m` exited with code {result.returncode}.")

    def mpi(self) -> None:
        """mpi4py, the MPI library it loads and the launchers on PATH (--collective=mpi);
        MPI is not initialised, so the doctor never starts an MPI world."""
        from tfdist.parallel import mpi
        self.line("MPI")
        for row in mpi.describe_installation():
            self.line(row)

    def cluster_environment(self) -> None:
        self.line("Cluster environment")
        self.tf_config()
        self.ring_secret()
        self.dtensor()
        for name in ("TFDIST_RANK", "TFDIST_NUM_WORKERS", "TFDIST_RESTART_COUNT"):
            if name in os.environ:
                self.line(f"  {name}={os.environ[name]}")

    def tf_config(self) -> None:
        text = os.environ.get("TF_CONFIG")
        if text is None:
            self.line("  TF_CONFIG: not set (single-worker run; `tfdist launch` or `tfdist tf-config` sets it)")
            return
        try:
            config = cluster.parse_tf_config(text)
            role = "the chief" if config.is_chief else "not the chief"
            self.line(f"  TF_CONFIG: valid; this is task {config.task_type}:{config.task_index} "
                      f"({role}) of {config.num_workers} training worker(s): {config.cluster}")
            cluster.check_own_port_free(config)
            self.line(f"  own port: {config.address} is free (or not on this machine)")
        except UsageError as error:
            self.problem(str(error))

    def ring_secret(self) -> None:
        """The secret of --collective=tcp/shm's ring (its value is never printed)."""
        from tfdist.parallel import ring_auth
        name = ring_auth.SECRET_ENV
        if name in os.environ:
            try:
                secret = ring_auth.parse_secret(os.environ[name])
                self.line(f"  {name}: set, {len(secret)} bytes (--collective=tcp/shm prove "
                          f"membership with it)")
            except UsageError as error:
                self.problem(str(error))
            return
        hosts = []
        if os.environ.get("TF_CONFIG"):
            try:
                addresses = cluster.parse_tf_config(os.environ["TF_CONFIG"]).worker_addresses
                hosts = [cluster.split_address(a)[0] for a in addresses]
            except UsageError:
                pass   # tf_config() above reported it
        remote = sorted({h for h in hosts if not cluster.is_local_host(h)})
        if remote:
            self.line(f"  {name}: not set, so --collective=tcp/shm will refuse to start (workers "
                      f"on {', '.join(remote)}): {ring_auth.HOW_TO_SET}")
        else:
            self.line(f"  {name}: not set; tcp/shm workers on this host share the per-user "
                      f"secret in {ring_auth.secret_file_path(os.environ)}")

    def dtensor(self) -> None:
        try:
            env = cluster.validate_dtensor_env(os.environ)
        except UsageError as error:
            self.problem(str(error))
            return
        if env is None:
            self.line("  DTENSOR_*: not set (DTensor runs as a single client)")
        else:
            self.line(f"  DTENSOR_*: valid; client {env.client_id} of {env.num_clients}, "
                      f"job {env.job_name!r}, jobs {env.jobs}")


def _installed_version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def doctor_command(argv: List[str]) -> int:
    """Prints versions, devices, NCCL, GPU interconnect and cluster variables; 1 if a problem is found."""
    ArgumentParser(prog="tfdist doctor", description=doctor_command.__doc__).parse_args(argv)
    return Doctor().run()


# --------------------------------------------------------------------------- dispatch

@dataclasses.dataclass(frozen=True)
class Subcommand:
    summary: str
    handler: Callable[[List[str]], int]   # gets the arguments after the subcommand name


def plan_command(argv: List[str]) -> int:
    from tfdist.plan import command
    return command.main(argv)


# Extension point: a subcommand is one entry here; its handler imports what it needs.
SUBCOMMANDS: Dict[str, Subcommand] = {
    "launch": Subcommand("start N local workers with TF_CONFIG (the torchrun of TensorFlow)", launch_command),
    "tf-config": Subcommand("print the TF_CONFIG JSON of one rank of a real cluster", tf_config_command),
    "doctor": Subcommand("print versions, devices, NCCL, interconnect and cluster variables", doctor_command),
    "plan": Subcommand("estimate memory per device and recommend the simplest plan that fits", plan_command),
}


def usage() -> str:
    width = max(len(name) for name in SUBCOMMANDS)
    rows = "\n".join(f"  {name:<{width}}  {command.summary}" for name, command in SUBCOMMANDS.items())
    return (f"usage: tfdist SUBCOMMAND [ARGS...]\n\nSubcommands:\n{rows}\n\n"
            f"`tfdist SUBCOMMAND --help` describes each one.")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        return run_command(name, lambda _: require(False, f"Unknown subcommand {name!r}. Valid "
                                                          f"subcommands: {', '.join(SUBCOMMANDS)}."),
                           rest)
    return run_command(name, SUBCOMMANDS[name].handler, rest)


if __name__ == "__main__":
    sys.exit(main())
