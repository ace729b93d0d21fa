"""Plain, frozen configuration for one run, validated when it is built.

Validation happens here, before TensorFlow is imported or any device is touched,
so a user mistake costs milliseconds and reads as one paragraph. Checks that need
the device count (batch divisibility) live in `tfdist.parallel`, still before any
model is built.
"""

import dataclasses
import os
import tempfile
from typing import Optional, Tuple

from tfdist.errors import UsageError, require

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")   # the planner's, with fixed slot counts
# --optimizer: tfdist's "momentum" (SGD with 0.9) and every Keras 3.15 optimizer by its
# identifier (keras.optimizers.get); kept as names so validation needs no Keras import.
KERAS_OPTIMIZERS = ("adadelta", "adafactor", "adagrad", "adam", "adamax", "adamw", "ftrl",
                    "lamb", "lion", "muon", "nadam", "rmsprop", "sgd")
TRAINING_OPTIMIZERS = tuple(sorted(set(KERAS_OPTIMIZERS) | {"momentum"}))
MIXED_PRECISION = ("mixed_bfloat16", "mixed_float16")
CROSS_DEVICE_OPS = ("auto", "nccl", "hierarchical_copy", "reduction_to_one_device")
COLLECTIVES = ("fastest", "auto", "ring", "nccl", "tcp", "shm", "mpi")
SHARDING = ("auto", "file", "data")
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
INTERLEAVED = "interleaved_1f1b"   # the one schedule with --virtual_stages
TRAINERS = ("loop", "fit")
BATCH_STATISTICS = ("global", "per_replica")   # tfdist/train/batch_stats.py
# Keras' RematScope mode names (tfdist/train/remat.py applies them to a built model)
REMAT_MODES = ("full", "activations", "larger_than", "list_of_layers")
# Sharded data parallelism (ZeRO, Rajbhandari et al. 2020): 0 replicates everything; 1 shards
# the optimizer state over the data-parallel devices, 2 the gradients too, 3 the parameters too
ZERO_STAGES = (0, 1, 2, 3)
AUTO = -1


def _positive(name: str, value, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    bound = ">= 0" if allow_zero else "> 0"
    require(ok, f"--{name} must be {bound}, got {value}.")


def validate_zero_stage(stage) -> int:
    require(type(stage) is int and stage in ZERO_STAGES,
            f"Unknown --zero_stage {stage!r}. Valid choices: {', '.join(map(str, ZERO_STAGES))} "
            f"(0 replicates; 1 shards the optimizer state, 2 also the gradients, 3 also the "
            f"parameters).")
    return stage


def _one_of(name: str, value, choices) -> None:
    require(value in choices,
            f"Unknown --{name} {value!r}. Valid choices: {', '.join(map(str, choices))}.")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    name: str = "digits"
    data_dir: Optional[str] = None        # tfds data dir; default $TFDS_DATA_DIR or ~/tensorflow_datasets
    seq_len: int = 64                     # text: characters per window
    synthetic_shape: Tuple[int, ...] = (28, 28, 1)
    synthetic_classes: int = 10
    synthetic_examples: int = 8192
    shuffle_buffer: int = 0               # 0: the whole training split (capped, see pipeline)
    prefetch: int = AUTO                  # batches to prefetch; -1 lets tf.data tune it
    sharding: str = "auto"                # auto: file-level when files divide over workers

    def __post_init__(self):
        from tfdist.data import names
        names.validate_name(self.name)
        _positive("seq_len", self.seq_len)
        _positive("synthetic_classes", self.synthetic_classes)
        _positive("synthetic_examples", self.synthetic_examples)
        _positive("shuffle_buffer", self.shuffle_buffer, allow_zero=True)
        require(self.prefetch >= AUTO, f"--prefetch must be >= -1, got {self.prefetch}.")
        _one_of("sharding", self.sharding, SHARDING)
        require(len(self.synthetic_shape) > 0 and all(d > 0 for d in self.synthetic_shape),
                f"--synthetic_shape must be positive sizes, got {self.synthetic_shape}.")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    name: str = "mlp"
    hidden_sizes: Tuple[int, ...] = (100, 50)   # mlp
    filters: Tuple[int, ...] = (32, 64)         # cnn conv widths; resnet stage widths
    num_layers: int = 2                         # transformer blocks
    d_model: int = 64
    num_heads: int = 4
    d_ff: int = 256

    def __post_init__(self):
        from tfdist import models, user_code
        if user_code.is_user_code_spec(self.name):   # --model=MODULE:FUNCTION, loaded at run time
            user_code.split_spec(self.name, "--model")
        else:
            models.MODELS.validate(self.name)
        for size in self.hidden_sizes + self.filters:
            _positive("hidden_sizes/filters", size)
        for name in ("num_layers", "d_model", "num_heads", "d_ff"):
            _positive(name, getattr(self, name))
        require(self.d_model % self.num_heads == 0,
                f"--d_model ({self.d_model}) must be divisible by --num_heads ({self.num_heads}).")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    strategy: str = "mirrored"
    simulate_devices: int = AUTO      # -1: 2 logical CPUs when there is no GPU; 0: don't split
    num_gpus: int = AUTO              # -1: all visible GPUs
    cross_device_ops: str = "auto"
    num_packs: int = 1
    collective: str = "fastest"       # multi_worker_mirrored all-reduce; fastest: tfdist picks
    bytes_per_pack: int = 0           # 0: TF decides how to pack gradients
    collective_timeout: int = 300     # seconds: joining peers, collectives, dead-peer detection
    mesh: Optional[str] = None        # dtensor: "batch=2,model=2"; None: all devices on batch
    layout: str = "data"              # dtensor: data, megatron, or a JSON/.py layout file
    layout_strict: bool = False       # dtensor: unmatched variables are an error, not replicated
    pipeline_stages: int = 2          # pipeline: stages (devices per model replica)
    microbatches: int = 1             # pipeline: micro-batches per replica batch
    pipeline_split: Optional[Tuple[str, ...]] = None  # pipeline: layer names that start stages 2..S
    pipeline_schedule: str = "gpipe"  # pipeline: gpipe, 1f1b, interleaved_1f1b, zero_bubble
    virtual_stages: int = 1           # pipeline, interleaved_1f1b: model chunks per device
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    global_batch_size: int = 64
    train_steps: int = 0              # 0: use epochs
    epochs: int = 0                   # 0 with train_steps 0: DEFAULT_EPOCHS
    learning_rate: Optional[float] = None   # None: DEFAULT_LEARNING_RATES[optimizer]
    optimizer: str = "adam"
    loss: Optional[str] = None        # a Keras loss identifier; None: the registry's (logits)
    metrics: Optional[Tuple[str, ...]] = None   # Keras metric identifiers; None: registry's
    save_model: Optional[str] = None  # PATH.keras of the trained model (the chief writes it)
    export_dir: Optional[str] = None  # a SavedModel of it for serving (the chief writes it)
    seed: int = 0
    model_dir: Optional[str] = None
    checkpoint_every: int = 0         # steps; 0: only at the end and on SIGTERM (needs model_dir)
    keep_checkpoints: int = 3
    results_json: Optional[str] = None
    eval_every: int = 0               # steps; 0: evaluate once at the end
    log_every: int = 50               # steps between log lines and TensorBoard scalars
    profile_steps: Optional[Tuple[int, int]] = None
    mixed_precision: Optional[str] = None
    jit_compile: bool = False
    trainer: str = "loop"             # "loop": tfdist's loop; "fit": Keras model.fit
    # data parallel: BatchNormalization by the global batch's statistics (one device's
    # math) or each replica's own ("per_replica": cheaper, not exact); train/batch_stats.py
    batch_statistics: str = "global"
    # K micro-batches of each global batch, their gradients summed, one optimizer update
    # (train/accumulation.py); 1: the whole batch at once
    accumulation_steps: int = 1
    # activation recomputation (train/remat.py), Keras' RematScope mode names; None: none
    remat: Optional[str] = None
    remat_layers: Tuple[str, ...] = ()   # --remat=list_of_layers: the layers' names
    remat_threshold: int = 1024          # --remat=larger_than: values per example
    # sharded data parallelism (parallel/dtensor/zero.py): ZERO_STAGES; 0 replicates
    zero_stage: int = 0

    def __post_init__(self):
        from tfdist import parallel
        parallel.MODES.validate(self.strategy)
        _one_of("optimizer", self.optimizer, TRAINING_OPTIMIZERS)
        _one_of("cross_device_ops", self.cross_device_ops, CROSS_DEVICE_OPS)
        _one_of("trainer", self.trainer, TRAINERS)
        _one_of("batch_statistics", self.batch_statistics, BATCH_STATISTICS)
        self._validate_accumulation()
        self._validate_remat()
        validate_zero_stage(self.zero_stage)
        if self.mixed_precision is not None:
            _one_of("mixed_precision", self.mixed_precision, MIXED_PRECISION)
        require(self.simulate_devices >= AUTO,
                f"--simulate_devices must be >= 0 (or -1 for auto), got {self.simulate_devices}.")
        require(self.num_gpus >= AUTO, f"--num_gpus must be >= 0 (or -1 for all), got {self.num_gpus}.")
        _positive("num_packs", self.num_packs)
        _one_of("collective", self.collective, COLLECTIVES)
        _positive("bytes_per_pack", self.bytes_per_pack, allow_zero=True)
        _positive("collective_timeout", self.collective_timeout)
        _positive("pipeline_stages", self.pipeline_stages)
        _positive("microbatches", self.microbatches)
        _one_of("pipeline_schedule", self.pipeline_schedule, PIPELINE_SCHEDULES)
        validate_pipeline_schedule(self.pipeline_schedule, self.pipeline_stages,
                                   self.microbatches, self.virtual_stages)
        _positive("global_batch_size", self.global_batch_size)
        _positive("train_steps", self.train_steps, allow_zero=True)
        _positive("epochs", self.epochs, allow_zero=True)
        require(not (self.train_steps and self.epochs),
                f"Give --train_steps ({self.train_steps}) or --epochs ({self.epochs}), not both.")
        if self.learning_rate is None:
            object.__setattr__(self, "learning_rate",
                               DEFAULT_LEARNING_RATES.get(self.optimizer, KERAS_DEFAULT_RATE))
        require(self.learning_rate > 0, f"--learning_rate must be > 0, got {self.learning_rate}.")
        _positive("eval_every", self.eval_every, allow_zero=True)
        _positive("log_every", self.log_every)
        _positive("checkpoint_every", self.checkpoint_every, allow_zero=True)
        _positive("keep_checkpoints", self.keep_checkpoints)
        self._validate_profile_steps()
        if self.model_dir:
            check_writable_dir(self.model_dir, "--model_dir")
        if self.results_json:
            check_writable_dir(os.path.dirname(os.path.abspath(self.results_json)), "--results_json")
        if self.save_model:
            require(self.save_model.endswith(".keras"),
                    f"--save_model writes a Keras v3 file, whose name ends in .keras; got "
                    f"{self.save_model!r}.")
            check_writable_dir(os.path.dirname(os.path.abspath(self.save_model)), "--save_model")
        if self.export_dir:
            check_writable_dir(os.path.dirname(os.path.abspath(self.export_dir)), "--export_dir")

    def _validate_accumulation(self):
        _positive("accumulation_steps", self.accumulation_steps)
        require(self.accumulation_steps == 1 or self.trainer == "loop",
                f"--accumulation_steps={self.accumulation_steps} works with --trainer=loop "
                f"(tfdist's step splits the batch); got --trainer={self.trainer}, whose Keras "
                f"fit steps take the batch whole. Use --trainer=loop.")

    def _validate_remat(self):
        object.__setattr__(self, "remat_layers", tuple(self.remat_layers or ()))
        if self.remat is not None:
            _one_of("remat", self.remat, REMAT_MODES)
        require((self.remat == "list_of_layers") == bool(self.remat_layers),
                f"--remat_layers={','.join(self.remat_layers)!r} goes with "
                f"--remat=list_of_layers, and that mode needs it; got --remat={self.remat!r}.")
        _positive("remat_threshold", self.remat_threshold)

    def _validate_profile_steps(self):
        if self.profile_steps is None:
            return
        start, stop = self.profile_steps
        require(1 <= start <= stop,
                f"--profile_steps must be START,STOP with 1 <= START <= STOP, got {start},{stop}.")
        require(self.model_dir, "--profile_steps needs --model_dir (the trace is written under it).")


def validate_pipeline_schedule(schedule: str, stages: int, microbatches: int,
                               virtual_stages: int) -> None:
    """--virtual_stages and the interleaved schedule's micro-batch rule (pure Python: the
    config and PipelineParallelism both check it, before anything is built)."""
    _positive("virtual_stages", virtual_stages)
    require(virtual_stages == 1 or schedule == INTERLEAVED,
            f"--virtual_stages={virtual_stages} only applies to --pipeline_schedule={INTERLEAVED}"
            f" (got --pipeline_schedule={schedule}, which runs one model chunk per device). Use "
            f"--pipeline_schedule={INTERLEAVED}, or drop --virtual_stages.")
    # Megatron-LM's rule: its interleaved order takes the micro-batches in groups of S.
    require(schedule != INTERLEAVED or microbatches % stages == 0,
            f"--pipeline_schedule={INTERLEAVED} needs --microbatches to be a multiple of "
            f"--pipeline_stages (Megatron-LM's interleaved schedule runs the micro-batches in "
            f"groups of one per stage); got --microbatches={microbatches} with "
            f"--pipeline_stages={stages} (--virtual_stages={virtual_stages}). Use --microbatches="
            f"{_multiples(stages, microbatches)}, or --pipeline_schedule=1f1b (any number of "
            f"micro-batches; interleaved_1f1b with --virtual_stages=1 is exactly 1f1b).")


def _multiples(stages: int, microbatches: int) -> str:
    below = (microbatches // stages) * stages
    return " or ".join(str(m) for m in (below, below + stages) if m > 0)


DEFAULT_EPOCHS = 20
DEFAULT_LEARNING_RATES = {"sgd": 0.1, "momentum": 0.05, "adam": 1e-3, "adamw": 1e-3}
KERAS_DEFAULT_RATE = 1e-3   # the other Keras optimizers: Keras' own default for most


def check_writable_dir(path: str, flag: str) -> None:
    """Creates `path` if needed and proves it is writable, or raises UsageError."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".tfdist-write-check"):
            pass
    except OSError as error:
        raise UsageError(f"{flag} {path!r} is not a writable directory: "
                         f"{error.strerror or error}.") from None


def parse_ints(text: str, flag: str) -> Tuple[int, ...]:
    """Parses "100,50" into (100, 50) with a clear error."""
    try:
        return tuple(int(part) for part in str(text).split(",") if part.strip())
    except ValueError:
        raise UsageError(f"--{flag} must be comma-separated integers, got {text!r}.") from None
