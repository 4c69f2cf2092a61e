"""Using a trained run: export one path as a Hugging Face Llama checkpoint, and generate text.

A DiPaCo path is a dense Llama-style decoder (``dipaco.model.transformer``): its parameter names
already follow Hugging Face's Llama and its rotary embedding uses Llama's rotate-half layout, so
an export renames tensors (``model.`` prefix) and writes them unchanged, no q/k permutation.
The embedding and output head are separate modules, so ``tie_word_embeddings`` is False.

Generation routes the prompt exactly as a validation document is routed: the run's router on the
mean last-block state of the initial (pretrained dense) model over the first
``routing.prefix_tokens`` tokens. With ``reroute_every`` it re-routes every N generated tokens on
the last ``min(N, prefix_tokens)`` positions, as test-time re-routing does
(``dipaco.routing.evaluate.chunk_routes``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dipaco.config import RunConfig, load_config_dict
from dipaco.coordinator.prepare import PreparedRun, prepare
from dipaco.coordinator.store import ModuleStore
from dipaco.errors import ConfigError, DataError
from dipaco.model.topology import Topology
from dipaco.model.transformer import ModelConfig, PathModel, count_parameters
from dipaco.routing.features import finish_features, position_features, prefix_features


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


def open_run(run_dir: str | Path, *, remote: Remote | None = None) -> UsableRun:
    """Open a run folder as ``dipaco eval`` does: its config, ``prepare`` and every module.

    Modules other coordinators own come from ``remote`` (``dipaco.coordinator.gather.whole_run``
    gathers them: the CLI passes it); without it, a run with other owners is refused, since the
    scheduler's own copies of their modules are stale.
    """
    run_dir = Path(run_dir)
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
    try:
        raw = json.loads(config_file.read_text())
    except ValueError as exc:
        raise DataError(f"{config_file}: not valid JSON: {exc}") from None
    config = load_config_dict(raw, origin=str(config_file))
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


def _as_run(run: str | Path | UsableRun) -> UsableRun:
    return run if isinstance(run, UsableRun) else open_run(run)


# ---- export -----------------------------------------------------------------------------------


def hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PathModel names to LlamaForCausalLM names (everything but ``lm_head`` under ``model.``)."""
    return {
        (name if name.startswith("lm_head.") else f"model.{name}"): t.detach().contiguous().clone()
        for name, t in state.items()
    }


def llama_config(cfg: ModelConfig, tokenizer_bos: int, tokenizer_eos: int):  # -> LlamaConfig
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.hidden,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        bos_token_id=tokenizer_bos,
        eos_token_id=tokenizer_eos,
        pad_token_id=None,
        torch_dtype="float32",
    )


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

    run = _as_run(run_dir)
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


# ---- dipaco's own forward pass and routing ----------------------------------------------------


@torch.no_grad()
def path_logits(
    run_dir: str | Path | UsableRun, path: int, input_ids: torch.Tensor | list[int]
) -> torch.Tensor:
    """Path ``path``'s logits (B, T, V), float32, from dipaco's own PathModel."""
    run = _as_run(run_dir)
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids[None]
    return run.path_model(path)(ids).float()


def route_tokens(run: UsableRun, ids: list[int], initial: PathModel | None = None) -> int:
    """The path a document starting with ``ids`` goes to (prefix routing, as in ``prepare``)."""
    if not ids:
        raise DataError("cannot route an empty prompt: give at least one token of text")
    if run.prep.router is None:
        return 0  # i.i.d. shards: no router; every path is a model of the whole data
    initial = initial if initial is not None else run.prep.initial_model()
    feats = prefix_features(
        initial,
        [np.asarray(ids, dtype=np.int64)],
        run.config.routing.prefix_tokens,
        kind=run.config.routing.features,
    )
    return int(np.asarray(run.prep.router.assign(feats))[0])


@torch.no_grad()
def _reroute(run: UsableRun, initial: PathModel, ids: list[int], window: int) -> int:
    """Re-route on the last ``min(window, prefix_tokens)`` positions' mean last-block state of
    the initial model over the context (``chunk_routes``'s rule for chunks after the first)."""
    assert run.prep.router is not None
    ctx = ids[-run.model_config.max_seq_len :]
    span = min(window, run.config.routing.prefix_tokens, len(ctx))
    kind = run.config.routing.features
    hidden = position_features(initial, torch.tensor([ctx], dtype=torch.long), kind)
    feats = finish_features(hidden[:, -span:].mean(1), kind).cpu().numpy()
    return int(np.asarray(run.prep.router.assign(feats))[0])


@torch.no_grad()
def generate(
    run_dir: str | Path | UsableRun,
    prompt: str,
    max_new_tokens: int = 64,
    temperature: float = 0.8,
    top_k: int = 50,
    seed: int = 0,
    reroute_every: int | None = None,
    path: int | None = None,
) -> dict:
    """Sample a continuation of ``prompt`` from the path its first tokens route to.

    ``path`` forces a path instead of routing. ``reroute_every`` re-routes every N generated
    tokens. ``temperature`` 0 is greedy. Returns ``{"text", "path", "paths_used", "prompt_tokens",
    "new_tokens"}``: ``path`` is the prompt's route, ``paths_used`` the route of each segment.
    """
    if max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ConfigError(f"temperature must be >= 0, got {temperature}")
    if top_k < 0:
        raise ConfigError(f"top_k must be >= 0 (0: no top-k cut), got {top_k}")
    if reroute_every is not None and reroute_every < 1:
        raise ConfigError(f"reroute_every must be a positive token count, got {reroute_every}")
    run = _as_run(run_dir)
    tokenizer = run.prep.tokenizer
    ids = tokenizer.encode(prompt)
    if reroute_every is not None and run.prep.router is None:
        raise ConfigError("re-routing needs a feature router; this run's shards are i.i.d.")
    initial = run.prep.initial_model().eval() if run.prep.router is not None else None
    if path is not None:
        route = run.check_path(path)
    else:
        route = route_tokens(run, ids, initial)
    if not ids:
        ids = [tokenizer.bos_id]
    max_ctx = run.model_config.max_seq_len
    models: dict[int, PathModel] = {}
    generator = torch.Generator().manual_seed(seed)
    paths_used = [route]
    current = route
    new: list[int] = []
    for step in range(max_new_tokens):
        if reroute_every is not None and step and step % reroute_every == 0:
            assert initial is not None
            current = _reroute(run, initial, ids + new, reroute_every)
            paths_used.append(current)
        if current not in models:
            models.clear()  # one path in memory at a time
            models[current] = run.path_model(current)
        ctx = torch.tensor([(ids + new)[-max_ctx:]], dtype=torch.long)
        logits = models[current](ctx)[0, -1].float()
        if temperature == 0:
            token = int(logits.argmax())
        else:
            logits = logits / temperature
            if 0 < top_k < logits.numel():
                cut = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < cut, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=generator))
        if token == tokenizer.eos_id:
            break
        new.append(token)
    return {
        "text": tokenizer.decode(new),
        "path": route,
        "paths_used": paths_used,
        "prompt_tokens": len(ids),
        "new_tokens": len(new),
    }
