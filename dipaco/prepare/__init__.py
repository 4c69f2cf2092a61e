"""The operator's step 1 (docs/design.md, "One round, end to end"): prepare a run folder once,
before training.

tokenizer -> token files -> dense pretraining -> prefix features -> router -> per-path shards
(``pipeline.prepare``), re-sharding for a discriminative routing phase (``phases``), and the
prepared folder read back (``folder.PreparedRun``). It knows no coordinator and no peer: they
read what it wrote.
"""
