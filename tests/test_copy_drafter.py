"""The aligned-copy drafter on token arrays: it follows a copied passage through replacements,
deletions and insertions, resyncs with the same source (not with a look-alike elsewhere),
and gives up an alignment the output has left."""
import random

import pytest

from edgespec.drafters.copy import ALIGNED_MIN, MAX_LOST, CopyDrafter

C = 7  # a token that occurs all over the source, like "(" or a newline
# a 60-token passage in which every fifth token is the common one
SOURCE = [C if i % 5 == 4 else 100 + i for i in range(60)]
PROMPT = [1, 2, 3] + SOURCE + [4, 5]


def follow(output, upto, limit=6):
    """The drafter's match after `upto` output tokens were committed one by one."""
    d = CopyDrafter()
    tokens = list(PROMPT)
    d.begin(tokens)
    for t in output[:upto]:
        d.match(tokens, limit)   # the auto drafter asks every round
        tokens.append(t)
    return d, d.match(tokens, limit)


def test_a_plain_copy_is_aligned_and_proposes_what_follows():
    out = SOURCE[:20]
    _, m = follow(out, 20)
    assert m.continuation == SOURCE[20:26]
    assert m.state == "aligned" and m.run >= ALIGNED_MIN and m.in_prompt


@pytest.mark.parametrize("edit, resume", [
    # replacement: SOURCE[20] -> two new tokens; the copy resumes at SOURCE[21]
    (SOURCE[:20] + [900, 901], 21),
    # deletion: SOURCE[20:27] dropped
    (SOURCE[:20], 27),
    # insertion: three new tokens before SOURCE[20]
    (SOURCE[:20] + [900, 901, 902], 20),
    # replacement whose new text ends with the common token (resync on a look-alike is possible)
    (SOURCE[:21] + [900, C], 25),
])
def test_resyncs_after_an_edit_with_the_same_source(edit, resume):
    out = edit + SOURCE[resume:]
    upto = len(edit) + 2  # two tokens of the resumed copy committed
    d, m = follow(out, upto)
    assert m.continuation == SOURCE[resume + 2:resume + 8]
    assert m.state == "aligned"   # the copy before the edit counts: not a fresh hit
    assert m.run <= 3             # ... but the resync itself is recent


def test_resync_prefers_the_anchor_over_the_most_recent_look_alike():
    # after a replacement the output resumes with C, whose most recent occurrence (in the
    # output itself, or late in the source) is not where the copy stopped
    out = SOURCE[:13] + [900] + SOURCE[14:]        # SOURCE[13] replaced; SOURCE[14] == C
    assert SOURCE[14] == C
    d, m = follow(out, 15)                          # 900 then C committed
    assert m.continuation[:4] == SOURCE[15:19]
    assert m.state == "aligned"


def test_a_resync_that_does_not_hold_falls_back_to_the_old_anchor():
    # new text [900, C, 901] meets the source at a C too early; the real resume is SOURCE[22]
    out = SOURCE[:20] + [900, C, 901] + SOURCE[22:]
    d, m = follow(out, 23 + 3)
    assert m.continuation[:4] == SOURCE[25:29]


def test_an_alignment_the_output_left_is_given_up():
    out = SOURCE[:20] + [800 + i for i in range(MAX_LOST + 5)]
    d, m = follow(out, len(out))
    assert d.src is None and m.continuation == []


def test_long_random_edits_keep_the_copy_mostly_aligned():
    rng = random.Random(3)
    source = [rng.randrange(40) for _ in range(400)]   # a small vocabulary: look-alikes everywhere
    prompt = source + [999]
    out, i = [], 0
    while i < len(source) - 5:
        r = rng.random()
        if r < 0.04:
            out += [1000 + rng.randrange(50) for _ in range(rng.randrange(1, 4))]  # insertion
        elif r < 0.07:
            i += rng.randrange(1, 4)                                                # deletion
        elif r < 0.10:
            out.append(1000 + rng.randrange(50))                                    # replacement
            i += 1
        else:
            out.append(source[i])
            i += 1
    d = CopyDrafter()
    tokens = list(prompt)
    d.begin(tokens)
    right = proposed = 0
    for t in out:
        m = d.match(tokens, 1)
        if m.continuation:
            proposed += 1
            right += m.continuation[0] == t
        tokens.append(t)
    # every copied token but the few after each edit is proposed, and proposed right
    copied = sum(1 for t in out if t < 1000)
    assert proposed >= 0.9 * copied
    assert right >= 0.85 * copied


EDIT_PROMPT = ("Rename the function `total` to `sum_prices` and return the whole code.\n\n```python\n"
               "def total(items):\n    s = 0\n    for item in items:\n        s += item.price\n    return s\n\n\n"
               "def report(items):\n    print('total:', total(items))\n    print('count:', len(items))\n```")


def test_auto_with_copies_equals_plain_greedy_up_to_a_near_tie_on_a_real_model(smol):
    """The aligned copies are verified like any draft: T = 0 output is plain greedy decoding's
    (up to llama.cpp's batch-rounding near-ties, see test_real_models.py)."""
    from test_real_models import assert_equal_up_to_a_near_tie, plain_greedy_with_logits

    from edgespec.backend import LlamaBackend
    from edgespec.drafters.auto import AutoDrafter
    from edgespec.engine import Engine
    from edgespec.costs import Costs
    from edgespec.policy import Policy
    # cheap rows, as on a GPU, and fixed: the policy drafts copies wherever it can
    drafter = AutoDrafter(Policy(Costs(tuple(0.01 + 0.0005 * k for k in range(1, 33)))), CopyDrafter())
    with Engine(LlamaBackend(smol, n_ctx=1024), drafter) as eng:
        ptoks = eng.chat_tokens([{"role": "user", "content": EDIT_PROMPT}])
        plain, rows = plain_greedy_with_logits(eng.target, ptoks, 64)
        eng.reset()
        r = eng.generate(ptoks, max_tokens=len(plain))
        eos = eng.target.eos
    copied = sum(v["accepted"] for k, v in r.stats.by_drafter.items() if k in ("copy", "ngram"))
    assert copied >= 10
    parted = assert_equal_up_to_a_near_tie(r.tokens, plain, rows, eos)
    assert parted is None or parted >= 8
