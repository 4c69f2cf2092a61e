"""Data: documents, text sources, the built-in corpora, the tokenizer and token shards on disk."""

from __future__ import annotations

from dipaco.data.corpus import builtin_corpus, split_train_val
from dipaco.data.document import Document
from dipaco.data.shards import ShardWriter, TokenShard, sample_windows
from dipaco.data.sources import (
    open_source,
    read_hf,
    read_jsonl,
    read_parquet,
    read_text,
)
from dipaco.data.tokenizer import Tokenizer

__all__ = [
    "Document",
    "ShardWriter",
    "TokenShard",
    "Tokenizer",
    "builtin_corpus",
    "open_source",
    "read_hf",
    "read_jsonl",
    "read_parquet",
    "read_text",
    "sample_windows",
    "split_train_val",
]
