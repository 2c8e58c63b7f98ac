"""What a request shows its caller: detokenized text, stop strings, logprobs and the
``RequestOutput`` of each step.

The output processor reads a sequence's tokens and status; it never writes them (the commit,
``jspec/commit.py``, and the scheduler do). What it decides for each new token is whether the
request stops there (``check_stop``): EOS, a stop token, a stop string in the text, or the length.
"""

from __future__ import annotations

import dataclasses
import time

from jspec.detokenizer import IncrementalDetokenizer, find_stop
from jspec.outputs import Logprob, RequestOutput, SpecStats
from jspec.sampling_params import SamplingParams
from jspec.sequence import Sequence, SequenceStatus


@dataclasses.dataclass(eq=False)
class RequestState:
    """The caller-facing side of one request: its text so far and what was already streamed."""

    seq: Sequence
    prompt: str | None
    detok: IncrementalDetokenizer
    arrival_time: float
    text_end: int | None = None  # text cut at a stop string
    finish_time: float | None = None
    last_text_len: int = 0
    last_num_tokens: int = 0
    # per output token {token id: Logprob} when the request asked for logprobs (append-only,
    # shared with its RequestOutputs like the token list)
    logprobs: list | None = None


class OutputProcessor:
    """The requests the engine serves, keyed by id, and the outputs built for them."""

    def __init__(self, tokenizer, eos_token_ids):
        """``eos_token_ids``: the target's; the tokenizer's EOS counts too."""
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(int(tokenizer.eos_token_id))
        self.requests: dict[str, RequestState] = {}
        self._token_texts: dict[int, str] = {}  # Logprob.decoded_token, per token id
        # outputs produced outside a step (aborts), handed out by the next one
        self.pending: list[RequestOutput] = []
        # Streaming callers want every step's deltas; offline generation only the finished
        # requests, and skipping the per-step outputs trims host time per step.
        self.stream = True

    def add(self, seq: Sequence, prompt: str | None, now: float) -> None:
        self.requests[seq.request_id] = RequestState(
            seq=seq, prompt=prompt, detok=IncrementalDetokenizer(self.tokenizer),
            arrival_time=now, logprobs=None if seq.sampling_params.logprobs is None else [])

    def take_pending(self) -> list[RequestOutput]:
        outputs, self.pending = self.pending, []
        return outputs

    def check_stop(self, req: RequestState, token: int) -> SequenceStatus | None:
        """Detokenize ``token`` (just appended to the sequence) and say whether the request
        stops at it."""
        seq = req.seq
        sp: SamplingParams = seq.sampling_params
        before = len(req.detok.text)
        delta = req.detok.add(token)
        if not sp.ignore_eos and token in self.eos_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if token in sp.stop_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if sp.stop and delta:
            idx = find_stop(req.detok.text, len(req.detok.text) - before, sp.stop)
            if idx != -1:
                req.text_end = idx
                return SequenceStatus.FINISHED_STOPPED
        if seq.num_output_tokens >= sp.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def add_logprobs(self, req: RequestState, logprobs, row: int, count: int) -> None:
        """vLLM's per-token ``{token id: Logprob}``: the request's top ``logprobs`` tokens at
        each of the ``count`` places row ``row`` emitted, and the emitted token itself."""
        if not count:
            return
        k = req.seq.sampling_params.logprobs
        tokens = req.seq.output_token_ids[-count:]
        chosen = logprobs.logprob[row, :count].tolist()
        ranks = logprobs.rank[row, :count].tolist()
        top_ids = logprobs.top_ids[row, :count, :k].tolist()
        top_lps = logprobs.top_logprobs[row, :count, :k].tolist()
        for j, token in enumerate(tokens):
            entry = {t: Logprob(lp, r + 1, self._token_text(t))
                     for r, (t, lp) in enumerate(zip(top_ids[j], top_lps[j]))}
            if token not in entry:
                entry[token] = Logprob(chosen[j], ranks[j], self._token_text(token))
            req.logprobs.append(entry)

    def _token_text(self, token: int) -> str | None:
        """One token's text (cached: a request asking for 20 logprobs names 21 tokens a step)."""
        text = self._token_texts.get(token)
        if text is None and self.tokenizer is not None:
            text = self._token_texts[token] = self.tokenizer.decode([token])
        return text

    def finish(self, req: RequestState) -> RequestOutput:
        """The request's last output; the processor forgets it."""
        req.finish_time = time.perf_counter()
        self.requests.pop(req.seq.request_id, None)
        return self.output(req)

    def output(self, req: RequestState) -> RequestOutput:
        seq = req.seq
        text = req.detok.text if req.text_end is None else req.detok.text[:req.text_end]
        finished = seq.status.finished
        stops = seq.sampling_params.stop
        if stops and not finished:
            # hold back what could be the start of a stop string: streamed text is never
            # retracted, so deltas always add up to the final text
            text = text[:max(len(text) - (max(map(len, stops)) - 1), req.last_text_len)]
        delta_text = text[req.last_text_len:]
        delta_ids = seq.output_token_ids[req.last_num_tokens:]
        req.last_text_len, req.last_num_tokens = len(text), seq.num_output_tokens
        return RequestOutput(
            request_id=seq.request_id, prompt=req.prompt,
            prompt_token_ids=seq.prompt_token_ids, text=text,
            token_source=seq.output_token_ids, num_tokens=seq.num_output_tokens,
            delta_text=delta_text,
            delta_token_ids=delta_ids, finished=finished,
            finish_reason=seq.status.value if finished else None,
            spec=SpecStats(seq.num_drafted, seq.num_accepted, seq.num_spec_steps, seq.num_steps),
            metrics={"arrival_time": req.arrival_time, "first_token_time": seq.first_token_time,
                     "finish_time": req.finish_time},
            logprob_source=req.logprobs,
            num_cached_tokens=seq.num_cached_tokens or 0,
        )
