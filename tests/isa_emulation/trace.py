"""pytest plugin (`-p tests.isa_emulation.trace`): records each call into the native library's
entry points whose arguments mean the same on every x86 build (attention, the elementwise ops,
the int8 GEMM, whose blob has one layout for every ISA) to $EMU_TRACE, for replay.c to repeat
on a build for another CPU and compare (tests/isa_emulation/run.sh).

A record: name, the host's return code, the arguments (int32, int64, float, or a pointer as
(storage index, byte offset)), then every tensor storage a pointer points into, its bytes before
and after the call. Pointers are matched to storages among the live CPU tensors, so two
arguments into one storage stay aliased in the replay. Calls too big for the trace are run and
not recorded."""
from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import struct
import warnings

import torch

from kernels.cpu_ops import build

TRACED = ("llmsvc_paged_attention", "llmsvc_rms_norm", "llmsvc_fused_add_rms_norm", "llmsvc_silu_and_mul",
          "llmsvc_store_kv", "llmsvc_argmax_rows", "llmsvc_rotary_neox", "llmsvc_gemm_i8")
# replay.c's element types: how a changed storage is compared (0: byte for byte)
DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.int8: 4, torch.uint8: 5,
               torch.int32: 6, torch.int64: 7}
ARG_I32, ARG_I64, ARG_F32, ARG_PTR, ARG_NULL = range(5)
LIMIT = int(os.environ.get("EMU_LIMIT_MB", "400")) << 20  # the whole trace
PER_CALL = 32 << 20  # one call's storages
PER_ENTRY = 400  # calls recorded per entry point
_state = {"out": None, "written": 0, "counts": {}}


def _storages() -> dict[int, tuple[int, int]]:
    """{storage address: (bytes, element type code)} of every live CPU tensor."""
    found: dict[int, tuple[int, int]] = {}
    with warnings.catch_warnings():  # isinstance() on some of torch's module proxies warns
        warnings.simplefilter("ignore")
        # plain tensors and parameters only: the fake and functional tensors a torch.compile
        # test leaves alive in this process have no data to point into
        objects = [o for o in gc.get_objects() if type(o) in (torch.Tensor, torch.nn.Parameter)]
    for o in objects:
        if o.device.type == "cpu" and o.layout == torch.strided:
            try:
                s = o.untyped_storage()
                base, n = s.data_ptr(), s.nbytes()
            except RuntimeError:  # a storage torch has invalidated
                continue
            if n and (base not in found or found[base][0] < n):
                found[base] = (n, DTYPE_CODES.get(o.dtype, 0))
    return found


def encode_call(name: str, rc: int, args: list[tuple[int, int, int]], storages: list[tuple[bytes, bytes, int]]) -> bytes:
    """One record; storages: (before, after, element type code), each 64-byte aligned here."""
    rec = [struct.pack("<I", len(name)), name.encode(), struct.pack("<iI", rc, len(args))]
    rec += [struct.pack("<iiq", *a) for a in args]
    rec.append(struct.pack("<I", len(storages)))
    for before, after, code in storages:
        rec += [struct.pack("<QiI", len(before), code, 0), before, after]
    return b"".join(rec)


def _record(name, fn, sig):
    def call(*args):
        stor, index, rec_args = _storages(), {}, []
        for t, a in zip(sig, args):
            if t is ctypes.c_void_p:
                if not a:
                    rec_args.append((ARG_NULL, 0, 0))
                    continue
                hits = [b for b, (n, _) in stor.items() if b <= a < b + n]
                if not hits:
                    return fn(*args)  # not in a tensor: this call cannot be recorded
                base = max(hits)
                rec_args.append((ARG_PTR, index.setdefault(base, len(index)), a - base))
            elif t is ctypes.c_float:
                rec_args.append((ARG_F32, 0, struct.unpack("<I", struct.pack("<f", a))[0]))
            else:
                rec_args.append((ARG_I64 if t is ctypes.c_int64 else ARG_I32, 0, a))
        bases = sorted(index, key=index.get)
        size = sum(stor[b][0] for b in bases)
        if (any(b % 64 for b in bases) or size > PER_CALL or _state["written"] + 2 * size > LIMIT
                or _state["counts"].get(name, 0) >= PER_ENTRY):
            return fn(*args)
        before = [ctypes.string_at(b, stor[b][0]) for b in bases]
        rc = fn(*args)
        after = [ctypes.string_at(b, stor[b][0]) for b in bases]
        data = encode_call(name, rc, rec_args, [(x, y, stor[b][1]) for b, x, y in zip(bases, before, after)])
        _state["out"].write(data)
        _state["written"] += len(data)
        _state["counts"][name] = _state["counts"].get(name, 0) + 1
        return rc
    return call


@contextlib.contextmanager
def recording(path: str):
    """Records the traced entry points' calls to `path` while open; yields {entry: calls}."""
    lib = build.load()
    if lib is None:
        raise RuntimeError("the native library did not load: nothing to record")
    originals = {name: getattr(lib, name) for name in TRACED}
    with open(path, "wb") as out:
        _state.update(out=out, written=0, counts={})
        for name in TRACED:
            setattr(lib, name, _record(name, originals[name], build._SIGNATURES[name]))
        try:
            yield _state["counts"]
        finally:
            for name, fn in originals.items():
                setattr(lib, name, fn)
            _state["out"] = None


def pytest_configure(config):
    config._emu_recording = recording(os.environ["EMU_TRACE"])
    config._emu_recording.__enter__()


def pytest_unconfigure(config):
    rec = getattr(config, "_emu_recording", None)
    if rec is not None:
        rec.__exit__(None, None, None)
        print(f"\ntraced {_state['counts']}, {_state['written'] >> 20} MiB")
