"""Tensors (floor 0): the path transformer, the topology of levels, modules and paths, the inner
optimizer, and the tensor-level Hugging Face mapping. It imports nothing from dipaco above it."""
