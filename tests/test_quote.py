"""Copies of a quoted value under a constraint stop where the quoted phrase ends."""
from __future__ import annotations

from edgespec.drafters import Round
from edgespec.drafters.auto import AutoDrafter
from edgespec.drafters.quote import value_end
from edgespec.costs import Costs
from edgespec.policy import Policy
from edgespec.sampling import SamplingParams

TEXTS = ["'s", "Dana", " Whit", "field", " <", "dana", ".wh", "itfield", "@", "north", ".com", ">", "\n",
         "2", ":", "30", " PM", " in", " floor", ".", " Hi", " -", ",", "(", " \"", "e.g", ". "]
ID = {t: i for i, t in enumerate(TEXTS)}


def toks(*texts):
    return [ID[t] for t in texts]


def piece(t):
    return TEXTS[t]


def test_a_quoted_value_ends_where_its_phrase_ends():
    assert value_end(toks("Dana", " Whit", "field", " <", "dana"), piece) == 3          # a bracket
    assert value_end(toks("dana", ".wh", "itfield", "@", "north", ".com", ">"), piece) == 6  # dots inside a word stay
    assert value_end(toks("north", ".com", "\n", "Dana"), piece) == 2                   # a line break
    assert value_end(toks("2", ":", "30", " PM", " in"), piece) == 5                    # a colon inside a time stays
    assert value_end(toks(" floor", ".", " Hi"), piece) == 1                             # a full stop before a space
    assert value_end(toks(" floor", "."), piece) == 1                                    # ... or at the end
    assert value_end(toks(" floor", ". ", "Dana"), piece) == 1                           # ... or with the space in it
    assert value_end(toks("e.g", " floor"), piece) == 2
    assert value_end(toks("north", ".com", "\n"), piece) == 2                          # a dot starting a word stays
    assert value_end(toks(" PM", " -", " Hi"), piece) == 1                               # a spaced dash
    assert value_end(toks(" PM", ",", " Hi"), piece) == 1
    assert value_end(toks(" PM", "(",), piece) == 1
    assert value_end(toks(" PM", " \""), piece) == 1                                     # a quote after a space
    assert value_end(toks(" <", "dana"), piece) == 0
    assert value_end(toks("Dana", "'s", " floor"), piece) == 3                           # an apostrophe stays
    assert value_end([], piece) == 0


class StubGuide:
    """What AutoDrafter reads of a constraint: everything legal, token texts from TEXTS."""

    def legal_prefix(self, tokens):
        return len(tokens)

    def piece(self, token):
        return TEXTS[token]


def test_auto_drafts_a_quote_up_to_its_end_and_scores_only_that_far():
    prompt = toks("Dana", " Whit", "field", " <", "dana", ".wh", "itfield", "@", "north", ".com", ">", "\n")
    cheap = Costs(verify=tuple(0.03 + 0.001 * k for k in range(32)))  # rows nearly free: any hit is drafted
    d = AutoDrafter(Policy(cheap))
    d.begin(prompt)
    out = prompt + toks("Dana")
    draft = d.propose(out, 16, SamplingParams(0.0), None, StubGuide())
    assert draft.tokens == toks(" Whit", "field")  # not " <" and what follows it
    # the answer closes the value where the phrase ended: a whole hit, not a miss past the end
    done = out + toks(" Whit", "field") + [ID["\n"]]
    d.observe(Round(done, draft, 2, 3, 0.05, 0.0))
    table = d.policy.quoted
    assert table.rounds == 1
    assert sum(b.trials for b in table.buckets) == 2 and sum(b.hits for b in table.buckets) == 2
    # the source said more: without a constraint nothing is cut
    fresh = AutoDrafter(Policy(cheap))
    fresh.begin(prompt)
    assert fresh.copy.match(out, 16).continuation[:3] == toks(" Whit", "field", " <")
