"""What each shard holds: its documents by source, and how pure the sharding is.

A document's source is the first part of its id (``python/...``, ``man-intl/de/...``; see
``dipaco.data.mixed.source_kind``), so this works on any corpus whose ids name their origin. A
shard's *purity* is the share of its documents from its most common (dominant) source; the
sharding's purity is that share over all documents, i.e. the document-weighted mean of the
shards' purities. A sharding that ignores the sources has the corpus's own purity (its largest
source's share); one shard per source has purity 1.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from dipaco.data.mixed import source_kind


def shard_composition(doc_ids: Sequence[str], paths: np.ndarray, num_paths: int) -> dict:
    """Per path: documents by source, dominant source and purity; overall purity and baseline.

    ``paths[i]`` is the path document ``doc_ids[i]`` is routed (sharded) to.
    """
    if len(doc_ids) != len(paths):
        raise ValueError(f"{len(doc_ids)} document ids but {len(paths)} paths")
    sources = [source_kind(d) for d in doc_ids]
    overall = Counter(sources)
    per_path: dict[str, dict] = {}
    dominant_docs = 0
    for p in range(num_paths):
        counts = Counter(s for s, q in zip(sources, paths, strict=True) if int(q) == p)
        n = sum(counts.values())
        top, top_n = counts.most_common(1)[0] if counts else ("", 0)
        dominant_docs += top_n
        per_path[str(p)] = {
            "documents": n,
            "sources": dict(sorted(counts.items())),
            "dominant": top,
            "purity": top_n / n if n else float("nan"),
        }
    total = len(sources)
    return {
        "paths": per_path,
        "sources": dict(sorted(overall.items())),
        "purity": dominant_docs / total if total else float("nan"),
        # What a sharding blind to the sources would score: the largest source's share.
        "baseline_purity": max(overall.values()) / total if total else float("nan"),
    }


def format_composition(comp: dict) -> str:
    """The composition as a markdown table: one row per path, one column per source."""
    sources = list(comp["sources"])
    lines = [
        "| path | documents | " + " | ".join(sources) + " | dominant | purity |",
        "|---|---|" + "---|" * len(sources) + "---|---|",
    ]
    for p, info in comp["paths"].items():
        cells = [str(info["sources"].get(s, 0)) for s in sources]
        lines.append(
            f"| P{p} | {info['documents']} | "
            + " | ".join(cells)
            + f" | {info['dominant'] or '-'} | {info['purity']:.2f} |"
        )
    lines.append(
        f"| all | {sum(comp['sources'].values())} | "
        + " | ".join(str(comp["sources"][s]) for s in sources)
        + f" | - | {comp['purity']:.2f} (blind: {comp['baseline_purity']:.2f}) |"
    )
    return "\n".join(lines)
