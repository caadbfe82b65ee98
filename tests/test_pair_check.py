"""The pair check reads GGUF metadata only; tiny metadata-only GGUF files exercise each rule."""
import pytest
from gguf import GGUFWriter

from edgespec.errors import IncompatiblePairError
from edgespec.ggufinfo import check_pair, read_info

BASE = [f"tok{i}" for i in range(300)]


def write(path, tokens=BASE, model="gpt2", bos=1, eos=2):
    w = GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    w.add_token_list(tokens)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return path


def test_same_tokenizer_passes_and_a_slightly_padded_vocabulary_too(tmp_path):
    t = write(tmp_path / "t.gguf")
    check_pair(t, write(tmp_path / "d.gguf"))
    check_pair(t, write(tmp_path / "padded.gguf", BASE + [f"pad{i}" for i in range(100)]))
    info = read_info(t)
    assert (info.n_vocab, info.bos, info.eos, info.tokenizer_model) == (300, 1, 2, "gpt2")


@pytest.mark.parametrize("draft_kw, fragment", [
    (dict(model="llama"), "different tokenizers"),
    (dict(tokens=BASE + [f"x{i}" for i in range(200)]), "more than 128 apart"),
    (dict(bos=7), "different BOS"),
    (dict(eos=9), "different EOS"),
    (dict(tokens=BASE[:5] + ["other"] + BASE[6:]), "disagree on token 5: 'tok5' vs 'other'"),
])
def test_mismatches_name_both_files_and_what_differs(tmp_path, draft_kw, fragment):
    t = write(tmp_path / "target.gguf")
    d = write(tmp_path / "draft.gguf", **draft_kw)
    with pytest.raises(IncompatiblePairError) as e:
        check_pair(t, d)
    msg = str(e.value)
    assert "target.gguf" in msg and "draft.gguf" in msg and fragment in msg
