"""Tokenize and Detokenize of llmsvc.v1: the model's tokenizer, as Generate uses it."""
from __future__ import annotations

from llmsvc.server import errors
from llmsvc.server.prompt import encode, render_chat
from llmsvc.server.validation import ModelLimits, check_token_ids
from llmsvc.v1 import llmsvc_pb2 as pb


def tokenize(request, tokenizer, limits: ModelLimits) -> pb.TokenizeResponse:
    """Text or a rendered chat -> token ids (special tokens: on for text, off for chat, unless
    set), with UTF-8 byte offsets and pieces when asked."""
    kind = request.WhichOneof("input")
    if kind is None:
        raise errors.invalid("input", "set text or chat")
    if kind == "chat":
        text = render_chat(tokenizer, request.chat)
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else False
    else:
        text = request.text
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
    resp = pb.TokenizeResponse(max_model_len=limits.max_model_len)
    if request.return_offsets:
        enc = tokenizer(text, add_special_tokens=add_special, return_offsets_mapping=True)
        resp.token_ids.extend(enc["input_ids"])
        pos = nbytes = 0  # characters -> UTF-8 byte offsets, in one pass (offsets are non-decreasing)
        for s, e in enc["offset_mapping"]:
            if s < pos:
                pos = nbytes = 0
            nbytes += len(text[pos:s].encode("utf-8"))
            pos = s
            resp.offsets.append(pb.Offset(start=nbytes, end=nbytes + len(text[s:e].encode("utf-8"))))
    else:
        resp.token_ids.extend(encode(tokenizer, text, add_special))
    if request.return_pieces:
        resp.pieces.extend(tokenizer.convert_ids_to_tokens(list(resp.token_ids)))
    return resp


def detokenize(request, tokenizer, limits: ModelLimits) -> pb.DetokenizeResponse:
    check_token_ids("token_ids", request.token_ids, limits.vocab_size)
    skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
    return pb.DetokenizeResponse(text=tokenizer.decode(list(request.token_ids), skip_special_tokens=skip))
