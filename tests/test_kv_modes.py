"""The memory modes on real llama.cpp (SmolLM2 with its 24-block cut as draft): quantized KV
caches (q8_0, q4_0) and weights without repacked copies. Speculation stays exact in each mode
(T = 0: the answer of plain decoding in the same mode, token for token, through rejections that
cut the quantized caches back), and a conversation saved from one KV type is never restored into
a context of another."""
import pytest

from edgespec.backend import LlamaBackend
from edgespec.drafters.model import ModelDrafter
from edgespec.drafters.ngram import NgramDrafter
from edgespec.engine import Engine
from edgespec.promptcache import DiskCache, PromptCache

STORY = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
MODES = [(True, "q8_0", "q8_0"), (False, "f16", "f16"), (False, "q4_0", "q4_0")]


def _backend(path, repack, tk, tv, **kw):
    return LlamaBackend(path, n_ctx=1024, flash_attn="on", repack=repack, type_k=tk, type_v=tv, **kw)


@pytest.mark.parametrize("repack, tk, tv", MODES, ids=lambda v: str(v))
def test_speculation_equals_plain_decoding_in_each_memory_mode(smol, smol_draft, repack, tk, tv):
    plain = Engine(_backend(smol, repack, tk, tv)).chat(STORY, max_tokens=32)
    target = _backend(smol, repack, tk, tv)
    spec = Engine(target, ModelDrafter(_backend(smol_draft, repack, tk, tv), target.n_vocab, 4)).chat(
        STORY, max_tokens=32)
    lookup = Engine(_backend(smol, repack, tk, tv), NgramDrafter(4)).chat(STORY, max_tokens=32)
    assert spec.tokens == plain.tokens and lookup.tokens == plain.tokens
    # drafts were rejected, so the quantized caches were cut back, and still nothing changed
    assert 0 < spec.stats.accepted < spec.stats.drafted


def test_the_modes_are_in_the_backend_settings_and_a_default_backend_keeps_its_old_key(smol):
    b = _backend(smol, False, "q8_0", "q4_0")
    assert b.settings["repack"] is False and b.settings["kv_types"] == "q8_0/q4_0"
    d = LlamaBackend(smol, n_ctx=1024)
    assert "repack" not in d.settings and "kv_types" not in d.settings  # calibrations cached before still match


def test_a_quantized_v_without_flash_attention_is_refused(smol):
    with pytest.raises(ValueError, match="needs flash attention"):
        LlamaBackend(smol, n_ctx=256, flash_attn="off", type_v="q8_0")
    with pytest.raises(ValueError, match="type_k must be one of"):
        LlamaBackend(smol, n_ctx=256, type_k="q5_1")


def test_a_slot_saved_from_one_kv_type_is_never_restored_into_another(smol, tmp_path):
    conv = [{"role": "system", "content": "You answer in one line. " * 40}, STORY[0]]  # a whole canonical piece

    def engine(tk, tv):
        target = _backend(smol, True, tk, tv)
        return Engine(target, None, PromptCache(0, DiskCache(tmp_path, DiskCache.identity_of(target))))
    with engine("q8_0", "q8_0") as eng:
        want = eng.chat(conv, max_tokens=8)
    assert list(tmp_path.glob("*.slot"))
    with engine("q8_0", "q8_0") as eng:  # the same type: restored, and the same answer
        again = eng.chat(conv, max_tokens=8)
    assert again.stats.restored_prompt_tokens > 0 and again.tokens == want.tokens
    with engine("f16", "f16") as eng:  # another KV type: its identity differs, nothing is restored
        other = eng.chat(conv, max_tokens=8)
    assert other.stats.restored_prompt_tokens == 0
