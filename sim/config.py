"""Sizes of a simulated fleet, checked before anything is allocated."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import cast

import torch

from registry.core.keys import validate_key_prefix
from registry.core.validation import is_number
from registry.namespace.ownership import DEFAULT_LEASE_TTL, lease_seconds
from sim.checkpoints import MAMBA_CHECKPOINTS
from sim.workload import WorkloadConfig

ROUTERS = ("round-robin", "prefix")

MAX_NODES = 256
"""Each node runs a listener thread with its own Redis connection."""
MAX_BLOCK_SIZE = 2**31 - 1
MAX_SIMULATION_BYTES = 4 * 2**30
"""Host memory a run may ask for: Mamba slot tensors plus KV bookkeeping, all nodes."""
KV_BLOCK_BYTES = 256
"""Host memory per KV block of a ``KVBlockPool`` (its free list and dict entries), high."""
STATE_BYTES = torch.float32.itemsize
"""The simulated Mamba states are float32."""


@dataclass(frozen=True)
class FleetConfig:
    """Sizes of the simulated fleet."""

    nodes: int = 4
    kv_blocks: int = 512  # per node
    mamba_slots: int = 32  # per node
    block_size: int = 16
    layers: int = 2
    conv_shape: tuple[int, ...] = (4, 8)
    ssm_shape: tuple[int, ...] = (4, 8)
    key_prefix: str = "pcr"
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    mirror: bool = False
    """Each node owns its namespace through a ``registry.MirroredRegistry``: its own
    calls are answered locally and written behind to Redis (``pcr simulate --mirror``)."""
    mamba_checkpoints: str = "vllm"
    """Where a node keeps Mamba state (``sim.checkpoints``): ``"vllm"`` at the prompt's
    replay boundary and shared-prefix junctions, as vLLM 0.32 does, or ``"last-block"``
    at its last full block only (``pcr simulate --mamba-checkpoints``)."""


@dataclass(frozen=True)
class BridgeConfig:
    """``pcr simulate --bridge``: the nodes publish engine KV events and one ``pcr bridge``
    follows them all into their namespaces (``sim.bridged``)."""

    drop_every: int = 0
    """Publish every ``drop_every``-th batch of a node to its replay buffer only, as if
    the bridge's subscription lost it (0: none): the bridge sees gaps and replays."""
    lockstep: bool = False
    """Route each request only once the bridge has applied every batch the nodes sent
    (then routing sees what the direct mode sees); else the router reads whatever the
    bridge has applied so far, as it would in production."""
    lease_ttl: float = DEFAULT_LEASE_TTL
    """The bridged namespaces' lease (a quiet engine is probed after a third of it)."""
    catch_up_timeout: float = 300.0
    """How long the audit waits for the bridge to apply every batch published; only a
    bridge that never catches up (a bug, or Redis away for that long) reaches it."""
    duplicate_blocks: bool = False
    """Store blocks twice as vLLM does: a fully cached prompt whose length is a multiple
    of the block size has its last block computed again into a second copy under the
    same hash (announced by ``BlockStored``; each copy later gets its own
    ``BlockRemoved``)."""
    replay_frames: int = 4
    """The engines' replay reply form: 4 frames as vLLM 0.26 and later, 3 as earlier."""


class BridgeStalled(RuntimeError):
    """``--bridge``: the bridge stopped, could not start, or never applied every batch
    published."""


class FleetConfigError(ValueError):
    """A ``FleetConfig`` the simulation cannot run; ``field`` names the culprit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def check_fleet_config(config: FleetConfig) -> None:
    """Refuse a fleet that is malformed or would not fit in memory, before anything is
    allocated or claimed: one-line ``FleetConfigError`` (a ``ValueError``) naming the
    field, sizes computed from the requested shapes (``TypeError`` for wrong kinds)."""
    if not isinstance(config, FleetConfig):
        raise TypeError(f"config must be a FleetConfig, not {type(config).__name__}")
    nodes = _size(config.nodes, "nodes", MAX_NODES)
    kv_blocks = _size(config.kv_blocks, "kv_blocks")
    slots = _size(config.mamba_slots, "mamba_slots")
    _size(config.block_size, "block_size", MAX_BLOCK_SIZE)
    layers = _size(config.layers, "layers")
    values = _values(config.conv_shape, "conv_shape") + _values(config.ssm_shape, "ssm_shape")
    try:
        validate_key_prefix(config.key_prefix)
    except ValueError as exc:
        raise FleetConfigError("key_prefix", str(exc)) from None
    if not isinstance(config.workload, WorkloadConfig):
        raise TypeError(f"workload must be a WorkloadConfig, not {type(config.workload).__name__}")
    _size(config.workload.requests, "requests")
    if config.mamba_checkpoints not in MAMBA_CHECKPOINTS:
        raise FleetConfigError(
            "mamba_checkpoints",
            f"mamba_checkpoints = {config.mamba_checkpoints!r} must be one of "
            f"{', '.join(MAMBA_CHECKPOINTS)}",
        )
    limit = _bytes(MAX_SIMULATION_BYTES)
    kv_bytes = nodes * kv_blocks * KV_BLOCK_BYTES
    if kv_bytes > MAX_SIMULATION_BYTES:
        raise FleetConfigError(
            "kv_blocks",
            f"kv_blocks = {kv_blocks} is too large: {nodes} nodes x {kv_blocks} blocks x "
            f"~{KV_BLOCK_BYTES} bytes = {_bytes(kv_bytes)}, over the {limit} a simulation may use",
        )
    mamba_bytes = nodes * slots * layers * values * STATE_BYTES
    if mamba_bytes + kv_bytes > MAX_SIMULATION_BYTES:
        raise FleetConfigError(
            "mamba_slots",
            f"mamba_slots = {slots} is too large: {nodes} nodes x {slots} slots x {layers} "
            f"layers x {values} values x {STATE_BYTES} bytes = {_bytes(mamba_bytes)} "
            f"(with {_bytes(kv_bytes)} for KV blocks), over the {limit} a simulation may use",
        )


def check_bridge_config(bridge: BridgeConfig) -> None:
    """Refuse a malformed ``BridgeConfig`` (``FleetConfigError`` naming the field)."""
    if not isinstance(bridge, BridgeConfig):
        raise TypeError(f"bridge must be a BridgeConfig, not {type(bridge).__name__}")
    if not isinstance(bridge.lockstep, bool):
        raise TypeError(f"lockstep must be a bool, not {type(bridge.lockstep).__name__}")
    drop = bridge.drop_every
    if not is_number(drop, integer=True):
        raise TypeError(f"drop_every must be an int, not {type(drop).__name__}")
    if drop < 0 or drop == 1:
        raise FleetConfigError(
            "drop_every", f"drop_every = {drop} must be 0 (drop nothing) or at least 2"
        )
    for name in ("lease_ttl", "catch_up_timeout"):
        try:
            lease_seconds(getattr(bridge, name))
        except ValueError as exc:
            raise FleetConfigError(name, f"{name}: {exc}") from None


def _size(value: object, name: str, high: int | None = None) -> int:
    """A positive int (not a bool) of at most ``high``."""
    if not is_number(value, integer=True):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    size = cast(int, value)
    if size < 1:
        raise FleetConfigError(name, f"{name} = {size} must be at least 1")
    if high is not None and size > high:
        raise FleetConfigError(name, f"{name} = {size} is too large: at most {high}")
    return size


def _values(shape: object, name: str) -> int:
    """The number of values in one slot's state of ``shape`` (positive dims)."""
    if not isinstance(shape, tuple):
        raise TypeError(f"{name} must be a tuple of ints, not {type(shape).__name__}")
    for i, dim in enumerate(shape):
        _size(dim, f"{name}[{i}]")
    return math.prod(shape)


def _bytes(count: int) -> str:
    """``count`` bytes for a message, in the largest unit that leaves at least 1."""
    if count >= 2**1000:  # past what a float holds
        return f"about 10^{len(str(count)) - 1} bytes"
    for unit, scale in (
        ("PiB", 2**50),
        ("TiB", 2**40),
        ("GiB", 2**30),
        ("MiB", 2**20),
        ("KiB", 2**10),
    ):
        if count >= scale:
            return f"{count / scale:.3g} {unit}"
    return f"{count} bytes"
