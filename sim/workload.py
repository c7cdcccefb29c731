"""Prompt streams shaped like a chat service's traffic, for the fleet simulation.

Three kinds of request, mixed by a seeded generator so a run is reproducible:

* conversations that start with one of a few long system prompts, picked by a Zipf
  law (a handful of products or agents carry most traffic);
* later turns of those conversations: the next prompt is the previous prompt plus the
  model's answer and the user's next message, so it extends a cached prefix;
* one-off prompts that share nothing with anything;
* (``resend``, off by default) a prompt sent again as it was: a retried request or a
  regenerated answer.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

VOCABULARY = 32_000


@dataclass(frozen=True)
class WorkloadConfig:
    """Knobs of the prompt stream (lengths in tokens)."""

    requests: int = 1000
    system_prompts: int = 6
    system_prompt_tokens: tuple[int, int] = (256, 768)
    zipf_exponent: float = 1.2
    new_conversation: float = 0.30  # share of requests that open a conversation
    one_off: float = 0.15  # share of unique one-off prompts
    turn_tokens: tuple[int, int] = (24, 96)  # user message, and answer, each
    max_turns: int = 8
    active_conversations: int = 24
    resend: float = 0.0  # share of requests that send a recent prompt again, unchanged
    seed: int = 0


@dataclass(frozen=True)
class Request:
    """One prompt to prefill."""

    number: int
    kind: str  # "new", "turn", "one-off" or "resend"
    tokens: tuple[int, ...]
    conversation: int | None


@dataclass
class _Conversation:
    number: int
    tokens: list[int]
    turns: int = 1


@dataclass
class Workload:
    """A reproducible stream of ``config.requests`` requests."""

    config: WorkloadConfig = field(default_factory=WorkloadConfig)

    def __iter__(self) -> Iterator[Request]:
        config = self.config
        rng = random.Random(config.seed)
        systems = [
            _tokens(rng, rng.randint(*config.system_prompt_tokens))
            for _ in range(config.system_prompts)
        ]
        weights = [1 / (rank + 1) ** config.zipf_exponent for rank in range(len(systems))]
        active: list[_Conversation] = []
        recent: list[Request] = []
        opened = 0
        for number in range(config.requests):
            if config.resend and recent and rng.random() < config.resend:
                again = rng.choice(recent[-16:])
                yield Request(number, "resend", again.tokens, again.conversation)
                continue
            request = self._next(number, rng, systems, weights, active, opened)
            opened += request.kind == "new"
            if config.resend:
                recent.append(request)
            yield request

    def _next(
        self,
        number: int,
        rng: random.Random,
        systems: list[list[int]],
        weights: list[float],
        active: list[_Conversation],
        opened: int,
    ) -> Request:
        """A new conversation, a later turn, or a one-off prompt."""
        config = self.config
        roll = rng.random()
        if roll < config.one_off:
            length = rng.randint(
                config.system_prompt_tokens[0] // 2, config.system_prompt_tokens[1]
            )
            return Request(number, "one-off", tuple(_tokens(rng, length)), None)
        if not active or roll < config.one_off + config.new_conversation:
            system = rng.choices(systems, weights)[0]
            conversation = _Conversation(
                opened, system + _tokens(rng, rng.randint(*config.turn_tokens))
            )
            active.append(conversation)
            if len(active) > config.active_conversations:
                active.pop(0)
            return Request(number, "new", tuple(conversation.tokens), conversation.number)
        conversation = rng.choice(active)
        answer = _tokens(rng, rng.randint(*config.turn_tokens))
        message = _tokens(rng, rng.randint(*config.turn_tokens))
        conversation.tokens.extend(answer + message)
        conversation.turns += 1
        if conversation.turns >= config.max_turns:
            active.remove(conversation)
        return Request(number, "turn", tuple(conversation.tokens), conversation.number)


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(VOCABULARY) for _ in range(count)]
