"""The trainer service's config: one typed model with defaults (sparrow.config), file < environment < flags."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from services.common.sections import GrpcSecurityConfig, RedisConfig
from services.trainer.weights import DEFAULT_SHARD_BYTES
from sparrow.config import ConfigSection, SparrowConfig
from sparrow.schedule import DEFAULT_BIN_WIDTH


class GrpcConfig(ConfigSection):
    """The gRPC server carrying RolloutService and WeightService."""

    address: str = Field("127.0.0.1:50051", description="host:port the gRPC server binds (port 0 picks a free one).")
    max_calls: int = Field(
        4096,
        ge=1,
        description="Open calls (trajectory streams, version watches, fetches) served at once; past it a new call is "
        "refused at once with RESOURCE_EXHAUSTED. Health and reflection are never counted. A generator holds two.",
    )
    blocking_threads: int = Field(
        16, ge=1, description="Threads for the calls' blocking work (store fsync, file reads); open calls hold none."
    )
    max_message_bytes: int = Field(
        64 << 20, ge=1 << 16, description="Largest message accepted; a bigger one ends its stream (RESOURCE_EXHAUSTED)."
    )
    grace_s: float = Field(10.0, ge=0, description="Seconds in-flight calls get to finish at shutdown.")


class MetricsConfig(ConfigSection):
    """The Prometheus endpoint."""

    host: str = Field("127.0.0.1", description="Address /metrics listens on.")
    port: int = Field(9471, ge=0, le=65535, description="Port of /metrics (0: a free one, logged at start).")
    bin_width: int = Field(DEFAULT_BIN_WIDTH, gt=0, description="KV-length bin width of the alpha tail metrics.")
    num_bins: int | None = Field(
        20, ge=1, description="Bins of the tail metrics; longer lengths fall into the last. None: open-ended."
    )


class TaskConfig(ConfigSection):
    """The built-in chain-following task (sparrow/tasks/chain.py): the dataset when data.train_files is empty."""

    pairs: int = Field(16, ge=2, description="Pairs in each prompt's context.")
    min_hops: int = Field(1, ge=1, description="Fewest hops of a query.")
    max_hops: int = Field(16, ge=1, description="Most hops of a query.")
    name_pool: int | None = Field(None, description="Names drawn from (None: the task's default).")
    filler: int = Field(
        0,
        ge=0,
        description="Countdown tokens after each hop (the long task: 30 for models/long; 0: the plain chain task).",
    )
    seed: int = Field(0, ge=0, description="Seed of the chain rows generated.")
    count: int = Field(8192, ge=1, description="Chain rows generated as the training set (drawn epoch after epoch).")

    def chain(self):
        """The ChainTask these settings describe (TaskError when they describe none)."""
        from sparrow.tasks import ChainTask

        return ChainTask(self.pairs, self.max_hops, self.min_hops, self.name_pool, self.filler)


class DataConfig(ConfigSection):
    """The training and evaluation datasets (sparrow/data.py, sparrow/rows.py, sparrow/prompts.py)."""

    train_files: list[str] = Field(
        [], description="JSONL/Parquet files or folders of shards, one source each; empty: the chain task ([task])."
    )
    ratios: list[float] = Field([], description="Mixing ratio of each train_files source; empty: 1 each.")
    eval_files: list[str] = Field([], description="Held-out JSONL/Parquet files or folders ([eval] runs on them).")
    prompt_key: str = Field("prompt", min_length=1, description="Column of the prompt (a string or chat messages).")
    answer_key: str = Field(
        "answer", min_length=1, description="Answer column of plain rows (verl's reward_model.ground_truth first)."
    )
    answer_extraction: Literal["none", "gsm8k"] = Field(
        "none", description="gsm8k: the answer is the text after '####' (GSM8K's solutions)."
    )
    on_bad_row: Literal["skip", "stop"] = Field(
        "skip", description="A row that fits no shape: skipped (counted, logged with its row number) or fatal."
    )
    max_prompt_tokens: int = Field(1024, ge=1, description="Longest prompt after templating; longer ones are filtered.")
    on_long_prompt: Literal["skip", "error"] = Field(
        "skip", description="A prompt over max_prompt_tokens: filtered out with a count, or a start error."
    )
    chat_template: str = Field(
        "auto",
        min_length=1,
        description="auto (the tokenizer's template, else raw text), tokenizer, none (raw text), or a .jinja file.",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        {}, description="Passed to the template, e.g. {enable_thinking = false} for Qwen3."
    )
    system_prompt: str = Field("", description="A system message put before prompts that have none; empty: none.")
    shuffle: bool = Field(True, description="Draw each source's rows in a fresh random order every epoch.")
    seed: int = Field(0, ge=0, description="Seed of the mix and the shuffles.")


class HttpRewardConfig(ConfigSection):
    """A reward served over HTTP (`name = "http://host:port/path"`), called by one async client in the trainer."""

    timeout_s: float = Field(10.0, gt=0, description="Seconds one request may take; longer is a timeout (retried).")
    retries: int = Field(
        2, ge=0, le=10, description="Retries of a request that timed out, was refused or got a 5xx/429."
    )
    backoff_s: float = Field(0.5, ge=0, description="Wait before the first retry; doubled at each further one.")
    max_concurrency: int = Field(16, ge=1, le=4096, description="Requests in flight at most, over the whole trainer.")
    token: str = Field("", description="Sent as `Authorization: Bearer <token>`; empty: no header.")
    batch_size: int = Field(
        1, ge=1, le=1024, description="Samples per request: 1 posts one object, more post {items: [...]} of a group."
    )


class RewardConfig(ConfigSection):
    """Rewards (sparrow/reward_registry.py), computed in worker processes as trajectories arrive."""

    name: str = Field(
        "", description="Every source's reward (chain, boxed, math, module:fn, file.py:fn); empty: by data_source."
    )
    by_source: dict[str, str] = Field({}, description="Reward per data_source, over `name`.")
    workers: int = Field(4, ge=1, le=256, description="Reward worker processes (calls may be slow or do I/O).")
    timeout_s: float = Field(
        10.0,
        gt=0,
        description="A reward call running longer scores 0 (counted as timeout); the code reward's own default is "
        "180 s (a request at the sandbox's max_request_s plus a minute of retries through a sandbox restart).",
    )
    timeouts: dict[str, float] = Field(
        {},
        description="Timeout per reward name, over timeout_s and the built-in's default (e.g. {code = 300.0}); "
        "the code reward's retries fit in it.",
    )
    options: dict[str, dict[str, Any]] = Field(
        {}, description="Settings per reward name, given to the reward as extras['options']."
    )
    http: HttpRewardConfig = Field(
        default_factory=HttpRewardConfig, description="Rewards given as http:// or https:// URLs."
    )


class SamplingConfig(ConfigSection):
    """What every prompt group asks the generators for."""

    n: int = Field(8, ge=2, le=1024, description="Samples per prompt group (GRPO's group size).")
    temperature: float = Field(1.0, gt=0, le=10, description="Sampling temperature (RL: 1.0).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling (RL: 1.0).")
    max_new_tokens: int = Field(256, ge=1, description="Longest response; a longer trajectory is rejected.")
    top_logprobs: int = Field(20, ge=1, le=20, description="Top-k logprobs per position (alpha needs 20).")
    stop_token_ids: list[int] = Field(
        [], description="Stop ids beside the model's eos ids (tokenizer and generation_config.json)."
    )


class GrpoSection(ConfigSection):
    """GRPO + TIS (DESIGN.md section 1)."""

    clip_low: float = Field(0.2, gt=0, lt=1, description="Lower PPO clip: ratios below 1 - this are clipped.")
    clip_high: float = Field(0.28, gt=0, description="Upper PPO clip: ratios above 1 + this are clipped.")
    tis_cap: float = Field(2.0, ge=1, description="Truncated importance sampling cap C on pi_dense_old / pi_rollout.")


class OptimConfig(ConfigSection):
    """AdamW on the dense policy."""

    lr: float = Field(1e-6, gt=0, description="Learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay.")
    beta1: float = Field(0.9, ge=0, lt=1, description="Adam beta1.")
    beta2: float = Field(0.999, ge=0, lt=1, description="Adam beta2.")
    max_grad_norm: float = Field(1.0, ge=0, description="Gradient norm clip (0: off).")
    micro_batch_size: int = Field(8, ge=1, description="Sequences per forward/backward pass (at most).")
    max_tokens_per_microbatch: int = Field(
        0,
        ge=0,
        description="Padded tokens per forward/backward pass at most; rows are grouped by length (0: by count only).",
    )
    lm_head_chunk: int = Field(
        1024, ge=1, description="Positions whose logits exist at once in scoring and the update (vocab x this floats)."
    )


class CheckpointConfig(ConfigSection):
    """Checkpoints under run_dir/checkpoints."""

    every: int = Field(
        0,
        ge=0,
        description="Steps between checkpoints; 0 (auto): paced by time, so that writing them takes at most "
        "max_overhead of the run and at most max_interval_s of training goes unsaved (one after the first step, "
        "and one at every clean stop, either way).",
    )
    max_overhead: float = Field(
        0.05,
        gt=0,
        lt=1,
        description="With every = 0: the share of wall time checkpoints may take (a model whose checkpoint takes "
        "60 s is saved once at least 19 x 60 s of training have passed since the last, at 0.05).",
    )
    max_interval_s: float = Field(
        1800.0, gt=0, description="With every = 0: seconds of training after which a checkpoint is due regardless."
    )
    keep: int = Field(3, ge=1, description="Newest checkpoints kept; older ones are deleted.")


class WeightsConfig(ConfigSection):
    """Published policy versions and adapters under run_dir/policy and run_dir/adapters."""

    keep: int = Field(3, ge=1, description="Newest policy (and adapter) versions kept for fetching.")
    default_chunk_bytes: int = Field(1 << 20, ge=1 << 10, description="Chunk size when a fetch asks for none.")
    max_chunk_bytes: int = Field(
        4 << 20, ge=1 << 10, description="Largest chunk sent, whatever a fetch asks (below max_message_bytes)."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Dtype versions are published in: the one the engines serve (auto: the model folder's config "
        "dtype, bf16 for a Qwen3 checkpoint). The trainer's master weights stay fp32.",
    )
    max_shard_bytes: int = Field(
        DEFAULT_SHARD_BYTES,
        ge=1 << 10,
        description="Largest .safetensors file of a published version, split as HF splits checkpoints (a tensor "
        "above it gets a file of its own; several files come with model.safetensors.index.json). 5 GB, the hub's "
        "usual split: Qwen3-8B in bf16 goes out as 4 files, Qwen3-0.6B as one.",
    )
    deltas: bool = Field(
        True, description="Also publish each version as a delta against the previous one (when under half its size)."
    )
    trainer_fanout: int = Field(
        2, ge=1, description="Generators per version fetched from the trainer itself; later ones get a peer."
    )
    peer_fanout: int = Field(2, ge=1, description="Generators a relaying generator serves per version.")


class DistillSection(ConfigSection):
    """DistillSparse (trainer/distill.py): a LoRA on the sparse actor, trained after each dense update and
    published to the generators. Changing rank or target_modules makes the run's checkpoints unloadable."""

    enabled: bool = Field(False, description="Train and publish the adapter every step.")
    rank: int = Field(8, ge=1, le=256, description="LoRA rank; generators need max_lora_rank at least this.")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha; the adapter's update is scaled by alpha / rank.")
    target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="Linear layers the adapter wraps; k_proj also moves the page centroids the selection scores.",
    )
    lr: float = Field(1e-5, gt=0, description="AdamW learning rate of the adapter (about 10x the policy's).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay of the adapter.")
    max_grad_norm: float = Field(1.0, ge=0, description="Clip of the adapter's gradient norm (0: off).")
    kl_coef: float = Field(1e-3, ge=0, description="lambda: weight of k3 KL(sparse+LoRA || dense) beside L_PPO.")
    kl_clamp: float = Field(10.0, gt=0, description="The log-ratio inside k3 is clamped to [-this, this].")
    kl_estimator: Literal["k3", "full"] = Field(
        "k3", description="k3 on the sampled tokens (the paper's) or the exact KL over the vocabulary."
    )
    selection_coef: float = Field(
        0.0,
        ge=0,
        description="Weight of the selection loss (page scores vs dense attention mass per page); 0: the paper's loss.",
    )
    epochs: int = Field(1, ge=1, description="Adapter optimizer steps on each step's batch.")
    micro_batch_size: int = Field(8, ge=1, description="Sequences per forward/backward pass of the adapter.")
    max_tokens_per_microbatch: int = Field(
        0, ge=0, description="Padded tokens per pass of the adapter at most, rows grouped by length (0: by count)."
    )
    backend: Literal["auto", "torch", "cpu", "triton"] = Field(
        "auto", description="Page scoring of the teacher-forced forward: the generators' backend, to select alike."
    )
    seed: int = Field(0, ge=0, description="Seed of the adapter's initial A matrices (B starts at zero).")
    sink_blocks: int = Field(1, ge=0, description="Sink blocks, when Redis holds no schedule to read them from.")
    local_blocks: int = Field(2, ge=1, description="Local blocks, when Redis holds no schedule to read them from.")
    dense_layers: list[int] = Field(
        [0, 1], description="Dense decode layers, when Redis holds no schedule to read them from."
    )
    probe_every: int = Field(10, ge=0, description="Steps between with/without-adapter alpha probes (0: never).")
    probe_samples: int = Field(
        8, ge=1, description="Rollouts of a probe step held out of the adapter's training and scored both ways."
    )


class DistributedConfig(ConfigSection):
    """Several trainer processes: rank 0 serves, each rank trains its share (see ranks.py).

    `sparrow trainer` starts them itself (services/trainer/launch.py) when procs_per_node * nodes > 1:
    torchrun's elastic agent on this node, a rendezvous on loopback for one node, a static one at
    master_addr:master_port for several. A process that torchrun started (WORLD_SIZE set) is a rank:
    the launch fields below are then ignored, so a user's own torchrun command runs as before.
    """

    timeout_s: float = Field(
        300.0,
        gt=0,
        description="Bound of every collective: a rank that dies or hangs ends the others within this many seconds.",
    )
    even_shares: bool = Field(
        False,
        description="Refuse a world size that does not divide a step's samples (groups_per_step * sampling.n), "
        "so that every rank trains as many sequences and none pads.",
    )
    procs_per_node: int = Field(
        1,
        ge=1,
        le=256,
        description="Trainer processes this command starts on its node (one per GPU). 1 on one node: the trainer "
        "alone, no launcher.",
    )
    nodes: int = Field(1, ge=1, le=4096, description="Nodes of the job, each running this command (node_rank).")
    node_rank: int = Field(
        0, ge=0, description="This node's index, 0 .. nodes - 1; node 0 hosts the rendezvous and rank 0 (the service)."
    )
    master_addr: str = Field(
        "",
        description="Host name of node 0 (its rendezvous store): needed with several nodes; empty on one node, "
        "a rendezvous on a free loopback port.",
    )
    master_port: int = Field(29500, ge=1, le=65535, description="Port of node 0's rendezvous store (with master_addr).")
    join_timeout_s: float = Field(
        600.0, gt=0, description="How long the nodes wait for each other at the rendezvous before giving up."
    )
    restarts: int = Field(
        0,
        ge=0,
        description="Times this node's processes all start again after one fails (they resume from the last "
        "checkpoint); never after a setup error (exit 2). One node only: several restart as a whole set, through "
        "their scheduler (the chart's JobSet).",
    )
    stop_grace_s: float = Field(
        30.0,
        gt=0,
        description="On SIGTERM or SIGINT the processes get this long to checkpoint and stop before they are killed.",
    )

    @model_validator(mode="after")
    def _launch(self) -> DistributedConfig:
        if self.node_rank >= self.nodes:
            raise ValueError(f"distributed.node_rank {self.node_rank} is not below distributed.nodes {self.nodes}")
        if self.nodes > 1 and not self.master_addr:
            raise ValueError("distributed.nodes > 1 needs distributed.master_addr (node 0's host name)")
        if self.nodes > 1 and self.restarts:
            raise ValueError(
                "distributed.restarts restarts one node's processes; several nodes restart as a whole set through "
                "their scheduler: set it to 0"
            )
        return self

    @property
    def world(self) -> int:
        """Trainer processes in the whole job."""
        return self.procs_per_node * self.nodes


class MemoryConfig(ConfigSection):
    """What the trainer trades for memory: recompute of decoder layers, host memory for the shards."""

    activation_checkpointing: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Recompute each decoder layer's forward in the backward, keeping only its input (about a "
        "third more compute for a fraction of the activations): auto from checkpoint_min_tokens positions in a "
        "micro-batch on, on always, off never (trainer/activation_checkpoint.py).",
    )
    checkpoint_min_tokens: int = Field(
        4096,
        ge=1,
        description="With activation_checkpointing = auto: a micro-batch of at least this many positions (rows x "
        "padded length) checkpoints its layers; shorter ones keep their activations.",
    )
    cpu_offload: bool = Field(
        False,
        description="Keep the FSDP2 shards of the float32 weights, their gradients and the optimizer state in host "
        "memory (FSDP2's CPUOffloadPolicy; the optimizer steps on the CPU): needs device = cuda and several "
        "trainer processes.",
    )


class EvalConfig(ConfigSection):
    """Evaluation during training on data.eval_files, through the generator fleet (services/trainer/evaluation.py)."""

    every: int = Field(10, ge=0, description="Steps between evaluations (also before step 1, after the last); 0: off.")
    k: int = Field(4, ge=1, le=1024, description="Samples per eval prompt: avg@k and pass@k (unbiased) per source.")
    max_prompts: int = Field(0, ge=0, description="Eval prompts per round, the first of each source's rows; 0: all.")
    timeout_s: float = Field(
        900.0, gt=0, description="A round still incomplete after this long is reported with what came back."
    )
    modes: list[Literal["dense", "schedule"]] = Field(
        ["dense"],
        min_length=1,
        max_length=2,
        description="How each round's samples decode, each mode a set of groups of its own in the same round: "
        "'dense' (attention dense whatever the schedule: held-out accuracy unbiased by sparsity), 'schedule' (under "
        "the generators' current schedule, as the sparse actor samples, never a probe). Both: the gap between them.",
    )
    dense: bool | None = Field(
        None, description="The older form of modes: true is modes = ['dense'], false is ['schedule']; not with modes."
    )

    @model_validator(mode="after")
    def _modes(self) -> EvalConfig:
        if len(set(self.modes)) != len(self.modes):
            raise ValueError(f"eval.modes names a mode twice: {self.modes}")
        if self.dense is not None:
            if "modes" in self.model_fields_set:
                raise ValueError("eval.dense and eval.modes are both set: keep eval.modes (dense is its older form)")
            # Migrated here, so that the config written for a child (services/*.toml) holds modes only.
            self.modes = ["dense"] if self.dense else ["schedule"]
            self.dense = None
        return self


class TrainerServiceConfig(SparrowConfig):
    """The trainer service's whole config (TOML file, SPARROW_* environment, flags)."""

    renamed: ClassVar[dict[str, str]] = {"redis_url": "redis.url"}

    run_dir: str = Field("runs/trainer", description="Where the trajectory store, checkpoints and policies live.")
    model_dir: str = Field("models/tiny", description="HF-format model folder the run starts from.")
    device: Literal["cpu", "cuda"] = Field("cpu", description="Where the policy trains.")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Compute dtype of scoring and the update; master weights and optimizer state stay float32.",
    )
    threads: int = Field(1, ge=1, description="torch CPU threads.")
    steps: int = Field(0, ge=0, description="Steps to train before stopping (0: until SIGTERM).")
    groups_per_step: int = Field(8, ge=1, description="Complete prompt groups per training step.")
    outstanding_steps: float = Field(
        2.0, gt=0, description="Groups kept enqueued ahead of training, in steps' worth (bounds the queue)."
    )
    max_staleness: int = Field(
        4, ge=0, description="A group whose oldest sample lags the policy by more versions is dropped, not trained."
    )
    requeue_after_s: float = Field(
        900.0, gt=0, description="An incomplete group is enqueued again after this long (a lost entry must not stall)."
    )
    poll_s: float = Field(0.5, gt=0, description="Seconds between queue checks while waiting for groups.")
    wait_for_generators: int = Field(
        0,
        ge=0,
        description="A fresh run holds its first prompts until this many generators have opened their trajectory "
        "streams, so none gets a head start (`sparrow up` sets its generator count); 0 feeds at once.",
    )
    wait_for_generators_s: float = Field(
        600.0, gt=0, description="After this long the first prompts go out anyway, with a warning naming who came."
    )
    logprob_tolerance: float = Field(
        1e-3, ge=0, description="Logprobs up to this above 0 are accepted (float rounding); larger ones are refused."
    )
    alpha: Literal["topk", "exact"] = Field(
        "topk",
        description="Alpha per token: the top-k bound from the generators' lists, or also the exact value over the "
        "vocabulary from the trainer's teacher-forced sparse forward under each token's budgets (one no-grad "
        "forward per step; block rule from the schedule in Redis, else [distill]'s sink/local/dense_layers).",
    )
    grpc: GrpcConfig = Field(default_factory=GrpcConfig, description="gRPC server.")
    redis: RedisConfig = Field(default_factory=RedisConfig, description="Redis holding the prompt stream.")
    security: GrpcSecurityConfig = Field(default_factory=GrpcSecurityConfig, description="Service token and TLS.")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="Prometheus endpoint.")
    task: TaskConfig = Field(default_factory=TaskConfig, description="The built-in chain task.")
    data: DataConfig = Field(default_factory=DataConfig, description="Training and evaluation datasets.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Rewards.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Evaluation during training.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="Sampling of every group.")
    grpo: GrpoSection = Field(default_factory=GrpoSection, description="GRPO + TIS.")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Optimizer.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpointing.")
    weights: WeightsConfig = Field(default_factory=WeightsConfig, description="Policy publishing.")
    distill: DistillSection = Field(default_factory=DistillSection, description="DistillSparse LoRA adapter.")
    distributed: DistributedConfig = Field(
        default_factory=DistributedConfig, description="Several processes: their launch and their collectives."
    )
    memory: MemoryConfig = Field(default_factory=MemoryConfig, description="Activation checkpointing, CPU offload.")

    @property
    def outstanding_groups(self) -> int:
        """Groups the feeder keeps enqueued and not yet taken by a step."""
        return max(1, round(self.outstanding_steps * self.groups_per_step))

    @model_validator(mode="after")
    def _check(self) -> TrainerServiceConfig:
        from sparrow.tasks import TaskError

        try:
            chain = self.task.chain()
        except TaskError as exc:
            raise ValueError(f"task: {exc}") from None
        answer = chain.sequence_tokens() - chain.prompt_tokens()
        # the long task only: short chain configs truncate on purpose in tests and quick runs
        if not self.data.train_files and chain.filler and answer > self.sampling.max_new_tokens:
            raise ValueError(
                f"task {chain.name}: its longest answer is {answer} tokens (EOS included), above "
                f"sampling.max_new_tokens {self.sampling.max_new_tokens}"
            )
        if self.memory.cpu_offload and self.device != "cuda":
            raise ValueError(
                'memory.cpu_offload moves the shards of a GPU trainer to host memory; device = "cpu" has none to move'
            )
        if self.data.ratios and len(self.data.ratios) != len(self.data.train_files):
            raise ValueError(
                f"data.ratios has {len(self.data.ratios)} entries for {len(self.data.train_files)} data.train_files"
            )
        if any(not r > 0 for r in self.data.ratios):
            raise ValueError("data.ratios must all be above 0")
        if self.weights.default_chunk_bytes > self.weights.max_chunk_bytes:
            raise ValueError("weights.default_chunk_bytes is above weights.max_chunk_bytes")
        # A chunk travels in one message, with a little framing around its bytes.
        if self.weights.max_chunk_bytes + 4096 > self.grpc.max_message_bytes:
            raise ValueError("weights.max_chunk_bytes must leave 4 KiB of room below grpc.max_message_bytes")
        return self
