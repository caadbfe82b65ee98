"""Engine behaviour on the fake backend: streaming text, stop strings, EOS, limits."""
import numpy as np
import pytest

from edgespec.drafters.model import ModelDrafter
from edgespec.engine import Engine
from edgespec.errors import UsageError

from fakes import FakeBackend

V = 6
# greedy chain 0 -> 1 -> 2 -> 3 -> 4 -> 5 -> 0 ...
CHAIN = np.full((V, V), -5.0, np.float32)
for i in range(V):
    CHAIN[i, (i + 1) % V] = 5.0
# pieces that split multi-byte characters across tokens: "hé 😀! ok." and so on
PIECES = {0: b".", 1: b"h\xc3", 2: b"\xa9 \xf0\x9f", 3: b"\x98", 4: b"\x80!", 5: b" ok"}


class PieceBackend(FakeBackend):
    def token_to_piece(self, token, special=False):
        return PIECES[token]


def engine(gamma=3, draft=True, **kw):
    target = PieceBackend(CHAIN, **kw)
    drafter = ModelDrafter(PieceBackend(CHAIN + np.float32(0.3), name="draft"), V) if draft else None
    return Engine(target, drafter, gamma=gamma)


def test_stream_splits_no_character_and_joins_to_the_full_text():
    events = list(engine().stream("0", max_tokens=12))
    texts = [e.text for e in events]
    assert all("\ufffd" not in t for t in texts)
    full = b"".join(PIECES[e.token] for e in events).decode()
    assert "".join(texts) == full == "hé 😀! ok.hé 😀! ok."
    assert [e.token for e in events] == [1, 2, 3, 4, 5, 0] * 2
    assert any(e.from_draft for e in events)


@pytest.mark.parametrize("stop, expect", [("😀!", "hé "), ("ok.h", "hé 😀! "), ("é 😀", "h")])
def test_stop_string_across_tokens_ends_generation_before_it(stop, expect):
    eng = engine()
    result = eng.generate("0", max_tokens=50, stop=[stop])
    assert result.text == expect
    assert eng.last_stats.finish_reason == "stop"


def test_eos_stops_and_is_not_emitted():
    eng = engine(eos=4)
    result = eng.generate("0", max_tokens=50)
    assert result.tokens == [1, 2, 3]
    assert eng.last_stats.finish_reason == "eos"


@pytest.mark.parametrize("gamma", [1, 4, 8])
def test_max_tokens_is_exact_with_any_draft_length(gamma):
    eng = engine(gamma=gamma)
    for n in (1, 2, 5, 7):
        assert len(eng.generate("0", max_tokens=n).tokens) == n
        assert eng.last_stats.finish_reason == "length"


def test_generation_stops_when_the_context_is_full():
    eng = engine(n_ctx=10)
    result = eng.generate("0 1", max_tokens=100)
    assert len(result.tokens) == 10 - 3
    assert eng.last_stats.finish_reason == "context"


def test_prompt_longer_than_context_is_a_usage_error():
    with pytest.raises(UsageError, match="context holds 8"):
        engine(n_ctx=8).generate(" ".join(["1"] * 20))


def test_model_that_cannot_cut_its_cache_refuses_speculation_but_decodes_plainly():
    target = PieceBackend(CHAIN)
    target.can_truncate = False
    with pytest.raises(UsageError, match="--drafter none"):
        Engine(target, ModelDrafter(PieceBackend(CHAIN, name="draft"), V))
    assert Engine(target, None).generate("0", max_tokens=3).tokens == [1, 2, 3]


def test_bad_max_tokens():
    with pytest.raises(UsageError, match="max_tokens must be"):
        engine().generate("0", max_tokens=0)
