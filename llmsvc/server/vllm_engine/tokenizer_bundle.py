"""GetTokenizer: the served tokenizer as one zip archive, so a gateway on another machine needs
no copy of the model.

The archive is flat (no folders): the tokenizer as this server uses it, written by its own
`save_pretrained` (tokenizer.json, tokenizer_config.json, the chat template, including one given
with --chat-template, and what else the tokenizer saves), plus the model directory's
config.json and generation_config.json when it has them. transformers' AutoTokenizer loads the
unpacked folder. Built once, off the event loop, at the first call; kept in memory after that
(the tokenizer does not change while the server runs). Streamed in CHUNK_BYTES pieces; the last
piece carries the archive's SHA-256 (hex).
"""
from __future__ import annotations

import asyncio
import hashlib
import io
import os
import tempfile
import zipfile

from llmsvc.server.vllm_engine.proto import common_pb2

CHUNK_BYTES = 64 << 10
MODEL_FILES = ("config.json", "generation_config.json")


def build_archive(tokenizer, model_dir: str | None) -> bytes:
    buf = io.BytesIO()
    with tempfile.TemporaryDirectory(prefix="llmsvc-tokenizer-") as tmp:
        tokenizer.save_pretrained(tmp)
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
            names = set()
            for name in sorted(os.listdir(tmp)):
                path = os.path.join(tmp, name)
                if os.path.isfile(path):
                    zf.write(path, name)
                    names.add(name)
            for name in MODEL_FILES:
                path = os.path.join(model_dir, name) if model_dir else None
                if path and name not in names and os.path.isfile(path):
                    zf.write(path, name)
    return buf.getvalue()


def chunks(data: bytes, sha256: str) -> list[common_pb2.GetTokenizerChunk]:
    pieces = [data[i:i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)] or [b""]
    out = [common_pb2.GetTokenizerChunk(data=p) for p in pieces]
    out[-1].sha256 = sha256
    return out


class TokenizerBundle:
    """The archive of one tokenizer, built at most once (concurrent callers share the build;
    a failed build is not kept, so the next call tries again)."""

    def __init__(self, tokenizer, model_dir: str | None) -> None:
        self.tokenizer, self.model_dir = tokenizer, model_dir
        self._archive: tuple[bytes, str] | None = None
        self._lock = asyncio.Lock()

    async def archive(self) -> tuple[bytes, str]:
        """(archive bytes, their SHA-256 hex digest)."""
        async with self._lock:
            if self._archive is None:
                data = await asyncio.to_thread(build_archive, self.tokenizer, self.model_dir)
                self._archive = (data, hashlib.sha256(data).hexdigest())
            return self._archive
