"""POST /tokenize, /detokenize and GET /tokenizer_info (the model's own tokenizer, as vLLM serves them), and
/v1/embeddings, which this server does not offer: a 404 that says so rather than a bare "no route"."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from hafiza.server.auth import require_any_key
from hafiza.server.body import parse_json, read_body, validate
from hafiza.server.convert import openai_conversation
from hafiza.server.errors import ApiError
from hafiza.server.prompt import build_prompt, render
from hafiza.server.schemas.completions import DetokenizeRequest, TokenizeRequest
from hafiza.server.state import ServerState, server_state

router = APIRouter(dependencies=[Depends(require_any_key)])
Json = dict[str, object]


@router.post("/tokenize")
async def tokenize(request: Request, state: ServerState = Depends(server_state)) -> Json:
    """Token ids of a `prompt`, or of chat `messages` exactly as /v1/chat/completions would see them."""
    req = validate(TokenizeRequest, parse_json(await read_body(request, state.settings.max_body_bytes)))
    if req.model is not None:
        state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "give exactly one of prompt and messages", param="prompt")
    tok = state.tokenizer
    if req.prompt is not None:
        ids = tok.encode(req.prompt, add_special=req.add_special_tokens)
    else:
        conv = openai_conversation(req.messages or [])
        if req.add_generation_prompt:
            ids = build_prompt(tok, conv, state.settings.allow_special_tokens_in_content).ids
        else:
            ids = tok.encode(render(tok, conv, final=False))
    return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids,
            "token_strs": [tok.backend.id_to_token(i) for i in ids]}


@router.post("/detokenize")
async def detokenize(request: Request, state: ServerState = Depends(server_state)) -> Json:
    """Text of token ids (special tokens kept)."""
    req = validate(DetokenizeRequest, parse_json(await read_body(request, state.settings.max_body_bytes)))
    if req.model is not None:
        state.check_model(req.model)
    vocab = state.tokenizer.vocab_size
    bad = [i for i in req.tokens if not 0 <= i < vocab]
    if bad:
        raise ApiError(400, f"tokens: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="tokens")
    return {"prompt": state.tokenizer.decode(req.tokens, skip_special=False)}


@router.post("/v1/embeddings")
async def embeddings(state: ServerState = Depends(server_state)) -> Json:
    """Not served: hafiza runs generative models only."""
    raise ApiError(404, f"embeddings are not served here: {state.settings.model_name!r} is a generative model and "
                        f"this server has no /v1/embeddings", code="not_found")


@router.get("/tokenizer_info")
async def tokenizer_info(state: ServerState = Depends(server_state)) -> Json:
    """The tokenizer's special tokens and chat template (what lm-eval's `tokenizer_backend=remote` reads)."""
    tok = state.tokenizer
    return {"tokenizer_class": "hafiza", "bos_token": tok.bos_token, "eos_token": tok.eos_token, "pad_token": None,
            "add_bos_token": tok.add_bos, "chat_template": tok.chat_template,
            "model_max_length": state.max_model_len, "vocab_size": tok.vocab_size}
