"""Routing a corpus whose documents often open with the same lines (licence headers, includes).

Documents that share their first 32 tokens have identical prefix features, whatever the kind,
so no router offset can send some of them to one path and the rest to others; on a held-out
corpus of real documentation that left a k-means cluster empty and prepare refused the run.
The balanced assignment spreads them instead (dipaco.routing.balance), deterministically.
"""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from dipaco.config import preset_config
from dipaco.data.shards import TokenShard
from dipaco.prepare.pipeline import prepare

HEADER = (
    "# Copyright (c) The Example Authors. All rights reserved.\n"
    '# Licensed under the Apache License, Version 2.0 (the "License"); you may not use this\n'
    "# file except in compliance with the License. You may obtain a copy of the License at\n"
)
TOPICS = [
    ("python", "def {a}({b}):\n    return {b} + {c}\n\nclass {A}:\n    pass\n"),
    ("prose", "The {a} of the {b} went to the {c} and saw that it was {d}.\n"),
    ("config", "[{a}]\n{b} = {c}\n{d} = true\n"),
    ("shell", "#!/bin/sh\nset -e\n{a} --{b} {c} | {d}\n"),
]
WORDS = [f"w{i}{chr(97 + i % 26)}" for i in range(400)]


def _corpus(path, n=640, shared=0.3, seed=0):
    """``n`` documents of four kinds; a ``shared`` fraction open with the same licence header."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(n):
            kind, template = TOPICS[i % len(TOPICS)]
            body = "".join(
                template.format(
                    a=rng.choice(WORDS),
                    b=rng.choice(WORDS),
                    c=rng.choice(WORDS),
                    d=rng.choice(WORDS),
                    A=rng.choice(WORDS).title(),
                )
                for _ in range(rng.randint(12, 20))
            )
            text = (HEADER if rng.random() < shared else "") + body
            f.write(json.dumps({"id": f"{kind}-{i}", "text": text}) + "\n")


def _config(source, features):
    """A tiny 4x4 (16 paths) on ``source``, routed by ``features``, balance 0.5."""
    return preset_config("tiny").replace(
        data={"source": str(source), "tokenizer_sample_chars": 100_000, "val_fraction": 0.05},
        model={"vocab_size": 512, "dim": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": 64},
        train={"batch_size": 4, "seq_len": 64, "pretrain_steps": 4, "warmup_steps": 2},
        topology={"levels": "4x4"},
        routing={"features": features, "balance": 0.5, "router_fraction": 0.0},
    )


@pytest.mark.parametrize("features", ["tokens", "hidden"])
def test_sixteen_paths_from_a_corpus_where_30_percent_share_their_opening(tmp_path, features):
    source = tmp_path / "corpus.jsonl"
    _corpus(source)
    config = _config(source, features)
    root = tmp_path / "run"
    prep = prepare(root, config)
    train = TokenShard(root / "data" / "train")
    prefixes = [tuple(train[i][:32].tolist()) for i in range(len(train))]
    most = max(prefixes.count(p) for p in set(prefixes))
    assert most >= 0.25 * len(train)  # the corpus does what it says: a quarter share one prefix

    routed = json.loads((root / "routing.json").read_text())["shards"]
    per_path = np.add(routed["train"]["docs"], routed["heldout"]["docs"])
    n = len(train)
    lo, hi = math.ceil(n * 0.5 / 16 - 1e-9), math.floor(n * 1.5 / 16 + 1e-9)
    assert per_path.sum() == n
    assert per_path.min() >= lo and per_path.max() <= hi, (per_path.tolist(), lo, hi)
    assert all(TokenShard(root / "shards" / f"P{p}" / "train").n_tokens > 0 for p in range(16))
    # The documents with the shared opening went to several paths, not one.
    shared = {train.doc_ids[i] for i, p in enumerate(prefixes) if prefixes.count(p) == most}
    holding = [
        p
        for p in range(16)
        for part in ("train", "heldout")
        if shared & set(TokenShard(root / "shards" / f"P{p}" / part).doc_ids)
    ]
    assert len(set(holding)) >= math.ceil(len(shared) / hi), (len(shared), holding)
    # Deterministic: the same corpus and settings give the same shards.
    again = prepare(tmp_path / "again", config)
    for p in range(16):
        a = TokenShard(root / "shards" / f"P{p}" / "train").doc_ids
        assert a == TokenShard(again.root / "shards" / f"P{p}" / "train").doc_ids
    # A new document with that opening still has a route (one of the paths that hold some).
    val_paths = prep.val_paths
    assert val_paths.shape[0] == len(TokenShard(root / "data" / "val"))


def _kind_purity(root, docs_of_interest):
    """Over the paths holding any of ``docs_of_interest``: the share of those documents that
    are of their path's most common kind."""
    from collections import Counter

    by_path: dict[int, Counter] = {}
    for p in range(16):
        for part in ("train", "heldout"):
            for doc_id in TokenShard(root / "shards" / f"P{p}" / part).doc_ids:
                if doc_id in docs_of_interest:
                    by_path.setdefault(p, Counter())[doc_id.split("-")[0]] += 1
    return sum(c.most_common(1)[0][1] for c in by_path.values()) / len(docs_of_interest)


def test_skipping_shared_openings_routes_header_documents_by_what_follows(tmp_path):
    """``routing.skip_openings``: documents that open with the shared licence header are routed by
    their first block after it, so they land with the other documents of their kind; without it
    they are spread over paths whatever their kind. The openings are kept with the run."""
    source = tmp_path / "corpus.jsonl"
    _corpus(source)
    base = _config(source, "tokens")
    plain = prepare(tmp_path / "plain", base)
    skipping = prepare(
        tmp_path / "skip", base.replace(routing={"skip_openings": 0.1}), reuse=plain.root
    )
    train = TokenShard(plain.root / "data" / "train")
    header = {
        train.doc_ids[i]
        for i in range(len(train))
        if plain.tokenizer.decode(train[i][:20].tolist()) in HEADER
    }
    assert len(header) > 0.2 * len(train)
    saved = json.loads((skipping.root / "openings.json").read_text())
    assert saved["documents_skipping"] >= len(header) and len(saved["blocks"]) >= 1
    assert skipping.openings is not None and plain.openings is None
    without, with_skip = _kind_purity(plain.root, header), _kind_purity(skipping.root, header)
    print(f"purity of header documents by kind: {without:.2f} without, {with_skip:.2f} skipping")
    assert with_skip > 0.8 and with_skip > without + 0.3, (without, with_skip)
