"""Each decoding row's random stream, as a counter-based hash: the uniform a row draws its
token with at a position is a pure function of the row's key (`seeds.stream_seed` of the
call's seed and the request's stream) and of how many tokens the row has generated so far.
All live rows get theirs in one vectorized pass on the logits' device, so a row's tokens
depend on its own key and position alone: not on the batch it runs in, on which rows sit
beside it, or on the device (integer ops give the same bits on every device).

The hash works on 32-bit words held in int64 tensors, always kept in [0, 2^32), so that
right shifts never meet a sign bit and every product fits in int64 without overflow (a
word times a constant below 2^31 in magnitude). Each round is a 32-bit integer hash with
full avalanche (xor-shift-multiply, the constants of Wellons' hash prospector); the key's
two halves and the position go in through three chained rounds, once per output word. Two
words make a 53-bit float64 in [0, 1), as Python's `random.random` builds one.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
# the two output words: each chain starts from the position xor its own salt
SALTS = (0x243F6A88, 0x85A308D3)
MULTIPLIERS = (0x21F0AAAD, 0xD35A2D97)  # the hash round's two multipliers (odd: bijective)


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """x * constant mod 2^32 for words x in [0, 2^32). A constant at or above 2^31 is used
    as constant - 2^32 (the same residue): |product| < 2^63, so int64 never overflows, and
    masking the two's-complement result gives the residue."""
    signed = constant - 2**32 if constant >= 2**31 else constant
    return (x * signed) & MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit bijective hash of words in [0, 2^32): xor-shift, multiply, twice."""
    x = x ^ (x >> 16)
    x = _mul32(x, MULTIPLIERS[0])
    x = x ^ (x >> 15)
    x = _mul32(x, MULTIPLIERS[1])
    return x ^ (x >> 15)


def stream_uniforms(keys_L: torch.Tensor, positions_L: torch.Tensor) -> torch.Tensor:
    """Per row, its uniform in [0, 1) (float64, a multiple of 2^-53) at a position:
    `keys_L` the rows' stream keys (int64 in [0, 2^63)), `positions_L` the number of
    tokens each has generated (int64 >= 0). Both on one device; the result on it too."""
    keys_L1 = keys_L.to(torch.int64)[:, None]
    low_L1, high_L1 = keys_L1 & MASK32, (keys_L1 >> 32) & MASK32
    salts_2 = torch.tensor(SALTS, dtype=torch.int64, device=keys_L.device)
    words_L2 = _hash32((positions_L.to(torch.int64)[:, None] & MASK32) ^ salts_2)
    words_L2 = _hash32(words_L2 ^ low_L1)
    words_L2 = _hash32(words_L2 ^ high_L1)
    bits_L = (words_L2[:, 0] >> 5) * 2**26 + (words_L2[:, 1] >> 6)  # 27 + 26 bits
    return bits_L.to(torch.float64) * 2.0**-53
