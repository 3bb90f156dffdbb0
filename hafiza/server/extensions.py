"""The vLLM/SGLang request extensions vllm-router adds to chat and completions bodies: which engine settings they
become, and a 400 naming the field for a value this server cannot honour (none is accepted and ignored).

The reasoning flags (`separate_reasoning`, `stream_reasoning`, `include_reasoning`) ask nothing of a model that
does not reason: there is no reasoning text to separate, stream or leave out, so every value is honoured. A model
whose vocabulary has a `</think>` token writes its reasoning into the reply, and this server has no reasoning
parser: there only the values that keep the reasoning in the content (`separate_reasoning: false`,
`include_reasoning: true`, `stream_reasoning: true`) are accepted.
"""

from __future__ import annotations

from hafiza.models.tokenizer import Tokenizer
from hafiza.server.errors import ApiError
from hafiza.server.pd import parse_transfer
from hafiza.server.schemas.openai import ChatVllmFields, VllmFields

THINK_END = "</think>"


def reasons(tokenizer: Tokenizer) -> bool:
    """Whether the model writes reasoning (its vocabulary has a `</think>` token)."""
    return tokenizer.backend.token_to_id(THINK_END) is not None


def check_extensions(req: VllmFields, tokenizer: Tokenizer, role: str = "both") -> None:
    """400 naming the first extension field set to a value this server cannot honour; `kv_transfer_params` is
    taken only by a prefill or decode worker (`role`, see hafiza/server/pd.py)."""
    if req.return_hidden_states:
        raise ApiError(400, "return_hidden_states: hidden states are not returned by this server",
                       param="return_hidden_states")
    parse_transfer(req.kv_transfer_params, role, bool(getattr(req, "stream", False)))
    if isinstance(req, ChatVllmFields) and reasons(tokenizer):
        wanted = {"separate_reasoning": False, "include_reasoning": True, "stream_reasoning": True}
        for name, ok in wanted.items():
            value = getattr(req, name)
            if value is not None and value is not ok:
                raise ApiError(400, f"{name}: {str(value).lower()} needs a reasoning parser, which this server "
                                    f"does not have (the model's reasoning stays in the content); send "
                                    f"{str(ok).lower()} or leave it out", param=name)
