"""A tiny served model whose every token is ASCII text, for tests that read output through a
gateway that detokenizes by itself (SMG): tests/server_harness.tiny_tokenizer's ids are raw
bytes, and a byte >= 0x80 alone decodes to U+FFFD, which the gateway reports, and drops from
logprobs, differently from our server."""
from __future__ import annotations


def ascii_tokenizer():
    """tests/server_harness.tiny_tokenizer's layout (259 ids, the same specials and chat template)
    with every token ASCII: ids 0..127 are the ASCII bytes, 128..255 two-character merges of
    common letters. Any output decodes to whole characters, so a gateway that detokenizes on its
    own (SMG) and our server give the same text, and a token's text names its id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from llmsvc.server.responses import _byte_decoder
    from tests.server_harness import CHAT_TEMPLATE, EOS, IM_END, IM_START

    char = {b: ch for ch, b in _byte_decoder().items()}  # byte -> byte-level BPE symbol
    vocab = {char[b]: b for b in range(128)}
    pairs = [(a, b) for a in "etaoinsrhldu" for b in " etaoinsrhl"][:128]
    merges = []
    for k, (a, b) in enumerate(pairs):
        merges.append((char[ord(a)], char[ord(b)]))
        vocab[char[ord(a)] + char[ord(b)]] = 128 + k
    vocab.update({"<|endoftext|>": EOS, "<|im_start|>": IM_START, "<|im_end|>": IM_END})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_ascii_served_model_dir(path, **cfg) -> str:
    """A tiny random Llama (tests/model_utils) with ascii_tokenizer(): `llmsvc serve` and SMG both
    load it from the directory."""
    from tests.model_utils import make_tiny_model_dir
    from tests.server_harness import EOS, IM_START, TINY_VOCAB

    d = make_tiny_model_dir(path, **{"vocab_size": TINY_VOCAB, "eos_token_id": EOS, "bos_token_id": IM_START,
                                     "pad_token_id": 0, **cfg})
    ascii_tokenizer().save_pretrained(d)
    return d
