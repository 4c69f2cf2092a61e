"""Preparing a run: deterministic routing for a seed, and shards that cover the training data."""

import json
import shutil

import numpy as np
import pytest

from dipaco.data.shards import TokenShard
from dipaco.errors import ConfigError
from dipaco.prepare.pipeline import prepare
from dipaco.routing.features import prefix_features


def test_routing_is_deterministic_for_a_seed(prepared_tiny, tiny_config, tmp_path):
    again = prepare(tmp_path / "again", tiny_config)
    first = json.loads((prepared_tiny / "routing.json").read_text())
    second = json.loads((again.root / "routing.json").read_text())
    assert first == second
    assert (prepared_tiny / "router.json").read_bytes() == (again.root / "router.json").read_bytes()
    for p in range(4):
        a, b = (
            TokenShard(prepared_tiny / "shards" / f"P{p}" / "train"),
            TokenShard(again.root / "shards" / f"P{p}" / "train"),
        )
        assert a.doc_ids == b.doc_ids and np.array_equal(a.tokens, b.tokens)
    # Same data, same shards, but another run: its id differs (two runs announced under one id
    # would collide in the DHT), and stays the same when the folder is prepared again or copied.
    first_id = prepare(prepared_tiny, tiny_config).run_id
    assert again.run_id != first_id
    assert prepare(again.root, tiny_config).run_id == again.run_id
    shutil.copytree(again.root, tmp_path / "copy")
    assert prepare(tmp_path / "copy", tiny_config).run_id == again.run_id


def test_every_training_document_lands_in_exactly_one_shard(prepared_tiny):
    train = TokenShard(prepared_tiny / "data" / "train")
    seen = []
    for p in range(4):
        for part in ("train", "heldout"):
            seen += TokenShard(prepared_tiny / "shards" / f"P{p}" / part).doc_ids
    assert sorted(seen) == sorted(train.doc_ids)
    stats = json.loads((prepared_tiny / "shards" / "stats.json").read_text())
    assert all(n > 0 for n in stats["train"]["docs"])  # the balance control starves no path
    assert sum(stats["heldout"]["docs"]) > 0


def test_prefix_features_only_read_the_first_32_tokens(prepared_tiny, tiny_config):
    prep = prepare(prepared_tiny, tiny_config)
    model = prep.initial_model()
    train = TokenShard(prepared_tiny / "data" / "train")
    doc = train[0]
    changed = doc.copy()
    changed[32:] = (changed[32:] + 1) % tiny_config.model.vocab_size
    a, b = prefix_features(model, [doc, changed])
    assert np.allclose(a, b, atol=1e-6)
    routed = prep.router.assign(prefix_features(model, [doc, changed]))
    assert routed[0] == routed[1]


def test_a_run_prepares_from_a_jsonl_file(tmp_path, tiny_config):
    from dipaco.data.corpus import builtin_corpus

    source = tmp_path / "docs.jsonl"
    with open(source, "w") as f:
        for doc in builtin_corpus(max_docs=300):
            f.write(json.dumps({"id": doc.doc_id, "text": doc.text}) + "\n")
    prep = prepare(
        tmp_path / "run", tiny_config.replace(data={"source": str(source), "max_docs": None})
    )
    train = TokenShard(prep.root / "data" / "train")
    assert len(train) + len(TokenShard(prep.root / "data" / "val")) <= 300
    assert len(train) > 250 and train.doc_ids[0].startswith(("stdlib/", "pydoc/"))
    texts = {r["id"]: r["text"] for r in map(json.loads, source.read_text().splitlines())}
    assert prep.tokenizer.decode([int(t) for t in train[0][:-1]]) == texts[train.doc_ids[0]]


def test_a_token_routed_run_shards_by_prefix_token_bags(prepared_tiny, tiny_config, tmp_path):
    config = tiny_config.replace(routing={"features": "tokens"})
    prep = prepare(tmp_path / "tokens", config, reuse=prepared_tiny)
    feats = prep.features("val")
    assert feats.shape[1] == tiny_config.model.vocab_size  # a bag, not the model's width
    np.testing.assert_allclose(np.linalg.norm(feats, axis=1), 1.0, rtol=1e-5)
    # The features were computed for this kind, not linked from the hidden-state run.
    hidden = np.load(prepared_tiny / "features" / "val.npy")
    assert hidden.shape[1] == tiny_config.model.dim
    assert list(prep.val_paths) == list(prep.router.assign(feats))
    stats = json.loads((prep.root / "shards" / "stats.json").read_text())
    assert all(n > 0 for n in stats["train"]["docs"])


def test_a_run_begun_before_a_setting_existed_resumes_and_a_changed_one_is_refused(
    prepared_tiny, tiny_config, tmp_path
):
    root = tmp_path / "run"
    prepare(root, tiny_config, reuse=prepared_tiny)
    # As an older dipaco wrote it: without a setting added since (it takes its default).
    saved = json.loads((root / "config.json").read_text())
    del saved["routing"]["discriminative_plateau"]
    (root / "config.json").write_text(json.dumps(saved))
    prep = prepare(root, tiny_config)
    assert prep.config.routing.discriminative_plateau == 0.0
    with pytest.raises(ConfigError, match="routing settings differ"):
        prepare(root, tiny_config.replace(routing={"balance": 0.9}))


def test_evaluation_spreads_its_documents_over_the_whole_validation_set(prepared_tiny, tiny_config):
    """A corpus sorted by source must not be evaluated on its first source only: with
    ``eval.max_docs`` below the set's size, the documents come from all over it."""
    import dataclasses

    val = TokenShard(prepared_tiny / "data" / "val")
    prep = prepare(prepared_tiny, tiny_config)  # already prepared: opened as it is
    prep = dataclasses.replace(prep, config=tiny_config.replace(eval={"max_docs": 4}))
    index = prep.val_index()
    assert len(index) == 4 and index[0] == 0 and index[-1] >= len(val) * 3 // 4
    assert [d.tolist() for d in prep.val_docs()] == [val[int(i)].tolist() for i in index]
    assert list(prep.val_routes()) == [int(prep.val_paths[int(i)]) for i in index]


def test_a_run_that_differs_in_its_outer_step_alone_links_the_router_and_shards(
    prepared_tiny, tiny_config, tmp_path
):
    """Benchmarks prepare many runs that differ only in the outer step (an outer-lr sweep):
    those link the first run's router and shards rather than fitting and writing them again;
    a run routed otherwise (another topology) writes its own."""
    same = prepare(tmp_path / "same", tiny_config.replace(outer={"lr": 1.3}), reuse=prepared_tiny)
    for name in ("router.json", "routing.json", "shards/P3/train.tokens", "shards/stats.json"):
        assert (same.root / name).stat().st_ino == (prepared_tiny / name).stat().st_ino, name
    assert np.array_equal(same.val_paths, prepare(prepared_tiny, tiny_config).val_paths)
    other = prepare(
        tmp_path / "other", tiny_config.replace(topology={"levels": "4"}), reuse=prepared_tiny
    )
    assert (other.root / "shards/P0/train.tokens").stat().st_ino != (
        prepared_tiny / "shards/P0/train.tokens"
    ).stat().st_ino
    assert (other.root / "initial.dpt").stat().st_ino == (
        prepared_tiny / "initial.dpt"
    ).stat().st_ino
