"""Write a copy of a GGUF model that keeps only its first N transformer blocks.

The copy shares the original's tokenizer exactly and predicts worse: a cheap, genuinely
different draft for statistical tests (SmolLM2-135M keeps ~0.3 acceptance at N = 24).

    python scripts/truncate_gguf.py IN.gguf OUT.gguf --blocks 24
"""
import argparse
import os
import re
import sys
from pathlib import Path

from gguf import GGUFReader, GGUFValueType, GGUFWriter


def truncate(src: Path, dst: Path, blocks: int) -> None:
    reader = GGUFReader(src, "r")
    arch = reader.fields["general.architecture"].contents()
    count_key = f"{arch}.block_count"
    total = reader.fields[count_key].contents()
    if not 0 < blocks < total:
        raise SystemExit(f"--blocks must be in 1..{total - 1} for {src.name}, got {blocks}")
    tmp = dst.with_name(dst.name + ".part")
    writer = GGUFWriter(tmp, arch)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        value = blocks if field.name == count_key else field.contents()
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    keep = [t for t in reader.tensors
            if not (m := re.match(r"blk\.(\d+)\.", t.name)) or int(m.group(1)) < blocks]
    for t in keep:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in keep:
        writer.write_tensor_data(t.data)
    writer.close()
    os.replace(tmp, dst)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--blocks", type=int, required=True)
    args = ap.parse_args()
    if args.dst.exists():
        print(f"{args.dst} exists")
        return 0
    truncate(args.src, args.dst, args.blocks)
    print(f"wrote {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
