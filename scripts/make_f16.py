"""Write an F16 copy of a quantized GGUF: every tensor dequantized (gguf.quants.dequantize) and
written back with GGUFWriter, 2-D weights as F16, vectors (norms, biases) as F32. With --type Q4_0,
the 2-D weights whose rows are whole blocks of 32 quantized again to Q4_0 (the others F16): another
weight type for docs/exactness.md's table (llama-quantize is not built here).

Why: on this project's 2-core CPUs a Q4_K_M 1.5B target is compute-bound, so a k-row verifying
pass costs about k steps and a draft model never pays. An F16 copy of the same target is bound by
memory bandwidth (a step reads 3 GB): a k-row pass then costs about one step, as on a GPU or a
Jetson, and the draft model's regime can be measured here (issue 39, docs/benchmarks.md).
Never run by the test suite: it writes ~3.6 GB for the 1.5B and takes a few minutes.

    python scripts/make_f16.py qwen2.5-coder-1.5b            # the pair's target, from the model cache
    python scripts/make_f16.py path/to/model.gguf -o out.gguf
    python scripts/make_f16.py SmolLM2-135M-Instruct.Q4_1.gguf --type Q4_0 -o smol-q4_0.gguf
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import dequantize, quantize

FILE_TYPES = {"F16": LlamaFileType.MOSTLY_F16, "Q4_0": LlamaFileType.MOSTLY_Q4_0}


def _source(name: str) -> Path:
    path = Path(name)
    if path.suffix == ".gguf":
        return path
    from edgespec.hub import local_path  # a pair name: its target, as `make test-models` fetched it
    from edgespec.registry import load_registry
    spec = load_registry().get(name).target
    found = local_path(spec)
    if found is None:
        raise FileNotFoundError(f"{spec.file} is not downloaded: run `python scripts/fetch_models.py {name}`")
    return found


def convert(src: Path, dst: Path, progress=None, kind: str = "F16") -> None:
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    tmp = dst.with_name(dst.name + ".part")
    writer = GGUFWriter(tmp, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # written by GGUFWriter itself
        if name == "general.file_type":
            writer.add_uint32(name, int(FILE_TYPES[kind]))
            continue
        vtype = GGUFValueType(field.types[0])
        sub = GGUFValueType(field.types[-1]) if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    for i, t in enumerate(reader.tensors, 1):
        data = dequantize(t.data, t.tensor_type)
        if t.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) or data.dtype != np.float32:
            data = np.asarray(data, dtype=np.float32)
        weights = len(t.shape) >= 2 and int(np.prod(t.shape[1:])) > 1
        if weights and kind == "Q4_0" and data.shape[-1] % 32 == 0:
            q = quantize(data, GGMLQuantizationType.Q4_0)
            writer.add_tensor(t.name, q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType.Q4_0)
        else:
            writer.add_tensor(t.name, data.astype(np.float16) if weights else data)
        if progress:
            progress(i, len(reader.tensors))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dst)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", help="a GGUF path or a models.toml pair name (its target)")
    ap.add_argument("-o", "--out", help="the GGUF to write (default: beside the source, -f16.gguf or -q4_0.gguf)")
    ap.add_argument("--type", choices=sorted(FILE_TYPES), default="F16",
                    help="F16 (default) or Q4_0 (the weights quantized again; the rest F16)")
    args = ap.parse_args(argv)
    try:
        src = _source(args.source)
    except Exception as exc:  # noqa: BLE001 - one line for a script's user
        print(f"make_f16: {exc}", file=sys.stderr)
        return 2
    if not src.is_file():
        print(f"make_f16: {src} is not a file", file=sys.stderr)
        return 2
    dst = Path(args.out) if args.out else src.with_name(f"{src.stem}-{args.type.lower()}.gguf")
    if dst.exists():
        print(dst)
        return 0

    def progress(i, n):
        print(f"\r{i}/{n} tensors", end="", file=sys.stderr, flush=True)
    convert(src, dst, progress, args.type)
    print(file=sys.stderr)
    print(dst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
