"""A GGUF with its weights as F16 or Q4_0, dequantized from a Q4_1 (or other) file with gguf-py:
the other weight types of docs/exactness.md's table (llama-quantize is not built here).

    python scripts/requant_smollm2.py SmolLM2-135M-Instruct.Q4_1.gguf smol-f16.gguf F16
    python scripts/requant_smollm2.py SmolLM2-135M-Instruct.Q4_1.gguf smol-q4_0.gguf Q4_0

The result answers (F16 keeps the Q4_1 file's values; Q4_0 loses more) and exercises llama.cpp's kernels
for those types: llamafile's sgemm for F16, the repacked Q4_0 gemm.
"""
from __future__ import annotations

import sys

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import quants

src, out, kind = sys.argv[1], sys.argv[2], sys.argv[3]
r = gguf.GGUFReader(src)
arch = r.fields["general.architecture"]
arch = bytes(arch.parts[arch.data[0]]).decode()
w = gguf.GGUFWriter(out, arch)
for f in r.fields.values():
    if f.name.startswith("GGUF.") or f.name == "general.architecture":
        continue
    t = f.types[0]
    if t == gguf.GGUFValueType.ARRAY:
        sub = f.types[-1]
        if sub == gguf.GGUFValueType.STRING:
            vals = [bytes(f.parts[i]).decode("utf-8", "replace") for i in f.data]
        else:
            vals = [f.parts[i].tolist()[0] for i in f.data]
        w.add_key_value(f.name, vals, t, sub_type=sub)
    elif t == gguf.GGUFValueType.STRING:
        w.add_key_value(f.name, bytes(f.parts[f.data[0]]).decode("utf-8", "replace"), t)
    else:
        v = f.parts[f.data[0]].tolist()[0]
        if f.name == "general.file_type":
            v = 1 if kind == "F16" else 2
        w.add_key_value(f.name, v, t)
target = Q.F16 if kind == "F16" else Q.Q4_0
for t in r.tensors:
    shape = [int(x) for x in reversed(t.shape.tolist())]  # numpy order
    if t.tensor_type in (Q.F32,):
        data = np.asarray(t.data)
        w.add_tensor(t.name, data.reshape(shape))
        continue
    deq = quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
    if len(shape) >= 2 and target == Q.Q4_0 and shape[-1] % 32 == 0:
        q = quants.quantize(deq, Q.Q4_0)
        w.add_tensor(t.name, q, raw_shape=q.shape, raw_dtype=Q.Q4_0)
    else:
        w.add_tensor(t.name, deq.astype(np.float16))
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
print("wrote", out)
