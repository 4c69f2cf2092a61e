"""The tensor-level Hugging Face mapping: a path's state dict and config as a Llama checkpoint's.

A DiPaCo path is a dense Llama-style decoder (``dipaco.model.transformer``): its parameter names
already follow Hugging Face's Llama and its rotary embedding uses Llama's rotate-half layout, so
an export renames tensors (``model.`` prefix) and writes them unchanged, no q/k permutation.
The embedding and output head are separate modules, so ``tie_word_embeddings`` is False.
Writing a checkpoint from a run folder is ``dipaco.run.export``.
"""

from __future__ import annotations

import torch

from dipaco.model.transformer import ModelConfig


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
