"""The output processor: turns each sampled token into a request's output — stop conditions, detokenizing,
logprobs, n-choice groups and failures — and counts what was served. It never touches blocks or the scheduler:
the engine frees a sequence the processor reports finished."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hafiza.engine.output import TextOutput, TokenLogprob, token_logprobs
from hafiza.engine.results import FinishReason, RequestOutput
from hafiza.engine.sequence import Sequence
from hafiza.models.tokenizer import Tokenizer


@dataclass
class ChoiceGroup:
    """The n choices of one request: how many are unfinished, and whether choices 1..n-1 were added yet."""

    n: int
    remaining: int
    spawned: bool = False
    cache_salt: str | None = None


class OutputProcessor:
    """Per-sequence text state, per-request choice groups, and the served-token counters."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer, self.max_model_len = tokenizer, max_model_len
        self.texts: dict[str, TextOutput] = {}
        self.groups: dict[str, ChoiceGroup] = {}
        self.prompt_tokens = self.generation_tokens = self.requests_finished = 0

    def open_group(self, request_id: str, n: int, cache_salt: str | None) -> None:
        """Start counting the n choices of a request (choice 0 is added now, the others by `spawn_due`)."""
        self.groups[request_id] = ChoiceGroup(n, n, cache_salt=cache_salt)

    def add(self, seq: Sequence) -> None:
        """Give a new sequence its text state."""
        p = seq.params
        self.texts[seq.request_id] = TextOutput(self.tokenizer, p.stop, p.skip_special_tokens,
                                                p.include_stop_str_in_output)

    def drop(self, request_id: str) -> ChoiceGroup | None:
        """Forget an aborted request; returns its choice group (None for a single choice)."""
        group = self.groups.pop(request_id, None)
        for i in range(group.n if group else 1):
            self.texts.pop(request_id if i == 0 else f"{request_id}/{i}", None)
        return group

    def spawn_due(self, seq: Sequence) -> ChoiceGroup | None:
        """The group whose choices 1..n-1 should be added now that choice 0 has its prompt's K/V (once)."""
        group = self.groups.get(seq.group_id) if seq.index == 0 and seq.params.n > 1 else None
        if group is None or group.spawned:
            return None
        group.spawned = True
        return group

    def advance(self, seq: Sequence, token: int | None, now: float) -> RequestOutput | None:
        """Append the sampled token (None: nothing was sampled this step), apply the stop conditions, and report.
        A finished output (also one failed by its grammar) means the engine must free the sequence."""
        p, text_out = seq.params, self.texts[seq.request_id]
        new: list[int] = []
        text = ""
        if seq.num_computed == seq.num_tokens and p.max_tokens == 0:
            seq.finish_reason = FinishReason.LENGTH
        elif token is None:
            return None
        else:
            if seq.grammar is not None and not seq.grammar.accept(token):
                return self.fail(seq, f"sampled token {token} is not allowed by the request's grammar")
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.token_ids.append(token)
            new = [token]
            self.generation_tokens += 1
            if p.ends_on(token, self.tokenizer.eos_token_ids):
                seq.finish_reason = FinishReason.STOP
                if p.include_stop_str_in_output:
                    text = text_out.add(token, check_stop=False)
            else:
                text = text_out.add(token, check_stop=seq.num_output_tokens > p.min_tokens)
                if text_out.stop_sequence is not None:
                    seq.finish_reason, seq.stop_sequence = FinishReason.STOP_SEQUENCE, text_out.stop_sequence
                elif seq.grammar is not None and seq.grammar.done:
                    seq.finish_reason = FinishReason.STOP
                elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
                    seq.finish_reason = FinishReason.LENGTH
        prompt_logprobs = None
        if seq.index == 0 and p.prompt_logprobs is not None and seq.num_output_tokens <= len(new):
            prompt_logprobs = list(seq.prompt_logprobs)
        logprobs = [seq.pending_logprob] if new and seq.pending_logprob is not None else []
        seq.pending_logprob = None
        finished = seq.finish_reason is not None
        if finished:
            text += text_out.flush() if seq.stop_sequence is None else ""
            self.prompt_tokens += seq.num_prompt_tokens
            self._finished(seq)
        return self._output(seq, new, text, logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    def fail(self, seq: Sequence, error: str) -> RequestOutput:
        """Finish one sequence with an error (the engine frees it and caches none of its K/V)."""
        seq.finish_reason = FinishReason.ERROR
        self._finished(seq)
        return self._output(seq, [], "", error=error, pinned=False)

    def _finished(self, seq: Sequence) -> None:
        self.texts.pop(seq.request_id, None)
        self.requests_finished += 1
        group = self.groups.get(seq.group_id)
        if group is not None:
            group.remaining -= 1
            if group.remaining <= 0:
                self.groups.pop(seq.group_id)

    @staticmethod
    def _output(seq: Sequence, new: list[int], text: str, error: str | None = None, pinned: bool = True,
                logprobs: list[TokenLogprob] | None = None,
                prompt_logprobs: list[TokenLogprob | None] | None = None) -> RequestOutput:
        return RequestOutput(
            request_id=seq.group_id, index=seq.index, new_token_ids=new, text=text,
            finished=seq.finish_reason is not None, finish_reason=seq.finish_reason,
            stop_sequence=seq.stop_sequence if error is None else None,
            num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens or 0,
            num_output_tokens=seq.num_output_tokens, pinned_tokens=seq.pinned_tokens if pinned else 0,
            tiers=seq.tiers if error is None else None, arrival_time=seq.arrival_time,
            first_token_time=seq.first_token_time, error=error, logprobs=logprobs or [],
            prompt_logprobs=prompt_logprobs)

    @staticmethod
    def merge(outs: list[RequestOutput]) -> RequestOutput | None:
        """One output for the tokens one step emitted for a sequence: the last output's state, all tokens."""
        if not outs:
            return None
        last = outs[-1]
        last.new_token_ids = [t for o in outs for t in o.new_token_ids]
        last.text = "".join(o.text for o in outs)
        last.logprobs = [lp for o in outs for lp in o.logprobs]
        last.prompt_logprobs = next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None)
        return last

    @staticmethod
    def record_prompt_logprobs(seq: Sequence, n: int, logits: torch.Tensor) -> None:
        """Row j of `logits` (position num_computed + j) gives the logprob of the prompt token after it."""
        start, k = seq.num_computed, seq.params.prompt_logprobs or 0
        if start == 0:
            seq.prompt_logprobs = [None]
        if len(seq.prompt_logprobs) < start + 1:
            return  # positions before `start` came from a cache: cannot happen while they are needed
        del seq.prompt_logprobs[start + 1 :]
        last = min(start + n, seq.num_prompt_tokens - 1)
        if last > start:
            targets = seq.token_ids[start + 1 : last + 1]
            seq.prompt_logprobs += token_logprobs(logits[: last - start], targets, k)
