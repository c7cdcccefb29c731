"""Small pools and random states for the gpu tests (imports torch)."""

from __future__ import annotations

import torch

from gpu import MambaSlotPool
from registry import RegistryBase

LAYERS = 3
CONV_SHAPE = (4, 2)
SSM_SHAPE = (2, 3, 4)


def make_pool(
    registry: RegistryBase,
    slots: int = 8,
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    **options: object,
) -> MambaSlotPool:
    return MambaSlotPool(
        registry, slots, LAYERS, CONV_SHAPE, SSM_SHAPE, dtype=dtype, device=device, **options
    )  # type: ignore[arg-type]


def states(
    n: int, *, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (conv, ssm) states for n blocks, laid out (layers, n, ...)."""
    generator = torch.Generator().manual_seed(seed)
    conv = torch.randn((LAYERS, n, *CONV_SHAPE), generator=generator).to(dtype)
    ssm = torch.randn((LAYERS, n, *SSM_SHAPE), generator=generator).to(dtype)
    return conv.to(device), ssm.to(device)


def out_buffers(
    dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.empty((LAYERS, *CONV_SHAPE), dtype=dtype, device=device),
        torch.empty((LAYERS, *SSM_SHAPE), dtype=dtype, device=device),
    )
