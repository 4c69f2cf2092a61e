"""The run configuration a user writes (TOML), validated with errors that name the field.

Presets are starting points: ``demo`` is the calibrated tiny DiPaCo that finishes in about ten
minutes on two CPU cores (see docs/results.md); ``tiny`` is for tests.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dipaco.errors import ConfigError
from dipaco.model.topology import Topology
from dipaco.model.transformer import ModelConfig


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Section):
    vocab_size: int = Field(4096, ge=256, le=1 << 20)
    dim: int = Field(128, gt=0)
    n_layers: int = Field(4, gt=0)
    n_heads: int = Field(4, gt=0)
    ffn_hidden: int = Field(0, ge=0)
    max_seq_len: int = Field(128, gt=0)


class TopologySection(_Section):
    levels: str = "2x2"
    shared: list[Literal["embed", "head"]] = ["embed", "head"]
    private_blocks_before: int = Field(0, ge=0)
    private_blocks_after: int = Field(0, ge=0)
    blocks_per_level: list[int] | None = None
    # Workers per module combination, each with its own shard: "1" with 4 replicas is DiLoCo-4.
    replicas: int = Field(1, ge=1)


class DataSection(_Section):
    source: str = "builtin"
    text_field: str = "text"
    max_docs: int | None = Field(None, gt=0)
    val_fraction: float = Field(0.03, gt=0, lt=0.5)
    heldout_fraction: float = Field(0.05, ge=0, lt=0.5)
    tokenizer_sample_chars: int = Field(3_000_000, gt=10_000)
    min_doc_tokens: int = Field(64, ge=33)
    # Characters without a piece spelled in bytes (256 of the vocabulary's pieces); off, they are
    # the unknown token, for vocabularies of a few hundred pieces (bench/regime.py's tiny paths).
    byte_fallback: bool = True


class RoutingSection(_Section):
    # kmeans / product: generative routing on prefix features (§2.4.1, §7.3); iid: documents
    # spread by a hash of their id (the i.i.d. shards of DiLoCo's baseline).
    method: Literal["kmeans", "product", "iid"] = "kmeans"
    balance: float = Field(0.5, ge=0, le=1)
    prefix_tokens: int = Field(32, gt=0)
    # What the router reads of the prefix: "hidden" (the paper's: the initial LM's mean
    # last-block state) or "tokens" (a bag of the prefix's token ids; dipaco.routing.features).
    features: Literal["hidden", "tokens"] = "hidden"
    # Overlapping shards (§2.4.4): each training document goes to its top-n paths; never at eval.
    overlap: int = Field(1, ge=1)
    # Discriminative phases (§2.4.2): after each listed round, score the router documents under
    # every path, fit a logistic-regression router on their best paths, and re-shard.
    discriminative_after: list[int] = []
    # Or decided from held-out losses: a phase starts once the paths' mean held-out loss improved
    # by less than this fraction over one round (0: off), at most discriminative_phases times.
    discriminative_plateau: float = Field(0.0, ge=0, lt=1)
    discriminative_phases: int = Field(1, ge=1)
    # Training documents reserved (by a hash of their id) as the router documents: never trained on.
    router_fraction: float = Field(0.05, ge=0, lt=0.5)
    # Score only each router document's top-c generative candidates (None: every path).
    candidates: int | None = Field(None, ge=1)
    # Route a document by its first block of prefix_tokens tokens that is not an opening shared
    # by at least this fraction of the training documents (licence headers, include blocks;
    # 0: off, the paper's first tokens). The openings are kept in openings.json.
    skip_openings: float = Field(0.0, ge=0, lt=1)


class TrainSection(_Section):
    seed: int = 0
    batch_size: int = Field(16, gt=0)
    seq_len: int = Field(128, gt=1)
    lr: float = Field(2e-3, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: int = Field(20, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    pretrain_steps: int = Field(60, ge=0)
    inner_steps: int = Field(25, gt=0)
    rounds: int = Field(8, gt=0)


class OuterSection(_Section):
    # Unset: the paper's Nesterov step (lr 0.7, momentum 0.9), or, with a sparse codec
    # (network.codec topk2/topk4), plain steps of lr 2.5 without momentum: the peers' error
    # feedback stands in for it (SparseLoCo; docs/results.md, "Sparse deltas"); with sign1,
    # lr 1.0 and momentum 0.5 (docs/results.md, "One bit an element").
    lr: float | None = Field(None, gt=0)
    momentum: float | None = Field(None, ge=0, lt=1)
    nesterov: bool = True
    # How a module's averaged delta is scaled by the number n of paths reporting: none, sqrt
    # (the paper's section 2.7), linear (n), or norm (to the mean norm of the deltas, at most
    # sqrt(n)); docs/results.md has the sweep that chose the default.
    rescale: Literal["none", "sqrt", "linear", "norm"] = "norm"
    weight_by_tokens: bool = True
    # Outer-lr warm-up: a module's k-th outer step uses lr * min(1, k / warmup_rounds).
    warmup_rounds: int = Field(0, ge=0)
    # An outer lr per module by its sharing count: {4: 0.7, 16: 1.0} steps the modules that 4
    # paths go through at 0.7 and those 16 share at 1.0 (an average of more deltas is less
    # noisy and stands a larger step: docs/results.md, the regime ladder); others use lr.
    lr_by_sharing: dict[int, float] = {}

    @model_validator(mode="after")
    def _sharing_lrs(self) -> OuterSection:
        for n, lr in self.lr_by_sharing.items():
            if n < 1 or not lr > 0:
                raise ValueError(
                    f"outer.lr_by_sharing maps sharing counts >= 1 to positive rates, got {n}: {lr}"
                )
        return self


class ValidationSection(_Section):
    # The delta-norm check, per module, against the norms of its last accepted deltas: a delta
    # whose norm exceeds median + norm_mads * MAD *and* norm_ratio * median (once there are
    # min_observations norms) is rejected ("huge-norm"), clipped to that bound, or let through.
    norm_check: Literal["off", "reject", "clip"] = "reject"
    norm_mads: float = Field(6.0, ge=0)
    norm_ratio: float = Field(3.0, ge=1)
    min_observations: int = Field(4, ge=1)
    norm_window: int = Field(64, ge=1)  # accepted norms remembered per module
    # An absolute bound on any delta's norm, from the first round (reject, or clip in clip mode).
    max_norm: float | None = Field(None, gt=0)
    # How a module combines its paths' deltas: the token-weighted mean (the paper), or a robust
    # coordinate-wise trimmed mean or median once at least min_paths_for_robust keys report
    # (one vote per key); with fewer, each delta is clipped to norm_ratio times the median norm
    # before the mean. "auto": trimmed_mean when anyone may join (security.join = "open"), mean
    # on an allow-list (docs/security.md, "What one key can do", has the measurements).
    aggregation: Literal["auto", "mean", "trimmed_mean", "median"] = "auto"
    trim_fraction: float = Field(0.2, ge=0, lt=0.5)  # per end, rounded up, of the paths
    min_paths_for_robust: int = Field(3, ge=2)
    # Score the path with the proposed update on held-out documents; reject ("worse-heldout")
    # when its loss rises by more than heldout_tolerance (nats per token) over the current one,
    # keep a usefulness score per key (keyscores.KeyScores: "low-score", trust weights) and
    # weigh a delta by its gain against other keys' recent gains (a step that helps nobody
    # counts next to nothing). "auto": on when anyone may join (security.join = "open"), off on
    # an allow-list (docs/security.md, "What one key can do", has the measurements).
    heldout_check: bool | Literal["auto"] = "auto"
    heldout_tolerance: float = Field(0.1, ge=0)
    heldout_docs: int = Field(8, ge=1)  # held-out documents scored per check
    # With the held-out check, also score each delta on one held-out document of each of
    # heldout_docs other paths (two more forward passes): a key whose deltas help other paths'
    # documents more than their own (twice, half the time or more, in a run where three in four
    # of other keys' deltas do the opposite) was likely trained on another path's shard, and its
    # further such deltas are weighed 0.02 and refused ("low-score"). Off by default: some honest
    # paths help others' documents more at every round (4 and 2 honest deltas refused in the two
    # bench corpora, docs/security.md "Lazy keys").
    offshard_check: bool = False
    # Refuse a delta that copies one this coordinator stored before at the module ("copied"):
    # at least this correlation on a secret sample of the module's coordinates (copies.py; honest
    # deltas measured at most 0.995; 0.9999 refuses copies). None: off. "auto" (the default):
    # 0.9999 where the held-out check is on, which tells a diverging run (whose honest deltas
    # are copies of each other: its paths' held-out losses above where they started), and then
    # lets copies through; off where it is not (docs/security.md). false: off.
    copy_cosine: float | None | Literal["auto"] = "auto"

    @field_validator("copy_cosine", mode="before")
    @classmethod
    def _cosine(cls, v: object) -> object:
        if v is False:
            return None
        if isinstance(v, bool) or (isinstance(v, float | int) and not 0 < v <= 1):
            raise ValueError(f'copy_cosine is a correlation in (0, 1], "auto" or false, got {v}')
        return v

    @model_validator(mode="after")
    def _window(self) -> ValidationSection:
        if self.norm_window < self.min_observations:
            raise ValueError(
                f"validation.norm_window ({self.norm_window}) must hold at least "
                f"min_observations ({self.min_observations}) norms"
            )
        return self


class SchedulerSection(_Section):
    # A peer that sends no heartbeat for this long has vanished: its task is re-issued.
    lease_seconds: float = Field(300.0, gt=0)
    heartbeat_seconds: float = Field(5.0, gt=0)
    # Round deadlines come from observed durations: median + max(k * MAD, slack * median),
    # once there are enough observations; before that a round waits for every path.
    deadline_mads: float = Field(4.0, ge=0)
    deadline_slack: float = Field(0.5, ge=0)
    deadline_floor: float = Field(10.0, ge=0)  # never a deadline shorter than this (seconds)
    min_observations: int = Field(4, ge=1)
    # At its deadline a module's round closes if this fraction of its paths has reported.
    quorum: float = Field(0.5, gt=0, le=1)
    # Deltas up to this many versions late are applied, their weight damped per version late.
    max_staleness: int = Field(1, ge=0)
    stale_damping: float = Field(0.5, gt=0, le=1)
    # A slow peer gets fewer inner steps (never below this fraction of H) to finish in time.
    min_step_fraction: float = Field(0.25, gt=0, le=1)
    # Peers wait less for a round: a peer that finds no open path gets the next round of a
    # path it trained for this one, from where that ended (one round stale, applied with the
    # staleness rule above). The outer step is the run's, as without overlap. docs/operations.md.
    overlap: bool = False
    # Where such a task starts: "end", where the peer's last task of the path ended (the
    # release minus its whole delta); "eager", the release plus the step the module is likely
    # to take: the peer's delta as one of the module's paths (1/n of it) and, for the others,
    # the module's last step (eager updates, Kale et al. 2025). docs/operations.md "Overlap".
    overlap_start: Literal["end", "eager"] = "end"
    # A peer with nothing else to train gets a copy of a straggler's task (one that has run
    # longer than the typical task): the first delta of the path for its round is applied,
    # the other holder's lease ends. Costs duplicate compute; a round waits less for its
    # slowest peer, at the start of a run and in its last round above all. "last": copies only
    # in the run's last round, which no task can be trained ahead of (with overlap, the
    # rounds before keep the peers busy without wasting the slow ones' work).
    hedge: bool | Literal["last"] = False


TOPK_DENSITY = 1 / 8  # network.topk_density's default (codecs.SPARSE_DENSITY, the same)


class NetworkSection(_Section):
    # How deltas travel: lossless float32, fp16, bf16, int8 blockwise, scaled signs (sign1, a
    # bit an element), or chunked top-k with 2- or 4-bit values; the lossy ones with error
    # feedback.
    codec: Literal["lossless", "fp16", "bf16", "int8", "sign1", "topk2", "topk4"] = "lossless"
    # Top-k: the share of each 4096-element chunk a delta sends.
    topk_density: float = Field(TOPK_DENSITY, gt=0, le=1)
    # The weight of a peer's residual in its next delta (SparseLoCo's beta; 1 keeps all of it).
    # Unset: 0.9 with a sparse codec, 1 otherwise (docs/results.md, "Sparse deltas").
    error_feedback_decay: float | None = Field(None, gt=0, le=1)

    @property
    def sparse(self) -> bool:
        return self.codec in ("topk2", "topk4")

    @property
    def decay(self) -> float:
        """``error_feedback_decay`` as set, else the default for the codec."""
        if self.error_feedback_decay is not None:
            return self.error_feedback_decay
        return SPARSE_FEEDBACK_DECAY if self.sparse else 1.0


# The outer step's defaults (OuterSection): the paper's, and those measured for sparse deltas.
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
SPARSE_OUTER_LR, SPARSE_OUTER_MOMENTUM = 2.5, 0.0
SIGN_OUTER_LR, SIGN_OUTER_MOMENTUM = 1.0, 0.5  # with network.codec sign1 (measured)
SPARSE_FEEDBACK_DECAY = 0.9  # network.error_feedback_decay's default with a sparse codec


def outer_lr_momentum(c: RunConfig) -> tuple[float, float]:
    """The run's outer lr and momentum: as set, else the defaults for its codec (sparse, sign1:
    docs/results.md). Overlap keeps the paper's step: which step is better depended on H and
    the peers' speeds, the same with overlap on and off (docs/operations.md "Overlap")."""
    if c.network.sparse:
        lr, momentum = SPARSE_OUTER_LR, SPARSE_OUTER_MOMENTUM
    elif c.network.codec == "sign1":
        lr, momentum = SIGN_OUTER_LR, SIGN_OUTER_MOMENTUM
    else:
        lr, momentum = OUTER_LR, OUTER_MOMENTUM
    return (
        c.outer.lr if c.outer.lr is not None else lr,
        c.outer.momentum if c.outer.momentum is not None else momentum,
    )


class EvalSection(_Section):
    max_docs: int | None = Field(None, gt=0)
    every_round: bool = True
    # Per-path early stopping: after every round each path's loss on its shard's held-out slice
    # is measured and the path's parameters at its lowest loss are kept (paper Table 3).
    early_stopping: bool = False
    # Final evaluations that re-route every W tokens (§2.4.3), e.g. [64, 32].
    reroute_windows: list[int] = []


class SecuritySection(_Section):
    # open: anyone with a key may join, within the quotas below; allow-list: only keys allowed
    # with `dipaco-coordinator allow KEY` (revocable while the run goes on).
    join: Literal["open", "allow-list"] = "open"
    # Signed requests whose timestamp is further than this from the coordinator's clock are
    # refused (reason clock-skew); nonces are remembered for twice this long against replays.
    clock_skew_seconds: float = Field(300.0, gt=0)
    # Per key: a token bucket of requests (rate per second, burst).
    requests_per_second: float = Field(50.0, gt=0)
    burst: int = Field(400, ge=1)
    # Live tasks one key may hold, and peer ids one key may use (in both join modes).
    max_tasks_per_key: int = Field(8, ge=1)
    max_names_per_key: int = Field(16, ge=1)
    # A key whose requests were refused this many times for hostile reasons (forged, malformed,
    # poisoned, not its task...) is banned; 0 never bans.
    ban_after: int = Field(20, ge=0)


class FlowerSection(_Section):
    # Under `--transport flower` (docs/flower.md). A round waits for every node's reply, at most
    # round_timeout seconds; once `quorum` of its nodes have replied, the rest get
    # straggler_seconds more. A node that has not replied by then loses its task (the path is
    # trained in a later round) and is asked to say hello before it gets another.
    round_timeout: float = Field(900.0, gt=0)
    quorum: float = Field(0.5, gt=0, le=1)
    straggler_seconds: float = Field(120.0, ge=0)
    poll_seconds: float = Field(0.2, gt=0)
    # Shard files a node lacks travel inside the task's message, up to this size in all;
    # beyond it the node must be given the run's shards some other way (docs/flower.md).
    max_bundle_mb: float = Field(512.0, gt=0)


class RunConfig(_Section):
    name: str = "run"
    model: ModelSection = ModelSection()
    topology: TopologySection = TopologySection()
    data: DataSection = DataSection()
    routing: RoutingSection = RoutingSection()
    train: TrainSection = TrainSection()
    outer: OuterSection = OuterSection()
    validation: ValidationSection = ValidationSection()
    scheduler: SchedulerSection = SchedulerSection()
    network: NetworkSection = NetworkSection()
    eval: EvalSection = EvalSection()
    security: SecuritySection = SecuritySection()
    flower: FlowerSection = FlowerSection()
    baseline: bool = True

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        if self.train.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"train.seq_len ({self.train.seq_len}) exceeds model.max_seq_len ({self.model.max_seq_len})"
            )
        if self.routing.prefix_tokens >= self.train.seq_len:
            raise ValueError("routing.prefix_tokens must be shorter than train.seq_len")
        paths = self.build_topology().num_paths
        if self.routing.overlap > paths:
            raise ValueError(f"routing.overlap ({self.routing.overlap}) exceeds the {paths} paths")
        bad = [r for r in self.routing.discriminative_after if not 0 < r < self.train.rounds]
        if bad or len(set(self.routing.discriminative_after)) != len(
            self.routing.discriminative_after
        ):
            raise ValueError(
                f"routing.discriminative_after must list distinct rounds between 1 and "
                f"train.rounds - 1 ({self.train.rounds - 1}), got {self.routing.discriminative_after}"
            )
        phases = self.routing.discriminative_after or self.routing.discriminative_plateau > 0
        if self.routing.discriminative_after and self.routing.discriminative_plateau > 0:
            raise ValueError(
                "routing.discriminative_after and routing.discriminative_plateau both choose when "
                "phases run: set one"
            )
        if phases and self.routing.method == "iid":
            raise ValueError("discriminative phases need feature routing, not routing.method iid")
        if phases and self.routing.router_fraction == 0:
            raise ValueError(
                "discriminative phases need router documents: routing.router_fraction > 0"
            )
        if any(w < 1 for w in self.eval.reroute_windows):
            raise ValueError("eval.reroute_windows must be positive token counts")
        self.build_model_config()
        self.build_topology()
        return self

    def build_model_config(self) -> ModelConfig:
        return ModelConfig(**self.model.model_dump())

    def build_topology(self) -> Topology:
        t = self.topology
        return Topology.parse(
            t.levels,
            self.model.n_layers,
            shared=tuple(t.shared),
            private_blocks_before=t.private_blocks_before,
            private_blocks_after=t.private_blocks_after,
            blocks_per_level=t.blocks_per_level,
            replicas=t.replicas,
        )

    @property
    def total_steps(self) -> int:
        """Inner steps of one path over the run, pretraining included (the LR schedule's length)."""
        return self.train.pretrain_steps + self.train.inner_steps * self.train.rounds

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")

    def content_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()

    def replace(self, **sections: dict) -> RunConfig:
        """A copy with some sections' fields overridden, validated again."""
        data = self.to_dict()
        for section, values in sections.items():
            if isinstance(values, dict):
                data[section] = {**data[section], **values}
            else:
                data[section] = values
        return load_config_dict(data)


def load_config_dict(data: dict, origin: str = "config") -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(top)'}: {err['msg']}"
            for err in exc.errors()
        )
        raise ConfigError(f"{origin}: {problems}") from None
    except ConfigError as exc:
        raise ConfigError(f"{origin}: {exc}") from None


def read_run_config(run_dir: str | Path) -> RunConfig:
    """The config a run folder saved (its ``config.json``), validated."""
    file = Path(run_dir) / "config.json"
    return load_config_dict(json.loads(file.read_text()), origin=str(file))


def load_config(path: str | Path) -> RunConfig:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (TOML files are UTF-8): {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    preset = data.pop("preset", None)
    if preset is not None:
        if not isinstance(preset, str):
            raise ConfigError(f"{path}: preset must be a preset's name, got {preset!r}")
        base = preset_config(preset).to_dict()
        for key, value in data.items():
            base[key] = {**base[key], **value} if isinstance(value, dict) and key in base else value
        data = base
    return load_config_dict(data, origin=str(path))


PRESETS: dict[str, dict] = {
    # Calibrated on 2 CPU cores (docs/design.md, "Measured before the code"): width 128, 4 layers,
    # seq 128, batch 16, 60 pretraining steps then 8 rounds of H = 25: about ten minutes in all.
    # Local presets: peers are equal threads or processes on one machine, so rounds wait for
    # every path and every task is H steps: runs are deterministic, bit for bit.
    "demo": {"name": "demo", "scheduler": {"quorum": 1.0, "min_step_fraction": 1.0}},
    "tiny": {
        "name": "tiny",
        "model": {"vocab_size": 512, "dim": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": 64},
        "data": {"max_docs": 400, "tokenizer_sample_chars": 300_000},
        "train": {
            "batch_size": 8,
            "seq_len": 64,
            "lr": 3e-3,
            "warmup_steps": 4,
            "pretrain_steps": 20,
            "inner_steps": 8,
            "rounds": 3,
        },
        "scheduler": {
            "lease_seconds": 60.0,
            "heartbeat_seconds": 1.0,
            "quorum": 1.0,
            "min_step_fraction": 1.0,
        },
        "eval": {"max_docs": 40},
    },
}


def preset_config(name: str) -> RunConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return load_config_dict(PRESETS[name], origin=f"preset {name}")
