#!/usr/bin/env python3
"""Generate tests/fixtures/quant_blocks.gguf: random ggml blocks of every quantized format kiln
reads, beside their f32 dequantization by gguf-py (bit-identical to ggml's C reference).

Run from the repo root:
    python -m venv .venv-quant && .venv-quant/bin/pip install gguf==0.19.0 numpy==2.4.6
    .venv-quant/bin/python scripts/make_quant_fixtures.py

(the pins are those of scripts/requirements-fixtures.txt). For every format the file holds two
tensors: `<TYPE>.blocks`, the raw blocks (random bytes whose f16 scales are overwritten with
random finite values, so no block decodes to NaN or inf), and `<TYPE>.f32`, gguf-py's
dequantization of them. gguf-py 0.19.0 has no dequantization for Q8_K; its reference values
are ggml's definition `x = d * q` (f32 `d` times the int8 quant, one f32 rounding) computed with
numpy. The output is deterministic (fixed seed).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter, quants
from gguf.constants import GGML_QUANT_SIZES

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "quant_blocks.gguf"

# Byte offsets of each block's f16 scale fields (d, and dmin or m where the format has one).
F16_FIELDS = {
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q8_0: [0],
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
}
# Blocks per format: a few KB of f32 each.
BLOCKS = {32: 40, 256: 6}


def random_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    """Finite f16 values of both signs over many magnitudes, subnormals and zero included."""
    mag = np.float32(2.0) ** rng.uniform(-26, 0, n).astype(np.float32)
    v = (mag * rng.choice(np.array([-1, 1], dtype=np.float32), n)).astype(np.float16)
    v[rng.random(n) < 0.05] = 0
    assert np.isfinite(v).all()
    return v


def make_blocks(rng: np.random.Generator, qtype: T) -> np.ndarray:
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    n = BLOCKS[elems]
    blocks = rng.integers(0, 256, size=(n, nbytes), dtype=np.uint8)
    if qtype == T.Q8_K:
        d = (rng.standard_normal(n) * 0.01).astype(np.float32)
        blocks[:, 0:4] = d.view(np.uint8).reshape(n, 4)
    else:
        for off in F16_FIELDS[qtype]:
            blocks[:, off : off + 2] = random_f16(rng, n).view(np.uint8).reshape(n, 2)
    return blocks


def dequantize(blocks: np.ndarray, qtype: T) -> np.ndarray:
    if qtype == T.Q8_K:
        d = blocks[:, 0:4].copy().view(np.float32)
        q = blocks[:, 4:260].view(np.int8).astype(np.float32)
        return (d * q).astype(np.float32)
    return quants.dequantize(blocks, qtype).astype(np.float32)


def main() -> None:
    rng = np.random.default_rng(15)
    w = GGUFWriter(str(OUT), "quant-fixtures")
    for qtype in [*F16_FIELDS, T.Q8_K]:
        blocks = make_blocks(rng, qtype)
        values = dequantize(blocks, qtype).reshape(-1)
        assert np.isfinite(values).all(), qtype.name
        w.add_tensor(f"{qtype.name}.blocks", blocks.reshape(-1), raw_dtype=qtype)
        w.add_tensor(f"{qtype.name}.f32", values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
