"""GGUF metadata read with the `gguf` package, before any weights are loaded: file checks,
tokenizer facts for the pair check, sizes for memory planning."""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from .errors import IncompatiblePairError, ModelFileError

GGUF_MAGIC = b"GGUF"
VOCAB_SIZE_SLACK = 128  # as llama.cpp's own check: padded vocabularies differ by a little


@dataclass(frozen=True)
class GGUFInfo:
    path: Path
    architecture: str
    tokenizer_model: str
    tokens: tuple[str, ...] = field(repr=False)
    bos: int | None
    eos: int | None
    file_size: int
    fields: dict = field(repr=False, compare=False, default_factory=dict)

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)


def read_info(path: str | os.PathLike) -> GGUFInfo:
    """Validate `path` as a complete GGUF file and read what edgespec needs from its header."""
    path = Path(path)
    st = _stat(path)
    return _read_info_cached(str(path.resolve()), st.st_size, st.st_mtime_ns)


def _stat(path: Path) -> os.stat_result:
    if not path.exists():
        raise ModelFileError(f"model file {path} does not exist: check the path, or pull a pair by name")
    if path.is_dir():
        raise ModelFileError(f"{path} is a directory, not a GGUF model file")
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise ModelFileError(f"cannot read model file {path}: {exc.strerror}") from None
    st = path.stat()
    if st.st_size == 0:
        raise ModelFileError(f"model file {path} is empty: download it again")
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"{path} is not a GGUF model file (it does not start with 'GGUF'): "
                             "convert it with llama.cpp's convert_hf_to_gguf.py or pick a .gguf file")
    return st


class _Short(Exception):
    """The header continues past the bytes read so far."""


class _Header:
    """A fast GGUF header parser. gguf.GGUFReader builds a numpy view per array item and takes
    7 s on a 152k-token vocabulary; this reads the same header in a fraction of that. Type
    codes and tensor block sizes still come from the gguf package."""

    _SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                10: "<Q", 11: "<q", 12: "<d"}

    def __init__(self, data: bytes):
        self.buf = data
        self.off = 0

    def _unpack(self, fmt: str):
        v = struct.unpack_from(fmt, self.buf, self.off)[0]
        self.off += struct.calcsize(fmt)
        return v

    def _string(self, keep: bool = True):
        n = self._unpack("<Q")
        if self.off + n > len(self.buf):
            raise _Short("string runs past the end of what was read")
        s = self.buf[self.off:self.off + n].decode("utf-8", "replace") if keep else None
        self.off += n
        return s

    def _value(self, vtype: int, keep: bool = True):
        if vtype == 8:
            return self._string(keep)
        if vtype == 9:
            itype, count = self._unpack("<I"), self._unpack("<Q")
            if itype == 8:
                vals = [self._string(keep) for _ in range(count)]
                return vals if keep else None
            fmt = self._SCALARS[itype]
            size = struct.calcsize(fmt)
            if self.off + size * count > len(self.buf):
                raise _Short("array runs past the end of what was read")
            vals = list(struct.iter_unpack(fmt, self.buf[self.off:self.off + size * count])) if keep else None
            self.off += size * count
            return [v[0] for v in vals] if keep else None
        return self._unpack(self._SCALARS[vtype])

    def parse(self, wanted_arrays: tuple[str, ...]):
        if self.buf[:4] != GGUF_MAGIC:
            raise ValueError("bad magic")
        self.off = 4
        version, n_tensors, n_kv = self._unpack("<I"), self._unpack("<Q"), self._unpack("<Q")
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version}")
        fields = {}
        for _ in range(n_kv):
            key = self._string()
            vtype = self._unpack("<I")
            is_array = vtype == 9
            keep = not is_array or key in wanted_arrays or not key.startswith("tokenizer.")
            if is_array and not keep:  # record only how long it is (merges count for memory.py)
                fields[key + ".count"] = struct.unpack_from("<Q", self.buf, self.off + 4)[0]
            fields[key] = self._value(vtype, keep)
        tensors = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._unpack("<Q") for _ in range(self._unpack("<I"))]
            ttype, offset = self._unpack("<I"), self._unpack("<Q")
            tensors.append((name, dims, ttype, offset))
        align = int(fields.get("general.alignment", 32))
        data_start = (self.off + align - 1) // align * align
        return fields, tensors, data_start


def _tensor_bytes(dims, ttype) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
    n = 1
    for d in dims:
        n *= d
    return n // block * size


@lru_cache(maxsize=16)
def _read_info_cached(path: str, size: int, mtime_ns: int) -> GGUFInfo:
    window = min(size, 16 << 20)  # GGUF headers are a few MB; read more only if needed
    while True:
        try:
            with open(path, "rb") as fh:
                head = fh.read(window)
            fields, tensors, data_start = _Header(head).parse(("tokenizer.ggml.tokens",))
            break
        except (struct.error, _Short) as exc:
            if window >= size:
                raise ModelFileError(f"{path} is not a readable GGUF file ({exc}); it may be truncated "
                                     "or damaged: download it again") from None
            window = min(size, window * 4)
        except (ValueError, KeyError, OverflowError) as exc:
            raise ModelFileError(f"{path} is not a readable GGUF file ({exc}); it may be truncated or "
                                 "damaged: download it again") from None
    try:
        end = max((data_start + off + _tensor_bytes(dims, tt) for _, dims, tt, off in tensors), default=0)
        tensor_bytes = sum(_tensor_bytes(dims, tt) for _, dims, tt, _ in tensors)
    except (ValueError, KeyError) as exc:
        raise ModelFileError(f"{path} has a tensor of unknown type ({exc}): update edgespec or "
                             "llama-cpp-python, or pick another quantization") from None
    if end > size:
        raise ModelFileError(f"{path} is truncated: its tensors need {end} bytes but the file has "
                             f"{size}; download it again")
    tokens = tuple(fields.pop("tokenizer.ggml.tokens", None) or ())
    fields["_tensor_bytes"] = tensor_bytes
    fields["_tensors"] = {name: (tuple(dims), tt) for name, dims, tt, _ in tensors}
    return GGUFInfo(path=Path(path), architecture=str(fields.get("general.architecture", "?")),
                    tokenizer_model=str(fields.get("tokenizer.ggml.model", "?")), tokens=tokens,
                    bos=fields.get("tokenizer.ggml.bos_token_id"), eos=fields.get("tokenizer.ggml.eos_token_id"),
                    file_size=size, fields=fields)


def check_pair(target: str | os.PathLike, draft: str | os.PathLike) -> None:
    """Raise IncompatiblePairError unless the draft's tokens mean the same as the target's."""
    t, d = read_info(target), read_info(draft)
    names = f"target {t.path.name} and draft {d.path.name}"
    if t.tokenizer_model != d.tokenizer_model:
        raise IncompatiblePairError(f"{names} use different tokenizers ({t.tokenizer_model!r} vs "
                                    f"{d.tokenizer_model!r}): pick a draft from the target's family")
    if abs(t.n_vocab - d.n_vocab) > VOCAB_SIZE_SLACK:
        raise IncompatiblePairError(f"{names} have vocabularies of {t.n_vocab} and {d.n_vocab} tokens "
                                    f"(more than {VOCAB_SIZE_SLACK} apart): pick a draft from the target's family")
    for what, a, b in (("BOS", t.bos, d.bos), ("EOS", t.eos, d.eos)):
        if a != b:
            raise IncompatiblePairError(f"{names} have different {what} token ids ({a} vs {b})")
    for i, (a, b) in enumerate(zip(t.tokens, d.tokens)):
        if a != b:
            raise IncompatiblePairError(f"{names} disagree on token {i}: {a!r} vs {b!r}; "
                                        "pick a draft with the target's tokenizer")


def trained_context(info) -> "int | None":
    """The context length the model was trained for (GGUF `{arch}.context_length`), if stated."""
    n = info.fields.get(f"{info.architecture}.context_length")
    return int(n) if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None
