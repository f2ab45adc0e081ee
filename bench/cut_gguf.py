"""A GGUF cut to its first layers (metadata and tokenizer kept, ``<arch>.block_count`` set), so a model
file fits a GPU-machine call's carry limit: the SmolLM2 Q4_1 test (tests/kernels/test_cuda_quant.py,
``IGNIS_TEST_SMOL_GGUF``) runs there on the 4-layer cut, 38 MB instead of 98.

    .venv/bin/python bench/cut_gguf.py models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf OUT.gguf --layers 4
"""

from __future__ import annotations

import argparse
import re


def cut(src: str, dst: str, layers: int) -> None:
    import gguf

    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        val = layers if name == f"{arch}.block_count" else f.contents()
        w.add_key_value(name, val, f.types[0], f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        m = re.match(r"blk\.(\d+)\.", t.name)
        if m and int(m.group(1)) >= layers:
            continue
        shape = [int(v) for v in reversed(t.shape)]  # numpy order: GGUF stores dims innermost first
        w.add_tensor(t.name, t.data, raw_shape=shape if t.tensor_type.name.startswith("F") else None,
                     raw_dtype=t.tensor_type)  # fmt: skip
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--layers", type=int, default=4)
    a = ap.parse_args()
    cut(a.src, a.dst, a.layers)


if __name__ == "__main__":
    main()
