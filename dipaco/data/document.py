"""The document record every text source yields and every corpus is made of.

It imports nothing from the rest of :mod:`dipaco.data`, so sources (:mod:`dipaco.data.sources`)
and the built-in corpora (:mod:`dipaco.data.corpus`, :mod:`dipaco.data.mixed`) can all use it
without importing one another in a circle.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Document:
    """One text with a stable ``doc_id``, which routing, sharding and the train/val split key on."""

    doc_id: str
    text: str
