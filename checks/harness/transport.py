"""Messages between the suite's process and its rank processes: pickle, with tensors as raw bytes.

Written here because neither stock path suits many small messages: `multiprocessing.Connection.send`
pickles with torch's ForkingPickler reductions, which hand every tensor storage over as a shared-memory
file descriptor (about 0.5 ms and one fd round trip per tensor), and plain pickle serialises each storage
through torch.save (about 1 ms per message of a few small tensors). Results that travel are small and on the
CPU (targets return CPU tensors), so their bytes are the cheapest transport: 0.2 ms for the same message.
"""
from __future__ import annotations

import io
import pickle

import torch


def _rebuild(dtype: torch.dtype, shape: tuple, data: bytes) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and type(obj) is torch.Tensor and obj.layout == torch.strided:
            t = obj.detach().cpu().contiguous()
            data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            return _rebuild, (t.dtype, tuple(t.shape), data)
        return NotImplemented


def dumps(obj) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def loads(data: bytes):
    return pickle.loads(data)
