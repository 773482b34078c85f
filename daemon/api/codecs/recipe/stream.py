"""Engine outputs -> deepseek-recipe InferenceChunks -> protocol events, for one request."""

from __future__ import annotations

from dataclasses import dataclass

import deepseek_recipe as dr

from daemon.loop.request import FinishReason, RequestOutput

_FINISH = {
    FinishReason.STOP: dr.InferenceFinishReason.Stop,
    FinishReason.LENGTH: dr.InferenceFinishReason.Length,
}


@dataclass
class OutputStream:
    """Feeds one request's outputs into a StreamProcessor; `feed` returns the new events."""

    processor: dr.StreamProcessor
    eos_token_ids: tuple[int, ...]
    num_prompt_tokens: int
    started: bool = False
    num_cached_tokens: int = 0
    finished: bool = False

    def feed(self, out: RequestOutput) -> list:
        events: list = []
        if self.finished:  # the parser ended at a stop sequence before the engine's output did
            return events
        if not self.started:
            self.started = True
            self.num_cached_tokens = out.num_cached_tokens
            usage = dr.PromptUsage(
                prompt_tokens=self.num_prompt_tokens,
                prompt_cache_hit_tokens=out.num_cached_tokens,
            )
            events += self.processor.push(dr.InferenceChunk.ready(prompt_usage=usage))
        ids = list(out.new_token_ids)
        lps = out.logprobs
        ended = out.finish_reason is FinishReason.STOP and out.stop_reason is None
        if ended and ids and ids[-1] in self.eos_token_ids:  # end of turn: not content
            ids = ids[:-1]
            lps = lps[:-1] if lps else lps
        if ids:
            pairs = [(lp.logprob, list(lp.top)) for lp in lps] if lps else None
            events += self.processor.push(dr.InferenceChunk.tokens(ids, pairs))
        if self.processor.finished:  # a stop sequence ended it; it takes no finish chunk
            self.finished = True
        elif out.finished and out.finish_reason in _FINISH:
            events += self.processor.push(dr.InferenceChunk.finish(_FINISH[out.finish_reason]))
            events += self.processor.finish()
            self.finished = True
        return events

    def close(self) -> None:
        if not self.finished:
            self.processor.close()
