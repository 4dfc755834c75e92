"""ECMP hashes of many routes at once: ``zlib.crc32`` continued on arrays of CRCs.

A route's hash at a switch is ``zlib.crc32(b"|" + switch, crc32(salt))``
(:meth:`clustersim.hardware.topology.Cluster._leaf_edges`). CRC-32 is affine over GF(2) in
the value it continues from, and the linear part depends only on how many bytes follow::

    crc32(data, v) = Z_n(v) ^ crc32(data)          n = len(data), Z_n linear in v
    Z_n(v)         = crc32(b"\\0" * n, v) ^ crc32(b"\\0" * n)

(zlib's crc32 inverts the register before and after; the inversions cancel in Z_n: Koopman,
"32-bit cyclic redundancy codes for Internet applications", DSN 2002, on CRC linearity; the
same property is what zlib's ``crc32_combine`` rests on). A linear map of 32 bits is four
tables of 256 entries, one per byte of ``v``, so a column of CRCs continues by the same
bytes in four lookups per row::

    Z_n(v) = T[n][0][v & 255] ^ T[n][1][v >> 8 & 255] ^ T[n][2][v >> 16 & 255] ^ T[n][3][v >> 24]

and a salt ``x + y`` hashes as ``crc32(y, crc32(x))``: a GPU pair's ``"src>dst"`` from one
CRC per GPU for each side.
"""

from __future__ import annotations

import zlib

import numpy as np

_BITS = ((np.arange(256)[:, None] >> np.arange(8)) & 1).astype(bool)  # [x, j]: bit j of byte x


def _tables(n: int) -> np.ndarray:
    """The four byte tables of Z_n, shape (4, 256), int64: from Z_n of the 32 single bits."""
    zeros = bytes(n)
    base = zlib.crc32(zeros)
    bit = np.array([zlib.crc32(zeros, 1 << b) ^ base for b in range(32)], dtype=np.int64)
    return np.stack([np.bitwise_xor.reduce(np.where(_BITS, bit[8 * k:8 * k + 8], 0), axis=1) for k in range(4)])


class Continuations:
    """CRCs continued by byte strings, on arrays: strings are registered once (:meth:`code`),
    then :meth:`apply` gives ``crc32(strings[code[i]], crc[i])`` for every row ``i``."""

    def __init__(self) -> None:
        self._codes: dict[bytes, int] = {}
        self._lengths: dict[int, int] = {}  # byte length -> row of self._z
        self._crc: list[int] = []  # per code: crc32(string)
        self._len_of: list[int] = []  # per code: its length's row
        self._z: list[np.ndarray] = []
        self._arrays: tuple | None = None  # (tables, length rows, CRCs) as arrays, until a new code

    def code(self, data: bytes) -> int:
        """The code of ``data`` (registered on first sight)."""
        got = self._codes.get(data)
        if got is None:
            got = self._codes[data] = len(self._crc)
            row = self._lengths.get(len(data))
            if row is None:
                row = self._lengths[len(data)] = len(self._z)
                self._z.append(_tables(len(data)))
            self._crc.append(zlib.crc32(data))
            self._len_of.append(row)
            self._arrays = None
        return got

    def apply(self, code: np.ndarray, crc: np.ndarray) -> np.ndarray:
        """``zlib.crc32(string of code[i], crc[i])`` per row, int64 (``crc`` in 0 .. 2**32 - 1)."""
        if self._arrays is None:
            self._arrays = (np.stack(self._z), np.asarray(self._len_of, dtype=np.int64),
                            np.asarray(self._crc, dtype=np.int64))
        z, len_of, crcs = self._arrays  # z: (lengths, 4, 256)
        row = len_of[code]
        out = crcs[code]
        for k in range(4):
            out ^= z[row, k, (crc >> (8 * k)) & 255]
        return out
