"""The run config's schema: every section as a dataclass (its keys, types, defaults and
what each means), and `validate`, the cross-field rules every load must pass.

Why our own layer instead of torchtitan's CLI: torchtitan 0.3.0 builds its `Trainer.Config`
from Python registry functions plus tyro flags, which is great for torchtitan developers but
leaves a user with no file to read, diff or resume from. A run here is one TOML file that
says everything (model shape, FP8 recipe, data mix, parallelism, checkpointing), is checked
strictly (an unknown key or a wrong type stops the run with the file, the dotted key and the
closest valid key), and is written back fully resolved to `RUN/config.toml` so export, eval
and a resume all read the same truth.

`validate` checks the cross-field rules every load must pass (`train.config.reader.from_dict`
calls it). The rules that also need the world size (degrees, heads vs tp, seq_len vs tp/cp,
the batch vs the data-parallel degree) are not here: they are
`train.launch_rules.check_launch`, which `python -m train` calls before torch is imported
(a launch and `--check` through `train.preflight`, and before a dry run), as do the SLURM
submitter and the quickstart; torchtitan's `Trainer` checks the same again when it is built.

The reader of a TOML file (`extends`, overrides, strict keys) is `train.config.reader`, as
torchtitan keeps its schema (`config/configs.py`) apart from its parsing
(`config/manager.py`). Neither imports torch nor torchtitan (eval and the SLURM helpers read
configs without them). The mapping onto torchtitan's `Trainer.Config` is `train.build`;
"auto" values are resolved there, so the saved config stays portable between machines.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from dataloader.common import MixEntry


class ConfigError(ValueError):
    """A user error in a run config: the message names the file, the key and the fix."""


# --------------------------------------------------------------------------- sections


@dataclass
class JobConfig:
    folder: str = "runs/default"
    """The run folder RUN: config.toml, checkpoint/, tb/, metrics.jsonl live here."""
    description: str = ""


@dataclass
class ModelConfig:
    """A Llama-3-style decoder (the contract's `ModelConfig`)."""

    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    vocab_size: int = 2048
    ffn_hidden_dim: int = 768
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: bool = True
    """Llama 3.1-style frequency scaling of RoPE (factor 8, original context 8192)."""
    max_seq_len: int = 131072
    """Longest sequence RoPE is defined for; training.seq_len must not exceed it."""
    attention: Literal["auto", "flex", "sdpa", "varlen"] = "auto"
    """auto: FlexAttention on GPU, DocumentMaskedSDPA on CPU; both causal within each
    document (torchtitan's mask from the loader's positions; see cpu_compat #6)."""
    weight_tying: bool = False
    """Share the embedding and lm_head weights (Llama 3.2 1B/3B do)."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


@dataclass
class Fp8Config:
    enable: bool = False
    recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8"] = "rowwise"
    """tensorwise: one scale per tensor (fastest, FP8 FSDP all-gather); rowwise: per-row
    scales (more robust); rowwise_with_gw_hp: rowwise, weight gradient GEMM in bf16;
    mxfp8: refused before launch on every device for now (train/compat/amd_compat.py)."""
    format: Literal["auto", "fn", "fnuz"] = "auto"
    """The FP8 encoding: auto = the GPU's (fnuz on AMD gfx942, MI300X/MI325X; fn on NVIDIA,
    gfx950 and CPU; common/fp8_formats.py). A forced one must match the GPU; on CPU either
    trains (tests). A resume in another format passes a loss-continuity check first."""
    filter_fqns: list[str] = field(default_factory=lambda: ["lm_head"])
    """Module names (substring match) kept in high precision; lm_head is the usual one."""
    auto_filter_small_kn: bool = False
    """Also skip linears too small to gain from FP8 (torchao's per-recipe size thresholds;
    rowwise and tensorwise only)."""
    allow_no_conversion: bool = False
    """An FP8 run whose filters leave no linear in float8 is refused at start-up; true
    accepts it (it then trains in high precision)."""
    fsdp_float8_all_gather: bool = True
    """All-gather FP8 weights under FSDP (tensorwise only; ignored for rowwise recipes)."""
    emulate: bool = False
    """Compute in high precision while emulating FP8 casts (debugging only; no compile)."""
    stats_freq: int = 0
    """Every this many steps record FP8 numerics per linear (amax, scale, underflow and
    saturation shares, GEMM error; train/components/fp8_stats.py); 0: off. A multiple of metrics.log_freq."""
    stats_underflow_warn: float = 0.01
    """Warn, naming the linear, when a share of an operand above this flushes to zero."""
    stats_saturation_warn: float = 0.001
    """Warn, naming the linear, when a share of an operand above this is clamped."""
    stats_sample_rows: int = 16
    """Input rows whose FP8 GEMM output is compared with the high-precision one."""


@dataclass
class SchedulePhase:
    start_step: int
    """First optimizer step (1-based) trained with these weights and/or this seq_len."""
    weights: list[float] = field(default_factory=list)
    """One weight per [[dataloader.mix]] entry, in mix order (0 drops a dataset); empty or
    omitted: the weights in force stay."""
    seq_len: int = 0
    """Sequence length from this step on (0: unchanged). Exactly once per token; a change
    drops at most the rest of one shuffle group per dataset, counted (docs/dataloader.md)."""


@dataclass
class DataloaderConfig:
    tokenizer: str = "data/shakespeare/tokenizer"
    """Tokenizer folder (tokenizer.json + tokenizer_config.json) the data was made with."""
    seed: int = 1234
    mix: list[MixEntry] = field(default_factory=list)
    schedule: list[SchedulePhase] = field(default_factory=list)
    """[[dataloader.schedule]]: new mix weights from a step on (anneal, curriculum)."""
    allow_dataset_change: bool = False
    """Resume onto data whose fingerprint differs from the checkpoint's (normally refused)."""
    block_tokens: int = 131072
    """Shuffle block: windows never cross one, so every seq_len must be <= block_tokens."""
    shuffle_blocks: int = 1024
    """Blocks whose windows are shuffled together; a seq_len change drops at most the rest
    of one such group per dataset (< shuffle_blocks x block_tokens tokens, counted)."""
    skip_sequences: list[list[int]] = field(default_factory=list)
    """[start, end) ranges of global sequences never trained on (drawn and dropped, the
    stream after them unchanged). A loss-spike rollback records its own in
    RUN/incidents.jsonl, which a resume reads; list them here to make a run that never
    saw them (e.g. a reference for a rolled-back run)."""


@dataclass
class ValidationConfig:
    enable: bool = True
    freq: int = 50
    """Validate every `freq` steps (and at step 1)."""
    steps: int = 10
    """Fixed number of validation batches, identical on every rank; -1: one pass of the
    val split (torchtitan's validator)."""
    mix: list[MixEntry] = field(default_factory=list)


@dataclass
class TrainingConfig:
    steps: int = 100
    seq_len: int = 256
    local_batch_size: int = 4
    """Sequences per data-parallel rank per micro-step."""
    global_batch_size: int = -1
    """Sequences per optimizer step over all ranks; -1 = local_batch_size x DP degree.
    Set it to keep the optimisation identical when resuming on fewer ranks (the missing
    ranks become gradient-accumulation micro-steps)."""
    max_norm: float = 1.0
    param_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """FSDP mixed-precision parameter dtype; auto: bfloat16 on GPU, float32 on CPU."""
    seed: int = 42
    deterministic: bool = False
    gc_freq: int = 50
    loss_chunks: int = 8
    """The loss over the logits in this many sequence chunks (torchtitan's
    `ChunkedLossWrapper`: the [batch, seq, vocab] logits are never held whole); 0: the
    whole logits at once (torchtitan's `CrossEntropyLoss`, as torchtitan trained before the
    wrapper and as the published runs the planner is calibrated on did: several GiB more
    at 8K tokens and a 128K vocabulary). The dry run plans the loss this key picks."""


@dataclass
class OptimizerConfig:
    name: Literal["AdamW", "Adam"] = "AdamW"
    lr: float = 8e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1


@dataclass
class LRSchedulerConfig:
    warmup_steps: int = 200
    decay_ratio: float = 0.8
    """Fraction of training spent decaying at the end (WSD schedule); 1.0 = decay after warmup."""
    decay_type: Literal["linear", "sqrt", "cosine"] = "cosine"
    min_lr_factor: float = 0.1


@dataclass
class ParallelismConfig:
    dp_replicate: int = 1
    dp_shard: int = -1
    """FSDP degree; -1 = whatever is left of the world size after the other degrees."""
    tp: int = 1
    cp: int = 1
    enable_sequence_parallel: bool = True
    spmd_backend: Literal["auto", "partial_dtensor", "full_dtensor", "spmd_types"] = "auto"
    """auto: partial_dtensor when dp_shard, tp or cp > 1 (any device), else spmd_types."""
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    context_parallel_load_balancer: Literal["ptrr", "headtail", "none"] = "ptrr"
    """How CP splits a sequence over its ranks (torchtitan's option of the same name, whose
    default is headtail): ptrr deals 128-token query blocks by their attention work read off
    the document block mask; headtail pairs chunks from both ends (even for one causal
    document, not for packed ones); none cuts contiguous shards. Measured on packed
    documents: docs/bench/cp_balance-2026-11-24.md."""


@dataclass
class CheckpointConfig:
    enable: bool = True
    interval: int = 100
    keep_last: int = 3
    """Keep this many newest complete checkpoints (0 = keep all)."""
    async_mode: Literal["auto", "disabled", "async", "async_with_pinned_mem"] = "auto"
    """auto: async_with_pinned_mem (DCP's checkpoint daemon writes; any device)."""
    last_save_model_only: bool = False
    """False keeps the final checkpoint resumable (optimizer + data state included)."""
    export_dtype: Literal["float16", "bfloat16", "float32"] = "float32"
    initial_load_path: str = ""
    """Start a new run from these weights: a step-N folder, or a Hugging Face Llama folder
    (config.json + safetensors, checked against [model]; train/components/hf_import.py); ignored once
    RUN has checkpoints."""
    storage_gb_per_s: float = 5.0
    """The checkpoint filesystem's write bandwidth (GB/s, all ranks together), until the run
    has measured its own: the plan's save time (`--dry-run`), SLURM's signal lead and the
    end-in-time margin before the first save (train/reliability/time_limit.py) use it. 5 is
    an assumption; a single NFS server gives about 1. After each save the run logs the rate
    it measured and keeps it in RUN/save_rate.json, which then replaces this figure."""


@dataclass
class ActivationCheckpointConfig:
    mode: Literal["none", "selective", "full"] = "none"


@dataclass
class CompileConfig:
    enable: bool = False
    components: list[str] = field(default_factory=lambda: ["model", "loss"])
    async_tp: bool = False
    """Overlap TP communication with GEMMs (needs compile and tp > 1; GPU only)."""


@dataclass
class MetricsConfig:
    log_freq: int = 10
    tensorboard: bool = True


@dataclass
class CommConfig:
    """Collective timeouts of every mesh group: floors, raised to outlast the watchdog's
    windows (train/reliability/budgets.py)."""

    init_timeout_seconds: int = 300
    """Up to the end of the first step (and the floor of a compile window)."""
    train_timeout_seconds: int = 100
    """In training (torchtitan sets it after the first step)."""


@dataclass
class HealthConfig:
    """Non-finite steps, stragglers and loss spikes (train.reliability.health,
    train.reliability.rollback; docs/reliability.md)."""

    max_consecutive_nonfinite: int = 5
    """Each step with a NaN/Inf loss or gradient is skipped; this many in a row stop the run."""
    straggler_factor: float = 1.5
    """Warn when a rank's step time is at least this many times the mean of the others..."""
    straggler_window: int = 20
    """...in each of this many consecutive steps (at most one warning per window)..."""
    straggler_min_lag_s: float = 0.05
    """...and lags by at least this many seconds (ignores noise on tiny steps)."""
    spike_rollback: bool = False
    """Roll back on a loss spike: to the last complete checkpoint before it, skipping
    exactly the data consumed since (docs/reliability.md). The rule, on the loss reduced
    over all ranks every step: loss > mean + max(spike_sigmas x std, spike_min_rise) of the
    last spike_window accepted steps, in spike_steps consecutive steps."""
    spike_window: int = 100
    """Steps of loss history the mean and standard deviation are taken over."""
    spike_warmup: int = 20
    """Steps of history needed before any step is judged (again after each resume)."""
    spike_sigmas: float = 6.0
    """How many standard deviations above the mean a spiking loss is..."""
    spike_min_rise: float = 0.1
    """...and by at least this much (nats), so a flat, quiet loss does not trip the rule."""
    spike_steps: int = 1
    """Consecutive spiking steps that make a spike (the last one's update is not applied)."""
    max_rollbacks: int = 3
    """Rollbacks allowed over the run's life (RUN/incidents.jsonl); the next spike stops
    the run with one line, exit 4 and RUN/diverged.json."""
    rollback_lr_factor: float = 1.0
    """After a rollback, multiply the learning rate by this..."""
    rollback_lr_steps: int = 0
    """...for this many steps after the checkpoint rolled back to (0: LR unchanged)."""
    inject_faults: list[str] = field(default_factory=list)
    """TESTS ONLY, never in a config: "sleep rank=R seconds=S", "nan steps=A-B [rank=R]",
    "spike sequences=A-B factor=F"."""


@dataclass
class FaultToleranceConfig:
    hang_timeout_s: float = 80
    """Seconds without progress before a rank dumps its stacks, names the stalled rank and
    exits (train/reliability/watchdog.py); 0 disables. The floor of every watchdog window: a micro-batch
    may take 3x its time predicted by the plan's RUN/budgets.json, at least this
    (train/reliability/budgets.py). Keep it above the slowest validation batch. A checkpoint save gets
    more (next key); the first micro-batch after a start or at a new seq_len and the first
    validation batch get [comm] init_timeout_seconds (compilation). The collective timeouts
    follow the windows (each + 60 s), so the watchdog speaks first."""
    min_save_gb_per_s: float = 0.5
    """The slowest write bandwidth of the checkpoint filesystem (GB/s, all ranks together)
    that still counts as progress: a checkpoint save may take hang_timeout_s plus its size
    (model + optimizer state) at this rate before it is called a hang. 0.5 GB/s gives the
    70B final save (~850 GB) 28 min; raise it to catch a stuck save sooner on fast storage."""


@dataclass
class ReplicaGroupsConfig:
    """torchft replica groups (train/replica_groups/, docs/reliability.md): the run is
    `groups` copies of the layout the world size gives, each its own torchrun, whose
    gradients torchft's Lighthouse-coordinated quorum averages; a group that dies is
    dropped at the next step and heals from a live peer when it comes back."""

    groups: int = 0
    """How many replica groups train this run (0: off, one torchrun is the whole run). Each
    group is a launch of its own (`scripts/train_local.sh --replica-groups N`, SLURM's
    `--replica-groups N`); the world size of a launch is one group's."""
    min_groups: int = 0
    """The fewest live groups that form a quorum and commit a step (the Lighthouse's
    min_replicas, torchft's min_replica_size). 0: a majority, groups // 2 + 1, so that two
    quorums can never train at once (groups starting at different times, a partition);
    fewer trains on with fewer groups at the risk of such a split."""
    down_policy: Literal["shrink", "accumulate"] = "shrink"
    """The global batch while groups are down. shrink: each live group trains its usual
    slices, so the step is smaller and torchft's normalization averages what there is;
    accumulate: the live groups also train the missing groups' slices by more gradient
    accumulation, so every step keeps training.global_batch_size (and takes longer)."""
    quorum_timeout_s: float = 120
    """The floor of how long a step waits for the Lighthouse to form its quorum; raised to
    the plan's save and first step (`train.replica_groups.build.ft_timeouts`)."""
    timeout_s: float = 60
    """The floor of the torchft collectives', commit's and heal's timeout: a group that
    stops answering is dropped from the step after it, and the step is retried without it;
    raised to the plan's first step and the heal (`heal_gb_per_s`)."""
    heal_gb_per_s: float = 0.5
    """A rank's rate receiving its peer's state in a heal (torchft's HTTP transport, in
    chunks): the heal's timeout is the rank's state at this rate. 0.15-1.06 GB/s measured on
    loopback (4 chunks, 2 loaded shared cores: docs/bench/replica_groups-2026-11-28.md);
    set the link's on a cluster."""
    fingerprint_every: int = 50
    """Every this many steps the groups compare checksums of their weights and stop, naming
    the group, rank and parameter, if they differ (0: never)."""
    max_retries: int = 10
    """A step the quorum refuses this many times in a row ends the group, naming torchft's
    error (a kill or a Lighthouse restart refuses a step or two)."""
    reference_slices: list[int] = field(default_factory=list)
    """Tests only: step s trains reference_slices[s-1] slices on a one-group run (a
    reference given a replica run's participant schedule, read from its ledger)."""


@dataclass
class RunConfig:
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    fp8: Fp8Config = field(default_factory=Fp8Config)
    dataloader: DataloaderConfig = field(default_factory=DataloaderConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(
        default_factory=ActivationCheckpointConfig
    )
    compile: CompileConfig = field(default_factory=CompileConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    replica_groups: ReplicaGroupsConfig = field(default_factory=ReplicaGroupsConfig)

    @property
    def min_replica_groups(self) -> int:
        """`replica_groups.min_groups`, 0 resolved to a majority of the groups."""
        r = self.replica_groups
        return r.min_groups or r.groups // 2 + 1

    @property
    def seq_lens(self) -> dict[str, int]:
        """Every seq_len the run trains at, by its key: training.seq_len, then each
        [[dataloader.schedule]] phase's that sets one (`validate` and the launch rules
        check each)."""
        return {"training.seq_len": self.training.seq_len} | {
            f"dataloader.schedule[{i}].seq_len": p.seq_len
            for i, p in enumerate(self.dataloader.schedule)
            if p.seq_len
        }

    @property
    def run_dir(self) -> Path:
        return Path(self.job.folder)


def _validate_fp8_stats(run: RunConfig, source: str) -> None:
    f, log_freq = run.fp8, run.metrics.log_freq
    if f.stats_freq % log_freq:  # signs: `_check_signs`
        raise ConfigError(
            f"{source}: fp8.stats_freq ({f.stats_freq}) must be 0 (off) or a multiple of "
            f"metrics.log_freq ({log_freq}), so that every stats step is a logged step"
        )
    for key in ("stats_underflow_warn", "stats_saturation_warn"):
        if not 0 <= getattr(f, key) <= 1:
            raise ConfigError(f"{source}: fp8.{key} ({getattr(f, key)}) is a share: give 0 to 1")


def _validate_replica_groups(run: RunConfig, source: str) -> None:
    r = run.replica_groups
    if r.groups == 1:
        raise ConfigError(
            f"{source}: replica_groups.groups = {r.groups}: give 0 (off) or at least 2 groups"
        )
    if r.groups and not 0 <= r.min_groups <= r.groups:
        raise ConfigError(
            f"{source}: replica_groups.min_groups = {r.min_groups} must be in [0, groups = "
            f"{r.groups}] (0: a majority)"
        )
    if r.groups and run.parallelism.dp_replicate != 1:
        raise ConfigError(
            f"{source}: parallelism.dp_replicate = {run.parallelism.dp_replicate} with "
            "replica_groups: torchft owns the replicate dimension; set dp_replicate = 1 "
            "(FSDP and TP stay inside a group)"
        )
    if r.groups and r.down_policy == "shrink" and any(p.seq_len for p in run.dataloader.schedule):
        raise ConfigError(
            f"{source}: a seq_len phase in [[dataloader.schedule]] starts on a step "
            "boundary, which a smaller step under replica_groups.down_policy = 'shrink' "
            "moves; use down_policy = 'accumulate' (every step keeps its global batch)"
        )
    if r.reference_slices and (r.groups or any(n < 1 for n in r.reference_slices)):
        raise ConfigError(
            f"{source}: replica_groups.reference_slices (tests only) is for a run without "
            "replica groups (groups = 0), one positive count per step"
        )


# Sizes, counts, rates and timeouts: a negative one is never meant (a key whose default is
# -1 takes -1, "derive it", and validation.steps = -1 is one pass of the val split), and
# these must also be above zero (a zero divides, or trains nothing).
_POSITIVE = set(
    "model.dim model.n_layers model.n_heads model.n_kv_heads model.vocab_size model.ffn_hidden_dim "
    "model.max_seq_len model.norm_eps model.rope_theta training.steps training.local_batch_size "
    "checkpoint.interval metrics.log_freq validation.freq validation.steps dataloader.block_tokens "
    "dataloader.shuffle_blocks checkpoint.storage_gb_per_s fault_tolerance.min_save_gb_per_s "
    "fp8.stats_sample_rows health.max_consecutive_nonfinite health.straggler_window "
    "health.spike_sigmas health.spike_steps replica_groups.quorum_timeout_s "
    "replica_groups.timeout_s replica_groups.heal_gb_per_s replica_groups.max_retries "
    "parallelism.dp_replicate parallelism.dp_shard parallelism.tp parallelism.cp".split()
)


def _check_signs(node: object, source: str, prefix: str = "") -> None:
    """Every number in the config tree against its sign rule (`_POSITIVE`, else >= 0)."""
    for f in dataclasses.fields(node):  # type: ignore[arg-type]
        key, value = f"{prefix}{f.name}", getattr(node, f.name)
        for i, item in enumerate(value if isinstance(value, list) else [value]):
            if dataclasses.is_dataclass(item):
                _check_signs(item, source, f"{key}[{i}]." if isinstance(value, list) else f"{key}.")
        number = isinstance(value, int | float) and not isinstance(value, bool)
        positive = key in _POSITIVE
        minus_one_meant = value == -1 and (f.default == -1 or key == "validation.steps")
        if number and value < 0 and not minus_one_meant or positive and value == 0:
            rule = "positive" if positive else ">= 0"
            raise ConfigError(
                f"{source}: {key} = {value} must be {rule} (configs/base.toml documents each key)"
            )


def validate(run: RunConfig, source: str) -> None:
    """Cross-field checks that need no torch and no files."""
    _check_signs(run, source)
    m = run.model
    if m.dim % m.n_heads:
        raise ConfigError(
            f"{source}: model.dim ({m.dim}) must be divisible by model.n_heads ({m.n_heads})"
        )
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(
            f"{source}: model.n_heads ({m.n_heads}) must be a multiple of model.n_kv_heads ({m.n_kv_heads})"
        )
    for key, seq_len in run.seq_lens.items():
        if not 0 < seq_len <= m.max_seq_len:
            raise ConfigError(
                f"{source}: {key} {seq_len} must be in [1, model.max_seq_len = {m.max_seq_len}] "
                "(RoPE is precomputed up to max_seq_len); raise model.max_seq_len to the longest"
            )
        if seq_len > run.dataloader.block_tokens:
            raise ConfigError(
                f"{source}: {key} {seq_len} exceeds dataloader.block_tokens "
                f"{run.dataloader.block_tokens}, the shuffle block a window lies in; raise block_tokens"
            )
    if not run.dataloader.mix:
        raise ConfigError(
            f"{source}: [[dataloader.mix]] is empty; add at least one prepared dataset path"
        )
    if run.validation.enable and not run.validation.mix:
        raise ConfigError(
            f"{source}: validation.enable is true but [[validation.mix]] is empty; "
            "add the val split path or set validation.enable = false"
        )
    if run.dataloader.schedule and run.training.global_batch_size <= 0:
        raise ConfigError(
            f"{source}: [[dataloader.schedule]] needs a fixed training.global_batch_size, so that "
            "step S is the same global sequence (S-1) x global_batch_size on any number of ranks"
        )
    for i, phase in enumerate(run.dataloader.schedule):
        if phase.start_step < 2:
            raise ConfigError(
                f"{source}: dataloader.schedule[{i}].start_step {phase.start_step} must be >= 2 "
                "(step 1 uses the [[dataloader.mix]] weights)"
            )
        if not phase.weights and not phase.seq_len:
            raise ConfigError(
                f"{source}: dataloader.schedule[{i}] changes nothing; give weights, a seq_len, or both"
            )
        if phase.weights and len(phase.weights) != len(run.dataloader.mix):
            raise ConfigError(
                f"{source}: dataloader.schedule[{i}].weights has {len(phase.weights)} entries for "
                f"{len(run.dataloader.mix)} [[dataloader.mix]] entries; give one weight per mix entry"
            )
    if run.compile.async_tp and not run.compile.enable:
        raise ConfigError(f"{source}: compile.async_tp needs compile.enable = true")
    storage, floor = run.checkpoint.storage_gb_per_s, run.fault_tolerance.min_save_gb_per_s
    if floor > storage:
        raise ConfigError(
            f"{source}: fault_tolerance.min_save_gb_per_s = {floor:g} is above "
            f"checkpoint.storage_gb_per_s = {storage:g}: every healthy save would be called a "
            f"hang; set min_save_gb_per_s to at most {storage:g}"
        )
    _validate_fp8_stats(run, source)
    h = run.health
    if h.straggler_factor <= 1.0:
        raise ConfigError(f"{source}: health.straggler_factor must be > 1.0")
    if h.spike_window < 2 or not 2 <= h.spike_warmup <= h.spike_window:
        raise ConfigError(
            f"{source}: health.spike_window ({h.spike_window}) and health.spike_warmup "
            f"({h.spike_warmup}) must satisfy 2 <= spike_warmup <= spike_window"
        )
    if not 0 < h.rollback_lr_factor <= 1:
        raise ConfigError(
            f"{source}: health.rollback_lr_factor in (0, 1] (got {h.rollback_lr_factor})"
        )
    for i, entry in enumerate(run.dataloader.skip_sequences):
        if len(entry) != 2 or not 0 <= entry[0] < entry[1]:
            raise ConfigError(
                f"{source}: dataloader.skip_sequences[{i}] = {entry}: write [start, end) of "
                "global sequences with 0 <= start < end, e.g. [1600, 2400]"
            )
    _validate_replica_groups(run, source)
    if run.checkpoint.keep_last == 1:
        # torchtitan refuses 1: the newest could be half-written when the older is purged
        raise ConfigError(f"{source}: checkpoint.keep_last must be 0 or at least 2")
