"""Seeded multi-turn traces of chat and agent traffic, as token ids: shared system prompts (and
tool schemas), growing histories, think times. Pure Python, for any driver that replays them.

    python -m daemon.benchmark.traces [--kind agent --sessions 32 --seed 0 --vocab 32000]   # a summary

A turn carries only its *new* tokens: its prompt is the conversation so far (every earlier
prompt's new tokens and every answer the model actually gave) plus them, which a `Session`
builds. Turn 0 of a session arrives at `arrival_s`; turn k > 0 arrives `think_time_s` after
turn k-1's answer completed (its `arrival_s` is nominal: as if answers took no time).
"""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass, field, replace
from typing import Literal

Kind = Literal["chat", "agent"]
KINDS: tuple[Kind, ...] = ("chat", "agent")


@dataclass(frozen=True)
class TraceParams:
    """How sessions look. Ranges are inclusive; "log-normal" lengths are drawn as
    exp(N(log median, sigma)) and clipped to the range. `defaults(kind)` gives each kind's."""

    traffic_class: str = "chat"  # sent with every request (block-store retention class)
    # Shared prefix of turn 0: one of `system_prompts` system prompts (popularity Zipf 1/rank),
    # followed, when tool_sets > 0, by one of `tool_sets` tool-schema blocks (also Zipf).
    system_prompts: int = 4
    system_prompt_tokens: tuple[int, int] = (500, 3000)
    tool_sets: int = 0
    tool_schema_tokens: tuple[int, int] = (0, 0)
    first_message_tokens: tuple[int, int] = (20, 300)  # the opening user message / task, uniform
    turns: tuple[int, int] = (2, 10)  # turns per session, uniform (fewer if max_context is hit)
    # new tokens of turns 1.. : user messages (chat) or tool outputs (agent), log-normal
    message_median: int = 80
    message_sigma: float = 0.8
    message_tokens: tuple[int, int] = (20, 300)
    # answer length = the turn's max_tokens (a driver uses ignore_eos), log-normal
    answer_median: int = 250
    answer_sigma: float = 0.5
    answer_tokens: tuple[int, int] = (100, 600)
    think_time_s: tuple[float, float] = (10.0, 120.0)  # before turns 1.., log-uniform
    start_window_s: float = 600.0  # turn 0 of each session: uniform over [0, window)
    max_context_tokens: int = 65536  # a session ends before prompt + max_tokens exceeds this

    @staticmethod
    def defaults(kind: Kind) -> TraceParams:
        return DEFAULTS[kind]


DEFAULTS: dict[Kind, TraceParams] = {
    "chat": TraceParams(),
    "agent": TraceParams(
        traffic_class="agent",
        system_prompts=3,
        system_prompt_tokens=(1000, 3000),
        tool_sets=4,
        tool_schema_tokens=(1000, 4000),
        first_message_tokens=(50, 500),  # the task
        turns=(10, 40),
        message_median=400,  # tool outputs: file reads, command output, search results
        message_sigma=0.9,
        message_tokens=(100, 2000),
        answer_median=80,  # a tool call, or a short reasoning step and a tool call
        answer_sigma=0.5,
        answer_tokens=(30, 200),
        think_time_s=(0.5, 10.0),  # tool execution
        start_window_s=300.0,
    ),
}


@dataclass(frozen=True)
class Turn:
    session: int
    index: int  # turn number within the session, from 0
    arrival_s: float  # turn 0: seconds since trace start; later turns: nominal (see module doc)
    think_time_s: float  # turn k > 0 arrives this long after turn k-1 completed; 0 for turn 0
    new_tokens: list[int]  # appended to the conversation so far (turn 0: the whole prompt)
    max_tokens: int  # answer length asked for
    traffic_class: str
    shared_tokens: int = 0  # turn 0: leading new tokens that other sessions share (system+tools)


@dataclass
class Session:
    """One session's turns and conversation; `prompt` and `answered` alternate, in turn order."""

    turns: list[Turn]
    history: list[int] = field(default_factory=list)  # every prompt's new tokens and answer
    next_turn: int = 0
    _waiting_answer: bool = False

    def prompt(self) -> tuple[Turn, list[int]]:
        """The next turn and its full prompt: the conversation so far plus the turn's tokens."""
        if self._waiting_answer:
            raise RuntimeError("the previous turn has no answer yet")
        turn = self.turns[self.next_turn]
        self.history.extend(turn.new_tokens)
        self.next_turn += 1
        self._waiting_answer = True
        return turn, list(self.history)

    def answered(self, answer_ids: list[int]) -> None:
        """Record the tokens the model actually produced for the last prompt."""
        if not self._waiting_answer:
            raise RuntimeError("no prompt is waiting for an answer")
        self.history.extend(answer_ids)
        self._waiting_answer = False

    @property
    def done(self) -> bool:
        return self.next_turn == len(self.turns)


def sessions(trace: list[Turn]) -> list[Session]:
    """The trace regrouped by session (ordered by the session's first arrival)."""
    by_id: dict[int, list[Turn]] = {}
    for turn in sorted(trace, key=lambda t: (t.session, t.index)):
        by_id.setdefault(turn.session, []).append(turn)
    return sorted((Session(turns) for turns in by_id.values()), key=lambda s: s.turns[0].arrival_s)


def make_trace(
    kind: Kind,
    num_sessions: int,
    seed: int = 0,
    vocab_size: int = 32000,
    params: TraceParams | None = None,
) -> list[Turn]:
    """`num_sessions` sessions of `kind` traffic, every turn of them sorted by (nominal)
    arrival. Same arguments, same trace."""
    p = params or DEFAULTS[kind]
    rng = random.Random(f"{kind}-{seed}")

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(n)]

    def lognormal(median: int, sigma: float, bounds: tuple[int, int]) -> int:
        value = round(rng.lognormvariate(math.log(median), sigma))
        return min(max(value, bounds[0]), bounds[1])

    def zipf(n: int) -> int:
        return rng.choices(range(n), weights=[1 / (r + 1) for r in range(n)])[0]

    systems = [tokens(rng.randint(*p.system_prompt_tokens)) for _ in range(p.system_prompts)]
    tools = [tokens(rng.randint(*p.tool_schema_tokens)) for _ in range(p.tool_sets)]
    starts = sorted(rng.uniform(0, p.start_window_s) for _ in range(num_sessions))
    lo, hi = math.log(p.think_time_s[0]), math.log(p.think_time_s[1])

    trace: list[Turn] = []
    for sid, start in enumerate(starts):
        shared = systems[zipf(p.system_prompts)] + (tools[zipf(p.tool_sets)] if tools else [])
        new = shared + tokens(rng.randint(*p.first_message_tokens))
        arrival, think, context = start, 0.0, 0
        for index in range(rng.randint(*p.turns)):
            if index:
                think = math.exp(rng.uniform(lo, hi))
                arrival += think
                new = tokens(lognormal(p.message_median, p.message_sigma, p.message_tokens))
            answer = lognormal(p.answer_median, p.answer_sigma, p.answer_tokens)
            context += len(new) + answer
            if context > p.max_context_tokens:
                break
            trace.append(
                Turn(
                    sid,
                    index,
                    arrival,
                    think,
                    new,
                    answer,
                    p.traffic_class,
                    len(shared) if index == 0 else 0,
                )
            )
    trace.sort(key=lambda t: (t.arrival_s, t.session))
    return trace


class PrefixCeiling:
    """The most a block-granular prefix cache can serve: a prompt's leading full blocks that an
    earlier request computed (its prompt, or its prompt and answer but the last answer token,
    which is sampled but never run through the model), never the block holding the prompt's
    last token (one token must be computed). Blocks are identified by a hash chain."""

    def __init__(self, block_size: int = 16) -> None:
        self.block = block_size
        self.seen: set[int] = set()

    def _chain(self, tokens: list[int], num_blocks: int) -> list[int]:
        out, h = [], 0
        for i in range(num_blocks):
            h = hash((h, tuple(tokens[i * self.block : (i + 1) * self.block])))
            out.append(h)
        return out

    def hittable(self, prompt: list[int]) -> int:
        """Prompt tokens that could come from the cache; call before `computed(prompt)`."""
        n = 0
        for h in self._chain(prompt, (len(prompt) - 1) // self.block):
            if h not in self.seen:
                break
            n += 1
        return n * self.block

    def computed(self, tokens: list[int]) -> None:
        """`tokens` (a prompt, or a prompt and its answer minus the last token) ran."""
        self.seen.update(self._chain(tokens, len(tokens) // self.block))


def nominal_ceiling(trace: list[Turn], block_size: int = 16) -> tuple[int, int]:
    """(hittable, prompt) tokens over the trace in nominal arrival order, answers standing in as
    fresh tokens of exactly max_tokens each (their content does not change the ceiling)."""
    ceiling, states = PrefixCeiling(block_size), {s.turns[0].session: s for s in sessions(trace)}
    fresh = -1  # negative ids: never equal to a real token
    hit = total = 0
    pending: dict[int, list[int]] = {}
    for turn in trace:
        s = states[turn.session]
        if turn.session in pending:
            s.answered(pending.pop(turn.session))
        _, prompt = s.prompt()
        hit += ceiling.hittable(prompt)
        total += len(prompt)
        answer = list(range(fresh, fresh - turn.max_tokens, -1))
        fresh -= turn.max_tokens
        ceiling.computed(prompt + answer[:-1])
        pending[turn.session] = answer
    return hit, total


def describe(trace: list[Turn]) -> dict[str, float]:
    groups = sessions(trace)
    planned = [sum(len(t.new_tokens) + t.max_tokens for t in s.turns) for s in groups]
    hit, total = nominal_ceiling(trace)
    return {
        "sessions": len(groups),
        "turns": len(trace),
        "turns_per_session": len(trace) / max(len(groups), 1),
        "new_tokens": sum(len(t.new_tokens) for t in trace),
        "answer_tokens": sum(t.max_tokens for t in trace),
        "prompt_tokens": total,
        "max_context": max(planned, default=0),
        "mean_final_context": sum(planned) / max(len(planned), 1),
        "ceiling": hit / total if total else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=KINDS, default="agent")
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--turns", type=str, default=None, help="override turns per session: LO-HI")
    args = ap.parse_args()
    params = DEFAULTS[args.kind]
    if args.turns:
        lo, _, hi = args.turns.partition("-")
        params = replace(params, turns=(int(lo), int(hi or lo)))
    trace = make_trace(args.kind, args.sessions, args.seed, args.vocab, params)
    for key, value in describe(trace).items():
        print(f"{key:>20}: {value:,.3f}" if isinstance(value, float) else f"{key:>20}: {value:,}")


if __name__ == "__main__":
    main()
