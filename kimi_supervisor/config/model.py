"""What a configuration is: one frozen dataclass per TOML section, built and validated by config/load.py.

Every later module takes these and trusts their values (config/load.py's parsers checked each one); the defaults
live with the parsers, next to the checks.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path

from kimi_supervisor.config.front import FrontConfig
from kimi_supervisor.config.vllm_args import VllmArgs
from kimi_supervisor.roles import Role


@dataclasses.dataclass(frozen=True)
class SpawnSpec:
    """What spawning the child needs (child.ChildProcess.spawn); ChildConfig adds what only vLLM has."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    inherit_environment: bool
    working_directory: str | None
    user: str | None
    # Resolved to a gid, with the user's supplementary groups, when the child is spawned (child/spawnplan.py).
    group: str | None = None
    # paths.cache_directory, where the child's compile caches go (child/cachedirs.py); None: vLLM's defaults.
    cache_directory: Path | None = None
    # child.credentials: the child's environment variable -> the systemd credential its value is read from
    # ($CREDENTIALS_DIRECTORY/NAME, child/spawnplan.py), so no secret sits in argv or the config file.
    credentials: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ChildConfig(SpawnSpec):
    vllm: VllmArgs = dataclasses.field(kw_only=True)


@dataclasses.dataclass(frozen=True)
class ReapConfig:
    enabled: bool
    grace_s: float
    names: tuple[str, ...]
    cmdline: tuple[re.Pattern[str], ...]
    companions: tuple[re.Pattern[str], ...]
    protected_names: tuple[str, ...]
    # Only processes of these users may be reaped: root and child.user by default.
    users: tuple[str, ...] = ("root",)


@dataclasses.dataclass(frozen=True)
class ShmConfig:
    enabled: bool
    directory: Path
    globs: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class PreflightConfig:
    # None: every GPU NVML sees.  (): no GPU at all (CPU deployments, demo).
    gpus: tuple[int, ...] | None
    memory_threshold_mib: int
    poll_interval_s: float
    deadline_s: float
    busy_log_interval_s: float
    check_model: bool
    check_port: bool
    reap: ReapConfig
    shm: ShmConfig


@dataclasses.dataclass(frozen=True)
class FatalRule:
    """`source: message`: a fatal record is one that `source` (the file in vLLM's `[file.py:line]` header)
    logged at ERROR or above, whose message starts with a match of `message`.  Only vLLM's own code picks
    the header and the start of its message; a client's words only ever follow them."""

    source: str  # a file name as vLLM's header shows it, e.g. "multiproc_executor.py"
    message: re.Pattern[str]  # matched at the start of the record's message (re.match)
    text: str  # as configured, for messages

    def matches(self, source: str | None, message: str) -> bool:
        return source is not None and source.rsplit("/", 1)[-1] == self.source and bool(self.message.match(message))


@dataclasses.dataclass(frozen=True)
class ReadinessConfig:
    started_patterns: tuple[re.Pattern[str], ...]
    fatal_patterns: tuple[FatalRule, ...]
    health_url: str
    deadline_s: float
    stall_timeout_s: float
    poll_interval_s: float


@dataclasses.dataclass(frozen=True)
class HealthConfig:
    # GET /health while serving, from a thread; `timeout_s` bounds a whole probe, not each recv.
    interval_s: float
    timeout_s: float
    failures_tolerated: int  # in a row, then exit 14


@dataclasses.dataclass(frozen=True)
class ShutdownConfig:
    grace_s: float  # SIGTERM, then SIGKILL to whatever is left of the tree
    second_signal_grace_s: float  # what is left of the grace once a second stop signal arrives
    gpu_release_timeout_s: float  # 0: do not wait for the GPUs' memory to come back


@dataclasses.dataclass(frozen=True)
class PathsConfig:
    # The unit's RuntimeDirectory= (lock, live state) and StateDirectory= (run history).
    runtime_directory: Path
    state_directory: Path
    # The unit's CacheDirectory=: vLLM's compile caches and the kernel caches beside them, kept across restarts
    # whoever the child runs as (child/cachedirs.py); None: the child's environment is left to vLLM's defaults.
    cache_directory: Path | None = Path("/var/cache/kimi-supervisor")


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
    # node_exporter's textfile collector reads *.prom files; None: no metrics file.
    textfile: Path | None


@dataclasses.dataclass(frozen=True)
class LivenessConfig:
    # Deep liveness (liveness/engine.py): /health stays 200 while an engine is wedged.
    canary_interval_s: float  # 0: no canary
    canary_timeout_s: float
    failures_tolerated: int
    when: str  # "idle": only while /metrics shows nothing in flight; "always"
    stuck_after_s: float  # 0: no token-progress check
    metrics_interval_s: float
    metrics_url: str  # /v1/completions and the model name come from child.argv (child.vllm)


GPU_HEALTH_POLICIES = ("fail", "warn", "off")


@dataclasses.dataclass(frozen=True)
class GpuHealthConfig:
    xid_events: bool  # watch NVML XID / double-bit ECC events while serving
    xid_ignored: tuple[int, ...]  # logged, not acted on
    # Preflight checks (preflight/gpu_health.py): what a problem found by each one is.
    retired_pages: str
    remapped_rows: str
    ecc_uncorrected: str
    pcie_link: str
    persistence_mode: str
    clock_events: str


@dataclasses.dataclass(frozen=True)
class DeploymentConfig:
    # What names this deployment's own things on a host shared with other deployments (files, metrics,
    # journal): by default the config file's name without `.toml` (/etc/kimi-supervisor/NAME.toml).
    name: str
    role: Role


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """One node's place in a multi-node group on vLLM's own mp executor (torch.distributed, one rendezvous)."""

    nnodes: int  # >= 2
    node_rank: int  # 0 is the leader
    master_addr: str  # the leader's cluster address (its VLLM_HOST_IP)
    master_port: int  # the rendezvous (TCPStore) port on the leader
    # The supervisors' own read-only status endpoint (deployment/group/server.py): where this node serves it, where
    # a follower reads its leader's, where a leader reads each follower's.
    status_address: str = "127.0.0.1"
    status_port: int = 29599
    leader_status_url: str = ""  # a follower's; "" on the leader
    peers: tuple[str, ...] = ()  # a leader's: each follower's status URL, nnodes - 1 of them
    # Each peer check (a follower's status, the leader's status and master port) every probe_interval_s, each
    # bounded by probe_timeout_s; failures_tolerated in a row make the peer lost.
    probe_interval_s: float = 1.0
    probe_timeout_s: float = 1.0
    failures_tolerated: int = 3
    leader_wait_s: float = 3600.0  # a follower without a leader this long exits 20 (LEADER_LOST)
    # VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS for the child (unless child.env sets it): vLLM's own wait for a rank's
    # reply, 300 s by default, so that vLLM itself fails a hung step inside the supervisor's bounds.
    execute_model_timeout_s: int = 20
    local_world_size: int = 1  # the GPUs this node's share of the group needs (TP x PP x DP / nnodes)
    argv_digest: str = ""  # sha256 of child.argv without the rank flags: equal on every node of one group

    @property
    def detect_within_s(self) -> float:
        """The longest a lost peer goes unnoticed: failures_tolerated probes, each at most interval + timeout."""
        return self.failures_tolerated * (self.probe_interval_s + self.probe_timeout_s)


@dataclasses.dataclass(frozen=True)
class WeightsConfig:
    """The deployment's weight holder (config/weights.py): this config is the holder (role "weights") or an
    engine that maps its weights (`[weights] holder = true`)."""

    socket_dir: Path  # <runtime>/<name>/weight-cache, the same for both
    wait_s: float = 900.0  # the engine's: how long it waits for the holder to be ready, then exit 21
    health_port: int = 8099  # the holder's /health (--weight-cache-health-port)
    health_host: str = "127.0.0.1"
    key: Mapping[str, str | None] = dataclasses.field(default_factory=dict)  # config/weights.py weights_key


@dataclasses.dataclass(frozen=True)
class SpareConfig:
    """A hot spare's `[spare]` (docs/spare.md, config/spare.py): its own memory flags and the numbers its memory
    plan counts; everything else of its child is its engine's (`engine_config`, NAME.toml beside it)."""

    engine_config: Path
    kv_cache_memory_bytes: int  # --kv-cache-memory-bytes: its own KV cache, per GPU
    gpu_memory_utilization: float  # --gpu-memory-utilization: vLLM's free-memory check at its start
    max_num_seqs: int | None = None  # --max-num-seqs: fewer sequences, fewer CUDA graphs captured
    # What the memory plan counts per GPU beyond its KV cache: its CUDA context, communicators, graphs and
    # activations (measured 2.4-2.7 GiB at TP1, research/standby-and-resume.md section 2; unknown at TP8: the
    # runbook in docs/spare.md measures it).
    overhead_mib: int = 4096
    # Left free on each GPU after the weights, the engine and the spare (the plan refuses less).
    margin_mib: int = 1024
    # The engine's own memory flags, which the plan counts beside the spare's (preflight/memory_plan.py).
    engine_gpu_memory_utilization: float = 0.92
    engine_kv_cache_memory_bytes: int | None = None
    # sha256 of what decides its tokens (its argv without the socket and memory flags, its environment without
    # the RAS port): equal to its engine's, recorded in its state file.
    output_key: str = ""


@dataclasses.dataclass(frozen=True)
class ReadaheadConfig:
    # Read the model's shards ahead of vLLM while it imports and loads (host/readahead.py); off until measured.
    enabled: bool = False
    shards_ahead: int = 2  # at most this many shards beyond the one vLLM's progress line says it is on


@dataclasses.dataclass(frozen=True)
class Config:
    path: Path
    child: ChildConfig
    preflight: PreflightConfig
    readiness: ReadinessConfig
    health: HealthConfig
    shutdown: ShutdownConfig
    paths: PathsConfig
    metrics: MetricsConfig
    liveness: LivenessConfig
    gpu_health: GpuHealthConfig
    deployment: DeploymentConfig = DeploymentConfig("kimi-supervisor", Role.ENGINE)
    cluster: ClusterConfig | None = None  # None: one node
    readahead: ReadaheadConfig = ReadaheadConfig()
    weights: WeightsConfig | None = None  # None: no weight holder in this deployment
    front: FrontConfig | None = None  # a front's [front] (docs/front.md); None for every other role
    spare: SpareConfig | None = None  # a spare's [spare] (docs/spare.md); None for every other role

    @property
    def role(self) -> Role:
        return self.deployment.role

    @property
    def maps_held_weights(self) -> bool:
        """An engine that maps its deployment's holder's weights (and waits for them)."""
        return self.weights is not None and self.role is not Role.WEIGHTS  # role branch: the flag's definition
