"""A tiny randomly initialised Llama and a word-level tokenizer, written to a local folder.

The engine tests and the replay need a real model that vLLM loads on 2 CPU cores in seconds and
no hub: 2 layers, hidden size 64, one attention head of dimension 64, a vocabulary
of ``vocab_words`` words ``w0 w1 ...`` (so ``" ".join`` of words is a prompt of known length).
Runs in the vLLM venv (transformers, tokenizers, torch); the weights are seeded, so two builds
are byte-identical.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Final

SPECIALS: Final = ("<unk>", "<s>", "</s>")


def build_tiny_llama(
    out_dir: Path, *, vocab_words: int = 1000, max_len_tokens: int = 4096, seed: int = 0
) -> Path:
    """Write config, safetensors weights and tokenizer files to ``out_dir`` (idempotent)."""
    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists() and (out_dir / "tokenizer.json").exists():
        return out_dir
    # heavy, and only in .venv-vllm: imported when a model is actually built
    import torch  # noqa: PLC0415
    from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: PLC0415
    from transformers import (  # noqa: PLC0415
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({f"w{i}": len(SPECIALS) + i for i in range(vocab_words)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.model_max_length = max_len_tokens
    fast.save_pretrained(out_dir)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=max_len_tokens,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "agentkv-tiny.json").write_text(json.dumps({"seed": seed, "vocab": len(vocab)}))
    return out_dir
