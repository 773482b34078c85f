"""The engine requests of a request's choices: n samples of one prompt, each its own seed and
grammar matcher."""

from __future__ import annotations

from dataclasses import replace

from daemon.api.codecs.base import Job
from daemon.api.codecs.constraints import Grammar
from daemon.loop.request import SamplingParams


def seeded(params: SamplingParams, choice: int) -> SamplingParams:
    """Choice i of a prompt samples with seed+i, so n>1 with a seed gives n different texts."""
    if params.seed is None or choice == 0:
        return params
    return replace(params, seed=params.seed + choice)


def sample_jobs(
    prompt_ids: list[int], params: SamplingParams, n: int, grammar: Grammar | None = None
) -> list[Job]:
    """The n choices of one prompt, each with its own seed (see `seeded`) and grammar matcher."""
    jobs = []
    for i in range(n):
        p = replace(seeded(params, i), constraint=grammar.constraint() if grammar else None)
        jobs.append((prompt_ids, p))
    return jobs
