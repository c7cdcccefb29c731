"""Build a LoRA adapter for the engine tier's tiny Llama (``make_tiny_model.py``) in
PEFT's format, saved to the directory given: ``adapter_config.json`` and
``adapter_model.safetensors`` with random ``lora_A``/``lora_B`` of rank ``RANK`` for
``q_proj`` and ``v_proj`` of both layers. Run with the engine venv's python (it has
torch and safetensors); nothing is downloaded.

``lora_B`` is random too (PEFT starts it at zero), so the adapter's answers differ from
the base model's; the engine tier only needs an adapter vLLM loads and keys blocks by.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

RANK = 8
"""The adapter's rank (the engine's ``--max-lora-rank`` must be at least this)."""
LAYERS, HIDDEN = 2, 128
"""The tiny Llama's layers and hidden size (its q/v projections are 128 x 128)."""
TARGETS = ("q_proj", "v_proj")


def build(out: Path, seed: int = 1) -> None:
    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(LAYERS):
        for module in TARGETS:
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{name}.lora_A.weight"] = 0.05 * torch.randn(RANK, HIDDEN, generator=generator)
            tensors[f"{name}.lora_B.weight"] = 0.05 * torch.randn(HIDDEN, RANK, generator=generator)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": "tiny-llama",
        "r": RANK,
        "lora_alpha": 2 * RANK,
        "lora_dropout": 0.0,
        "target_modules": list(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    build(Path(sys.argv[1]))
