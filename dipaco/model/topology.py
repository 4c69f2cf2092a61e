"""Topology: levels of modules, the paths through them, and how a path's tensors split into modules.

DiPaCo section 2.3 and 2.6: parameters are partitioned into levels of consecutive transformer
blocks; level l offers K_l modules and a path takes one module per level (P = prod K_l paths,
numbered row-major). Parts shared by every path (embedding; final norm with output head) are
modules of their own; parts that are not shared are path-private modules, which still go
through the outer optimizer (paper footnote 1) but are never mixed with another path's.

Module ids: ``L{level}.M{index}`` for level modules, ``S.embed`` / ``S.head`` for shared parts,
``P{path}.embed`` / ``P{path}.head`` / ``P{path}.pre`` / ``P{path}.post`` for private parts.

``replicas`` > 1 gives every module combination that many workers, each with its own data shard
and its own task per round, all pushing into the same modules: topology ``1`` with 4 replicas is
DiLoCo with 4 workers on one dense model (DiLoCo is DiPaCo with one path and k data shards).
Replicas of a combination share everything, private parts included; with replicas, path ``p``
(a worker) takes the module combination ``p // replicas``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

from dipaco.errors import ConfigError, DataError
from dipaco.model.transformer import ModelConfig, PathModel

PARTS = ("embed", "head")
_PART_PREFIXES = {"embed": ("embed_tokens.",), "head": ("norm.", "lm_head.")}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")

ModuleState = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Topology:
    levels: tuple[int, ...]
    blocks_per_level: tuple[int, ...]
    shared: tuple[str, ...] = PARTS
    private_blocks_before: int = 0
    private_blocks_after: int = 0
    replicas: int = 1
    _segments: tuple = field(init=False, repr=False, compare=False)
    # Answers of path_modules / module_ids / paths_through, computed once: the coordinator asks
    # them for every path on every request.
    _cache: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.levels or any(k < 1 for k in self.levels):
            raise ConfigError(f"topology levels must be positive module counts, got {self.levels}")
        if len(self.blocks_per_level) != len(self.levels) or any(
            b < 1 for b in self.blocks_per_level
        ):
            raise ConfigError(
                f"topology needs a positive block count per level, got {self.blocks_per_level} "
                f"for {len(self.levels)} levels"
            )
        unknown = set(self.shared) - set(PARTS)
        if unknown:
            raise ConfigError(f"topology.shared may name {list(PARTS)}, got {sorted(unknown)}")
        if self.private_blocks_before < 0 or self.private_blocks_after < 0:
            raise ConfigError("private block counts must be >= 0")
        if self.replicas < 1:
            raise ConfigError(f"topology replicas must be >= 1, got {self.replicas}")
        segments, start = [], 0
        if self.private_blocks_before:
            segments.append(("pre", start, self.private_blocks_before))
            start += self.private_blocks_before
        for level, n in enumerate(self.blocks_per_level):
            segments.append((level, start, n))
            start += n
        if self.private_blocks_after:
            segments.append(("post", start, self.private_blocks_after))
        object.__setattr__(self, "_segments", tuple(segments))
        object.__setattr__(self, "_cache", {})

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def parse(
        cls,
        spec: str,
        n_layers: int,
        *,
        shared: tuple[str, ...] | list[str] = PARTS,
        private_blocks_before: int = 0,
        private_blocks_after: int = 0,
        blocks_per_level: tuple[int, ...] | list[int] | None = None,
        replicas: int = 1,
    ) -> Topology:
        """``"2x2"``, ``"4x4"``, ``"16x16"``; ``"1"`` is dense; ``"8"`` is one level of 8."""
        try:
            levels = tuple(int(k) for k in spec.lower().split("x"))
        except ValueError:
            raise ConfigError(
                f"topology {spec!r} is not module counts joined by 'x' (e.g. '2x2', '1', '4x4')"
            ) from None
        trunk = n_layers - private_blocks_before - private_blocks_after
        if blocks_per_level is None:
            if trunk < len(levels) or trunk % len(levels):
                raise ConfigError(
                    f"topology {spec!r}: {trunk} shared-trunk blocks do not split evenly into "
                    f"{len(levels)} levels; set blocks_per_level or change model.n_layers"
                )
            blocks_per_level = (trunk // len(levels),) * len(levels)
        if sum(blocks_per_level) != trunk:
            raise ConfigError(
                f"blocks_per_level {tuple(blocks_per_level)} sums to {sum(blocks_per_level)}, "
                f"but the model has {trunk} blocks outside the private ones"
            )
        return cls(
            levels,
            tuple(blocks_per_level),
            tuple(shared),
            private_blocks_before,
            private_blocks_after,
            replicas,
        )

    @property
    def spec(self) -> str:
        spec = "x".join(str(k) for k in self.levels)
        return spec if self.replicas == 1 else f"{spec} ({self.replicas} replicas)"

    @property
    def routing_levels(self) -> list[int]:
        """What a router chooses among: the levels, then the replica as one more choice."""
        return [*self.levels, self.replicas] if self.replicas > 1 else list(self.levels)

    @property
    def n_layers(self) -> int:
        return sum(n for _, _, n in self._segments)

    @property
    def num_paths(self) -> int:
        return math.prod(self.levels) * self.replicas

    def to_dict(self) -> dict:
        return {
            "levels": list(self.levels),
            "blocks_per_level": list(self.blocks_per_level),
            "shared": list(self.shared),
            "private_blocks_before": self.private_blocks_before,
            "private_blocks_after": self.private_blocks_after,
            "replicas": self.replicas,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Topology:
        return cls(
            tuple(d["levels"]),
            tuple(d["blocks_per_level"]),
            tuple(d["shared"]),
            d.get("private_blocks_before", 0),
            d.get("private_blocks_after", 0),
            d.get("replicas", 1),
        )

    # ---- paths and modules --------------------------------------------------------------------
    def choices(self, path: int) -> tuple[int, ...]:
        """Module index per level for a path (row-major numbering)."""
        if not 0 <= path < self.num_paths:
            raise ConfigError(f"path {path} out of range for topology {self.spec}")
        path //= self.replicas
        out = []
        for k in reversed(self.levels):
            out.append(path % k)
            path //= k
        return tuple(reversed(out))

    def path_of(self, choices: tuple[int, ...] | list[int], replica: int = 0) -> int:
        p = 0
        for c, k in zip(choices, self.levels, strict=True):
            p = p * k + c
        return p * self.replicas + replica

    def path_modules(self, path: int) -> list[str]:
        """Module ids of a path, in model order."""
        key = ("path_modules", path)
        if key not in self._cache:
            self._cache[key] = tuple(self._path_modules(path))
        return list(self._cache[key])

    def _path_modules(self, path: int) -> list[str]:
        choice = self.choices(path)
        owner = path // self.replicas  # replicas of a combination share its private parts
        mids = [self._part_id("embed", owner)]
        for seg, _, _ in self._segments:
            mids.append(f"P{owner}.{seg}" if isinstance(seg, str) else f"L{seg}.M{choice[seg]}")
        mids.append(self._part_id("head", owner))
        return mids

    def module_ids(self) -> list[str]:
        if "module_ids" not in self._cache:
            self._cache["module_ids"] = tuple(self._module_ids())
        return list(self._cache["module_ids"])

    def _module_ids(self) -> list[str]:
        seen: dict[str, None] = {}
        for p in range(self.num_paths):
            for mid in self.path_modules(p):
                seen.setdefault(mid, None)
        return sorted(seen, key=self._sort_key)

    def paths_through(self, module_id: str) -> list[int]:
        key = ("paths_through", module_id)
        if key not in self._cache:
            self._cache[key] = tuple(self._paths_through(module_id))
        return list(self._cache[key])

    def _paths_through(self, module_id: str) -> list[int]:
        paths = [p for p in range(self.num_paths) if module_id in self.path_modules(p)]
        if not paths:
            raise ConfigError(f"unknown module id {module_id!r} for topology {self.spec}")
        return paths

    def _part_id(self, part: str, path: int) -> str:
        return f"S.{part}" if part in self.shared else f"P{path}.{part}"

    @staticmethod
    def _sort_key(mid: str) -> tuple:
        return (
            mid[0] != "S",
            mid[0] != "L",
            [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", mid)],
        )

    # ---- tensors ------------------------------------------------------------------------------
    def split_path_state(self, path: int, state: dict[str, torch.Tensor]) -> dict[str, ModuleState]:
        """A path's state dict cut into its modules' state dicts (layer indices made local)."""
        mids = self.path_modules(path)
        out: dict[str, ModuleState] = {mid: {} for mid in mids}
        embed_mid, head_mid = mids[0], mids[-1]
        for name, tensor in state.items():
            m = _LAYER.match(name)
            if m:
                index, rest = int(m.group(1)), m.group(2)
                for (_, start, n), mid in zip(self._segments, mids[1:-1], strict=True):
                    if start <= index < start + n:
                        out[mid][f"layers.{index - start}.{rest}"] = tensor
                        break
                else:
                    raise ConfigError(f"parameter {name} lies outside topology {self.spec}")
            elif name.startswith(_PART_PREFIXES["embed"]):
                out[embed_mid][name] = tensor
            elif name.startswith(_PART_PREFIXES["head"]):
                out[head_mid][name] = tensor
            else:
                raise ConfigError(f"parameter {name} belongs to no module")
        return out

    def join_modules(self, path: int, modules: dict[str, ModuleState]) -> dict[str, torch.Tensor]:
        """The inverse of :meth:`split_path_state`: modules' tensors to one path state dict."""
        mids = self.path_modules(path)
        missing = [mid for mid in mids if mid not in modules]
        if missing:
            raise ConfigError(f"path P{path} needs modules {missing}")
        state: dict[str, torch.Tensor] = {}
        state.update(modules[mids[0]])
        for (_, start, _), mid in zip(self._segments, mids[1:-1], strict=True):
            for name, tensor in modules[mid].items():
                m = _LAYER.match(name)
                if not m:
                    raise ConfigError(f"module {mid} has a non-layer tensor {name}")
                state[f"layers.{int(m.group(1)) + start}.{m.group(2)}"] = tensor
        state.update(modules[mids[-1]])
        return state

    def build_path(self, cfg: ModelConfig, path: int, modules: dict[str, ModuleState]) -> PathModel:
        """A path model made from its modules' tensors alone (no full model is ever built)."""
        if cfg.n_layers != self.n_layers:
            raise ConfigError(
                f"model has {cfg.n_layers} layers, topology {self.spec} has {self.n_layers}"
            )
        with torch.device("meta"):
            model = PathModel(cfg)
        state = self.join_modules(path, modules)
        _check_state(model.state_dict(), state)
        model.load_state_dict(state, strict=True, assign=True)
        return model

    def load_path(self, model: torch.nn.Module, path: int, modules: dict[str, ModuleState]) -> None:
        """Copy the modules' tensors into ``model`` (a path model built before, of ``path``), in
        place: the same checks as :meth:`build_path`, no new tensors."""
        state = self.join_modules(path, modules)
        _check_state(model.state_dict(), state)
        with torch.no_grad():
            for name, tensor in model.state_dict().items():
                tensor.copy_(state[name])

    def init_modules(self, dense_state: dict[str, torch.Tensor]) -> dict[str, ModuleState]:
        """Every module starts from the pretrained dense model's weights (paper, Algorithm 1)."""
        modules: dict[str, ModuleState] = {}
        for p in range(self.num_paths):
            for mid, tensors in self.split_path_state(p, dense_state).items():
                modules.setdefault(
                    mid, {k: v.detach().clone().contiguous() for k, v in tensors.items()}
                )
        return modules

    def parameter_counts(self, cfg: ModelConfig) -> dict[str, int]:
        """Parameters per module id, per path, and in total."""
        with torch.device("meta"):
            state = PathModel(cfg).state_dict()
        per_module: dict[str, int] = {}
        for p in range(self.num_paths):
            for mid, tensors in self.split_path_state(p, state).items():
                per_module[mid] = sum(t.numel() for t in tensors.values())
        per_path = sum(per_module[mid] for mid in self.path_modules(0))
        return {"per_path": per_path, "total": sum(per_module.values()), "modules": per_module}


def _check_state(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    """DataError unless ``got`` has exactly ``want``'s tensors, shapes and dtypes, all finite:
    modules come from a coordinator over the network, and a malformed one must abort a task
    with a reason, not fail deep inside ``load_state_dict`` or train on NaN."""
    if set(got) != set(want):
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        raise DataError(f"malformed modules: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, ref in want.items():
        t = got[name]
        if not isinstance(t, torch.Tensor) or t.shape != ref.shape or t.dtype != ref.dtype:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise DataError(
                f"malformed modules: {name} is {shape}, expected {tuple(ref.shape)} {ref.dtype}"
            )
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise DataError(f"malformed modules: {name} holds NaN or infinity")
