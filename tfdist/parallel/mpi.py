"""`--collective=mpi`: gradients summed by MPI_Allreduce (mpi4py), world formed by MPI.

Why MPI: it is the engine CPU clusters already run (under mpirun and Slurm's
srun), with transports tfdist's sockets cannot reach (shared memory tuned per
CPU, RDMA/InfiniBand, GPU-aware builds), and it is maintained by others. Horovod
was TensorFlow's way to MPI and is broken on TF >= 2.16 (horovod#4290).

What this module does:
- `join_world`: under an MPI launch (mpirun/mpiexec, srun --mpi=pmix|pmi2) it
  initialises MPI and forms the TensorFlow cluster from the MPI world: rank r is
  TF_CONFIG worker r, its host is the rank's host (127.0.0.1 when every rank is on
  one host), its port a free one this rank holds open while the ports are
  exchanged over MPI, so two ranks of one host never pick the same one. No
  TF_CONFIG is needed; one that is also set must agree (size and rank).
- `MpiAllReduce`: what the training step hands its gradients and loss to, with
  the same contract as the shared-memory all-reduce (shm_ring): the arrays are
  packed into one 64-byte-aligned buffer (tcp_ring.BufferLayout), summed in
  place by one MPI_Allreduce, and returned as views of that buffer, valid until
  the next call. The first call of every buffer layout checks that every rank
  sums the same shapes (an allgather of the layout's digest): workers started
  with different models fail there, by name, instead of summing unrelated numbers.

Exactness: MPI_Allreduce's SUM is computed in an order the library chooses, so
the sums differ from one device's in the last bits (within 1e-5 relative, as
TF's own collectives), and the MPI standard only advises that every rank gets
the same bits. tfdist relies on that advice only where tests check it: 2 and 3
ranks, Open MPI and its shared-memory and TCP transports (tests/test_mpi.py).

Trust: MPI's transports do not authenticate their peers; MPI trusts whoever
its launcher (mpirun's daemons, Slurm's PMIx/PMI2 server) started. `tfdist
launch --mpi` keeps Open MPI's TCP traffic on loopback on one host.
"""

import logging
import os
import socket
from typing import List, Mapping, Optional

import numpy as np

from tfdist import cluster
from tfdist.errors import ClusterError, UsageError
from tfdist.parallel.tcp_ring import BufferLayout

log = logging.getLogger("tfdist")
INSTALL_HINT = 'pip install -e ".[mpi]" (mpi4py and the Open MPI runtime from PyPI)'
# What each MPI launcher sets in the processes it starts (name -> which launcher).
LAUNCH_VARIABLES = {
    "OMPI_COMM_WORLD_SIZE": "Open MPI's mpirun",
    "PMIX_RANK": "a PMIx launcher (Open MPI 5's mpirun, srun --mpi=pmix)",
    "PMI_SIZE": "MPICH's mpiexec or srun --mpi=pmi2",
    "PMI_RANK": "MPICH's mpiexec or srun --mpi=pmi2",
    "MPI_LOCALNRANKS": "MPICH's mpiexec",
}
RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
HOW_TO_LAUNCH = ("start it with `mpirun -np N python -m experiments.train ...`, "
                 "`srun --mpi=pmix -n N ...` under Slurm, or "
                 "`tfdist launch --mpi --workers N -- python -m experiments.train ...`")


def launcher_of(env: Mapping[str, str]) -> Optional[str]:
    """Which MPI launcher started this process, from its variables; None outside one."""
    for name, launcher in LAUNCH_VARIABLES.items():
        if name in env:
            return launcher
    return None


def chosen_launcher(env: Mapping[str, str]) -> Optional[str]:
    """launcher_of(env), when the user chose MPI to start this process: mpirun or mpiexec,
    or a PMI launch outside Slurm. Under Slurm, srun sets PMIx or PMI variables whenever the
    cluster's default MPI plugin is on, whether or not the job uses MPI."""
    if "OMPI_COMM_WORLD_SIZE" in env or "MPI_LOCALNRANKS" in env or "SLURM_PROCID" not in env:
        return launcher_of(env)
    return None


def rank_hint(env: Mapping[str, str]) -> str:
    """This process's rank as the launcher told it (before MPI is initialised), for messages."""
    for name in RANK_VARIABLES:
        if cluster.decimal(env.get(name)) is not None:
            return env[name]
    return "?"


def require_launch(env: Mapping[str, str]) -> None:
    """A UsageError, saying how to launch, when no MPI launcher started this process.
    Checked before mpi4py is imported: MPI would otherwise start a world of one."""
    if launcher_of(env) is None:
        raise UsageError(f"--collective=mpi needs an MPI launch, but this process was not "
                         f"started by one (none of {', '.join(LAUNCH_VARIABLES)} is set): "
                         f"{HOW_TO_LAUNCH}.")


def load_mpi():
    """mpi4py's MPI module, MPI initialised with every thread allowed to call it (TensorFlow
    runs the step's all-reduce on its own threads); a UsageError saying what to install."""
    try:
        import mpi4py
    except ImportError:
        raise UsageError(f"--collective=mpi needs mpi4py and an MPI runtime: {INSTALL_HINT}, "
                         f"or your cluster's MPI module with `pip install mpi4py`.") from None
    mpi4py.rc.initialize = False   # initialise_releasing_the_gil does it
    mpi4py.rc.finalize = True
    # Open MPI waits for a peer by polling at full speed, which takes the core from the
    # peer and the input threads when ranks share cores: 2 ranks on 2 cores trained at
    # 0.95x shm that way, and at or above shm yielding (docs/benchmarks.md, "Speed on this machine").
    # Each rank reads OMPI_MCA_* at MPI_Init, so this reaches mpirun and srun launches
    # alike; a value the user set wins.
    os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError) as error:   # mpi4py without a loadable libmpi
        raise UsageError(f"--collective=mpi: mpi4py {mpi4py.__version__} is installed but "
                         f"cannot load an MPI library ({error}). {INSTALL_HINT}.") from None
    if not MPI.Is_initialized():
        initialise_releasing_the_gil(MPI)
    provided = MPI.Query_thread()
    if provided < MPI.THREAD_SERIALIZED:
        raise UsageError(f"--collective=mpi: this MPI library ({library_version(MPI)}) provides "
                         f"thread level {provided}, but TensorFlow calls MPI from its own "
                         f"threads, which needs MPI_THREAD_SERIALIZED or more.")
    return MPI


def initialise_releasing_the_gil(MPI) -> None:
    """MPI_Init_thread(MULTIPLE) called through ctypes, which releases the GIL.

    Why: MPI_Init waits for every rank (PMIx's fence), and mpi4py's own initialisation
    (at import, or MPI.Init_thread) holds the GIL meanwhile, so with a rank dead or
    stuck at start-up the watchdog thread could never run and the others hung for
    good (seen under mpirun with one rank stopped before MPI_Init). The symbol is
    looked up through mpi4py's extension module, which links the MPI library it uses.
    """
    import ctypes
    try:
        init_thread = ctypes.CDLL(MPI.__file__).MPI_Init_thread
    except (OSError, AttributeError):   # not a shared object we can open: initialise as mpi4py does
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
        return
    provided = ctypes.c_int(0)
    code = init_thread(None, None, ctypes.c_int(MPI.THREAD_MULTIPLE), ctypes.byref(provided))
    if code != 0:
        raise ClusterError(f"MPI_Init_thread failed with error code {code}.")


def library_version(MPI) -> str:
    """MPI_Get_library_version's first line, up to its build details ("Open MPI v5.0.11",
    "MPICH Version: 4.2.0")."""
    first = MPI.Get_library_version().strip().splitlines()[0]
    return " ".join(first.split(", package:")[0].split())


class World:
    """This process's MPI world and the TF cluster formed from it."""

    def __init__(self, MPI, comm, tf_config: cluster.TFConfig, launcher: str):
        self.MPI, self.comm, self.tf_config, self.launcher = MPI, comm, tf_config, launcher
        self.rank, self.size = comm.Get_rank(), comm.Get_size()


def join_world(env: Mapping[str, str]) -> World:
    """Initialises MPI (the caller bounds the wait with its watchdog) and forms the TF
    cluster from the world, or checks the TF_CONFIG that is also set against it."""
    require_launch(env)
    MPI = load_mpi()
    comm = MPI.COMM_WORLD
    check_world_size(comm.Get_size(), env)
    if env.get("TF_CONFIG"):
        tf_config = checked_tf_config(cluster.parse_tf_config(env["TF_CONFIG"]), comm)
    else:
        tf_config = tf_config_from_world(MPI, comm)
    log.info("collective mpi: rank %d of %d (%s, %s)", comm.Get_rank(), comm.Get_size(),
             launcher_of(env), library_version(MPI))
    return World(MPI, comm, tf_config, launcher_of(env))


def launched_size(env: Mapping[str, str]) -> Optional[tuple]:
    """(variable, number of processes) the launcher says it started, if it says."""
    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS"):
        if cluster.decimal(env.get(name)) is not None:
            return name, int(env[name])
    return None


def check_world_size(size: int, env: Mapping[str, str]) -> None:
    """The MPI world must hold every process the launcher started: an MPI library that
    cannot talk to the launcher (srun --mpi=pmi2 with Open MPI 5, which speaks PMIx
    only) makes each process a world of its own, and each would train alone as chief."""
    launched = launched_size(env)
    if launched is not None and launched[1] != size:
        name, count = launched
        raise UsageError(
            f"--collective=mpi: the launcher started {count} processes ({name}={count}), but "
            f"MPI formed a world of {size}: this MPI library cannot talk to the launcher. "
            f"Under Slurm, use srun --mpi=pmix with Open MPI (`srun --mpi=list` shows what "
            f"Slurm offers; pmi2 suits MPICH); else start the ranks with this MPI's own mpirun.")


def checked_tf_config(tf_config: cluster.TFConfig, comm) -> cluster.TFConfig:
    """A TF_CONFIG set beside an MPI launch must describe the same world, rank for rank:
    otherwise TF's cluster and MPI's would pair different processes."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if tf_config.num_workers != size:
        raise UsageError(f"--collective=mpi: the MPI world has {size} rank(s), but TF_CONFIG "
                         f"names {tf_config.num_workers} worker(s) ({', '.join(tf_config.worker_addresses)}). "
                         f"Unset TF_CONFIG (tfdist forms the cluster from the MPI world), or "
                         f"launch {tf_config.num_workers} ranks.")
    if tf_config.rank != rank:
        raise UsageError(f"--collective=mpi: this process is MPI rank {rank}, but its TF_CONFIG "
                         f"says task {tf_config.task_type}:{tf_config.task_index} (worker rank "
                         f"{tf_config.rank}). Unset TF_CONFIG, or give rank r the task index r.")
    return tf_config


def tf_config_from_world(MPI, comm) -> cluster.TFConfig:
    """Rank r -> worker r at its host and a free port, exchanged over MPI."""
    hosts = comm.allgather(MPI.Get_processor_name())
    one_host = len(set(hosts)) == 1
    address = "127.0.0.1" if one_host else hosts[comm.Get_rank()]
    probe = hold_free_port(address)
    try:
        ports = comm.allgather(probe.getsockname()[1])   # held open: no two ranks share one
    finally:
        probe.close()
    addresses = [cluster.join_address("127.0.0.1" if one_host else host, port)
                 for host, port in zip(hosts, ports)]
    return cluster.parse_tf_config(cluster.build_tf_config(addresses, comm.Get_rank()))


def hold_free_port(host: str) -> socket.socket:
    """A socket bound to a free port of `host` (its own address only), left open."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    probe = socket.socket(family, socket.SOCK_STREAM)
    try:
        probe.bind((host, 0))
    except OSError as error:
        probe.close()
        raise ClusterError(f"MPI rank on host {host!r}: cannot bind a port there for TensorFlow's "
                           f"server ({error.strerror or error}). Check that the host name MPI "
                           f"reports resolves to this machine.") from None
    return probe


class MpiAllReduce:
    """Sums arrays over the MPI world in place (float32, or float64 if any is: mpi4py
    takes the MPI datatype from the buffer's); see the module docstring."""

    def __init__(self, world: World):
        self.MPI, self.comm = world.MPI, world.comm
        self.rank, self.size = world.rank, world.size
        self._layout: Optional[BufferLayout] = None
        self._buffer: Optional[np.ndarray] = None

    def all_reduce_arrays(self, *arrays: np.ndarray) -> List[np.ndarray]:
        """The sums, as views of one buffer: valid until this rank's next call."""
        layout = BufferLayout.of(arrays)
        buffer = self._buffer_for(layout)
        layout.pack(arrays, buffer)
        self.comm.Allreduce(self.MPI.IN_PLACE, buffer, op=self.MPI.SUM)
        return layout.unpack(buffer)

    def all_reduce(self, values: np.ndarray) -> np.ndarray:
        """A new array: the element-wise sum of a small float32 vector (agreements)."""
        values = np.ascontiguousarray(values, np.float32)
        total = np.empty_like(values)
        self.comm.Allreduce(values, total, op=self.MPI.SUM)
        return total

    def _buffer_for(self, layout: BufferLayout) -> np.ndarray:
        if layout is not self._layout:
            self._check_same_layout(layout)
            self._layout, self._buffer = layout, layout.empty()
        return self._buffer

    def _check_same_layout(self, layout: BufferLayout) -> None:
        digests = self.comm.allgather(layout.digest)
        differing = [rank for rank, digest in enumerate(digests) if digest != digests[0]]
        if differing:
            ranks = ("rank " if len(differing) == 1 else "ranks ") + ", ".join(map(str, differing))
            raise ClusterError(
                f"MPI rank {self.rank} of {self.size}: {ranks} "
                f"sum other gradient shapes than rank 0 (this rank: {len(layout.shapes)} "
                f"arrays, {layout.length} floats). Start every rank with the same model "
                f"and flags.")

    def close(self) -> None:
        self._layout = self._buffer = None


def finalize() -> None:
    """MPI_Finalize, if this process initialised MPI, before an os._exit (which skips
    mpi4py's own at-exit finalisation): Open MPI counts a rank that exits without it,
    even with status 0, as an abnormal end and fails the job (mpirun exits 1), and under
    srun Slurm's PMIx plugin kills the job step (exit 137). Only for an end every rank
    reaches together, since Finalize waits for them: a finished run, or a preemption
    after the ranks agreed on its step."""
    import sys
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()


def describe_installation() -> List[str]:
    """Lines for `tfdist doctor`: mpi4py, the MPI library and its launcher, without
    initialising MPI (so the doctor never starts a world)."""
    try:
        import mpi4py
    except ImportError:
        return [f"  mpi4py: not installed (--collective=mpi needs it: {INSTALL_HINT})"]
    mpi4py.rc.initialize = False
    try:
        from mpi4py import MPI
        version = library_version(MPI)
    except (ImportError, RuntimeError) as error:
        return [f"  mpi4py {mpi4py.__version__}: cannot load an MPI library ({error})"]
    import shutil
    launchers = [f"{name} ({shutil.which(name)})" for name in ("mpirun", "mpiexec", "srun")
                 if shutil.which(name)]
    standard = "%d.%d" % MPI.Get_version()
    return [f"  mpi4py: {mpi4py.__version__}",
            f"  MPI library: {version} (MPI {standard})",
            f"  launchers on PATH: {', '.join(launchers) or 'none (mpirun, mpiexec, srun)'}",
            f"  this process: {launcher_of(os.environ) or 'not under an MPI launch'}"]
