"""Using a trained run: dipaco's own forward pass, prompt routing, and text generation.

Generation routes the prompt exactly as a validation document is routed: the run's router on the
mean last-block state of the initial (pretrained dense) model over the first
``routing.prefix_tokens`` tokens. With ``reroute_every`` it re-routes every N generated tokens on
the last ``min(N, prefix_tokens)`` positions, as test-time re-routing does
(``dipaco.routing.evaluate.chunk_routes``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dipaco.errors import ConfigError, DataError
from dipaco.model.transformer import PathModel
from dipaco.routing.features import finish_features, position_features, prefix_features
from dipaco.run.export import UsableRun, as_run


@torch.no_grad()
def path_logits(
    run_dir: str | Path | UsableRun, path: int, input_ids: torch.Tensor | list[int]
) -> torch.Tensor:
    """Path ``path``'s logits (B, T, V), float32, from dipaco's own PathModel."""
    run = as_run(run_dir)
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
        openings=run.prep.openings,
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
    run = as_run(run_dir)
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
