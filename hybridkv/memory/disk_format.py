"""One disk-tier entry as a file: a header naming what it holds, the tensors' raw bytes, a CRC-32.

    magic    8 bytes   b"HKVDISK" + format version (1)
    length   4 bytes   little-endian uint32: the header's length
    header   JSON      {"kind": "state" | "kv", "key": block hash (hex), "position": tokens,
                        "namespace": the tier's namespace, "tensors": [[name, dtype, shape, nbytes], ...]}
    payload            each tensor's bytes in header order, exactly as the pool holds them (a
                       quantized pool's uint8 codes and scales included: bytes are never converted)
    crc      4 bytes   little-endian uint32: CRC-32 of everything before it

`encode_to` writes one; `decode` reads one back, refusing (DiskEntryError, with the reason) any
file that is short, has another magic, a header that does not parse, a CRC that does not match,
or a kind, key, position, namespace, tensor name, dtype or shape other than the reader expects.
A truncated file fails the length or CRC test; a flipped bit anywhere fails the CRC (CRC-32
detects every single-bit error and every burst of up to 32 bits).
"""
from __future__ import annotations

import json
import struct
import zlib
from typing import BinaryIO, Mapping, Sequence

import torch

MAGIC = b"HKVDISK\x01"
_U32 = struct.Struct("<I")
_MIN_SIZE = len(MAGIC) + 2 * _U32.size


class DiskEntryError(ValueError):
    """A disk entry that must not be used (the message says why)."""


# An entry's expected tensors: [(name, torch dtype, shape)] in file order.
Layout = Sequence[tuple[str, torch.dtype, tuple]]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a host tensor as the pool holds them (any dtype, bfloat16 included)."""
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def encode_to(f: BinaryIO, kind: str, key: bytes, position: int, namespace: str,
              tensors: Sequence[tuple[str, torch.Tensor]]) -> int:
    """Write one entry to `f` (host tensors); returns the bytes written."""
    views = [(name, t, tensor_bytes(t)) for name, t in tensors]
    header = json.dumps({"kind": kind, "key": key.hex(), "position": position, "namespace": namespace,
                         "tensors": [[name, str(t.dtype), list(t.shape), v.nbytes] for name, t, v in views]},
                        separators=(",", ":")).encode()
    head = MAGIC + _U32.pack(len(header)) + header
    crc = zlib.crc32(head)
    f.write(head)
    for _, _, v in views:
        crc = zlib.crc32(v, crc)
        f.write(v)
    f.write(_U32.pack(crc))
    return len(head) + sum(v.nbytes for _, _, v in views) + _U32.size


def decode(data: bytearray, kind: str, key: bytes, position: int, namespace: str,
           layout: Layout) -> dict[str, torch.Tensor]:
    """The tensors of an entry file's bytes {name: tensor} (views into `data`), after every check
    against what the reader expects; DiskEntryError naming the first check that failed."""
    if len(data) < _MIN_SIZE:
        raise DiskEntryError(f"{len(data)} bytes: shorter than any entry (truncated)")
    if bytes(data[:len(MAGIC)]) != MAGIC:
        raise DiskEntryError("not a hybridkv disk entry of this format (magic differs)")
    (n,) = _U32.unpack_from(data, len(MAGIC))
    body = len(MAGIC) + _U32.size
    if body + n + _U32.size > len(data):
        raise DiskEntryError(f"header of {n} bytes runs past the file's {len(data)} bytes (truncated)")
    (crc,) = _U32.unpack_from(data, len(data) - _U32.size)
    if zlib.crc32(memoryview(data)[:len(data) - _U32.size]) != crc:
        raise DiskEntryError("CRC-32 mismatch (the file was changed or cut short)")
    try:
        header = json.loads(bytes(data[body:body + n]))
        got = (header["kind"], header["key"], header["position"], header["namespace"])
        listed = [(name, dtype, tuple(shape), int(nbytes)) for name, dtype, shape, nbytes in header["tensors"]]
    except (ValueError, KeyError, TypeError) as e:
        raise DiskEntryError(f"header does not parse: {e}") from None
    want = (kind, key.hex(), position, namespace)
    if got != want:
        raise DiskEntryError(f"entry is (kind, key, position, namespace) {got}, expected {want}")
    expected = [(name, str(dtype), tuple(shape)) for name, dtype, shape in layout]
    if [item[:3] for item in listed] != expected:
        raise DiskEntryError(f"tensors {[item[:3] for item in listed]}, expected {expected}")
    offset, out = body + n, {}
    end = len(data) - _U32.size
    for (name, dtype, shape), (_, _, _, nbytes) in zip(layout, listed):
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if nbytes != size or offset + size > end:
            raise DiskEntryError(f"tensor {name} holds {nbytes} bytes, expected {size}")
        raw = torch.frombuffer(data, dtype=torch.uint8, offset=offset, count=size) if size else \
            torch.empty(0, dtype=torch.uint8)
        out[name] = raw.view(dtype).reshape(shape)
        offset += size
    if offset != end:
        raise DiskEntryError(f"{end - offset} bytes past the last tensor")
    return out


def layout_of(tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.dtype, tuple]]:
    """The layout of {name: tensor} in its order (what decode expects of a file of these)."""
    return [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
