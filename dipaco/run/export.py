"""Using a trained run: open its folder, and export one path as a Hugging Face Llama checkpoint.

``open_run`` reads a run folder as ``dipaco eval`` does: its prepared data and router, and every
module's latest version (the scheduler's store, read only, and other owners' modules as
gathered). ``export_path`` writes one path with the tensor renames and the ``LlamaConfig`` of
``dipaco.model.hf``, and the run's tokenizer as a Hugging Face tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dipaco.config import RunConfig, read_run_config
from dipaco.coordinator.store import ModuleStore
from dipaco.errors import ConfigError, DataError
from dipaco.model.hf import hf_state_dict, llama_config
from dipaco.model.topology import Topology
from dipaco.model.transformer import ModelConfig, PathModel, count_parameters
from dipaco.prepare.folder import PreparedRun
from dipaco.prepare.pipeline import prepare


@dataclass
class UsableRun:
    """A run folder opened for use: its prepared data, router, and every module's latest
    version: the scheduler's own from its store, other owners' as gathered
    (``dipaco.coordinator.gather``)."""

    prep: PreparedRun
    store: ModuleStore
    remote: dict[str, tuple[int, dict[str, torch.Tensor]]] = field(default_factory=dict)

    @property
    def config(self) -> RunConfig:
        return self.prep.config

    @property
    def topology(self) -> Topology:
        return self.config.build_topology()

    @property
    def model_config(self) -> ModelConfig:
        return self.config.build_model_config()

    def params(self, mid: str) -> dict[str, torch.Tensor]:
        if mid in self.remote:
            return self.remote[mid][1]
        return self.store.params(mid)

    def version(self, mid: str) -> int:
        if mid in self.remote:
            return self.remote[mid][0]
        return self.store.version(mid)

    def check_path(self, path: int) -> int:
        n = self.topology.num_paths
        if not isinstance(path, int) or isinstance(path, bool) or not 0 <= path < n:
            raise ConfigError(
                f"path {path!r} does not exist: topology {self.topology.spec} has {n} paths, "
                f"numbered 0 to {n - 1}"
            )
        return path

    def path_state(self, path: int) -> dict[str, torch.Tensor]:
        """Path ``path``'s dense state dict (PathModel names) from its modules' latest versions."""
        self.check_path(path)
        mids = self.topology.path_modules(path)
        return self.topology.join_modules(path, {mid: self.params(mid) for mid in mids})

    def path_model(self, path: int) -> PathModel:
        self.check_path(path)
        mids = self.topology.path_modules(path)
        model = self.topology.build_path(
            self.model_config, path, {mid: self.params(mid) for mid in mids}
        )
        return model.eval()


# What a caller that can gather other owners' modules passes to open_run: the run folder ->
# (the modules other coordinators own, those of them it gathered: module -> (version, tensors)).
Remote = Callable[[Path], tuple[set[str], dict[str, tuple[int, dict[str, torch.Tensor]]]]]


def check_run_folder(run_dir: Path) -> Path:
    """``run_dir`` is a scheduler's run folder (else a DataError saying what it is); its
    config.json."""
    config_file = run_dir / "config.json"
    if not run_dir.is_dir():
        raise DataError(f"run folder {run_dir} does not exist")
    if not config_file.exists():
        if (run_dir / "manifest.json").exists():
            raise DataError(
                f"{run_dir} is a module owner's folder, not the run's: open the scheduler's "
                f"folder (the one its `dipaco-coordinator start --config` wrote), and pass "
                f"--owner-dir {run_dir} if its owner is not running"
            )
        raise DataError(f"{run_dir} is not a run folder: it has no config.json")
    return config_file


def open_run(run_dir: str | Path, *, remote: Remote | None = None) -> UsableRun:
    """Open a run folder as ``dipaco eval`` does: its config, ``prepare`` and every module.

    Modules other coordinators own come from ``remote`` (``dipaco.coordinator.gather.whole_run``
    gathers them: the CLI passes it); without it, a run with other owners is refused, since the
    scheduler's own copies of their modules are stale.
    """
    run_dir = Path(run_dir)
    config_file = check_run_folder(run_dir)
    try:
        config = read_run_config(run_dir)
    except ValueError as exc:
        raise DataError(f"{config_file}: not valid JSON: {exc}") from None
    prep = prepare(run_dir, config)
    others, gathered = remote(run_dir) if remote is not None else (_other_owned(run_dir), {})
    if others - set(gathered):
        raise DataError(
            f"{run_dir}: modules {sorted(others - set(gathered))} are trained by other "
            f"coordinators; gather them first (dipaco gather --run-dir {run_dir})"
        )
    mids = [mid for mid in config.build_topology().module_ids() if mid not in others]
    store_root = run_dir / "coordinator"
    missing = [mid for mid in mids if not (store_root / "modules" / mid / "head.json").exists()]
    if missing:
        raise DataError(
            f"{run_dir} has no modules {missing} in {store_root / 'modules'}: "
            f"train the run first (its coordinator writes them)"
        )
    store = ModuleStore(store_root)
    store.load(mids)
    return UsableRun(prep, store, gathered)


def _other_owned(run_dir: Path) -> set[str]:
    """Modules the scheduler's saved state says other coordinators own."""
    state_file = run_dir / "coordinator" / "coordinator.json"
    try:
        state = json.loads(state_file.read_text()) if state_file.exists() else {}
    except ValueError:
        return set()
    return {mid for mid, o in (state.get("owners") or {}).items() if o != state.get("owner_id")}


def as_run(run: str | Path | UsableRun) -> UsableRun:
    """``run`` itself, or the run folder it names opened with :func:`open_run`."""
    return run if isinstance(run, UsableRun) else open_run(run)


def hf_tokenizer(model_file: str | Path):  # -> transformers.PreTrainedTokenizerFast
    """The run's sentencepiece BPE model as a ``tokenizers`` BPE with the same pieces.

    The run's settings (no normalization, no dummy prefix, byte fallback, ``\\n`` as a user
    symbol, no BOS added by ``encode``) map onto: spaces replaced by ``▁``, no pre-tokenizer,
    merges in the order of the pieces (sentencepiece BPE ranks pieces by merge order).
    """
    import sentencepiece as spm
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    n = sp.get_piece_size()
    vocab = {sp.id_to_piece(i): i for i in range(n)}
    ranked = []
    for piece, pid in vocab.items():
        if sp.is_control(pid) or sp.is_unknown(pid) or sp.is_byte(pid) or sp.is_unused(pid):
            continue
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                ranked.append((pid, vocab[left], vocab[right], left, right))
    merges = [(left, right) for *_, left, right in sorted(ranked)]
    unk = sp.id_to_piece(sp.unk_id())
    tok = Tokenizer(
        BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    # sentencepiece numbers its meta pieces (unknown, control, user-defined) before the byte
    # pieces and the learned ones: the user-defined symbols are the non-control ids before those.
    first_learned = next(
        (i for i in range(n) if sp.is_byte(i) or sp.get_score(i) < 0 or "▁" in sp.id_to_piece(i)),
        n,
    )
    user = [
        sp.id_to_piece(i)
        for i in range(first_learned)
        if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i))
    ]
    tok.add_tokens([AddedToken(p, normalized=False, special=False) for p in user])
    specials = [sp.id_to_piece(i) for i in range(n) if sp.is_control(i) or sp.is_unknown(i)]
    tok.add_special_tokens([AddedToken(p, normalized=False, special=True) for p in specials])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=sp.id_to_piece(sp.bos_id()) if sp.bos_id() >= 0 else None,
        eos_token=sp.id_to_piece(sp.eos_id()) if sp.eos_id() >= 0 else None,
        unk_token=unk,
        clean_up_tokenization_spaces=False,
        model_max_length=10**9,
    )


def export_path(run_dir: str | Path | UsableRun, path: int, out: str | Path) -> Path:
    """Write path ``path`` of a run (latest module versions) as a Hugging Face Llama checkpoint:
    ``model.safetensors``, ``config.json``, ``generation_config.json`` and the tokenizer files."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    run = as_run(run_dir)
    state = run.path_state(path)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"export target {out} exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = run.prep.tokenizer
    cfg = run.model_config
    if tokenizer.vocab_size > cfg.vocab_size:
        raise DataError(
            f"tokenizer has {tokenizer.vocab_size} pieces, more than model.vocab_size "
            f"{cfg.vocab_size}"
        )
    save_file(hf_state_dict(state), str(out / "model.safetensors"), metadata={"format": "pt"})
    llama_config(cfg, tokenizer.bos_id, tokenizer.eos_id).save_pretrained(out)
    GenerationConfig(
        bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id, do_sample=True
    ).save_pretrained(out)
    hf_tokenizer(run.prep.root / "tokenizer.model").save_pretrained(out)
    topology = run.topology
    (out / "dipaco_path.json").write_text(
        json.dumps(
            {
                "run_dir": str(run.prep.root),
                "path": path,
                "topology": topology.spec,
                "modules": {mid: run.version(mid) for mid in topology.path_modules(path)},
                "parameters": count_parameters(state),
            },
            indent=2,
        )
    )
    return out
