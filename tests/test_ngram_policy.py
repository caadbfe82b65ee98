"""N-gram drafter, policy and calibration cache, on small arrays and fake costs."""
import random

import numpy as np
import pytest

from edgespec.drafters.ngram import RUN_MAX, NgramDrafter, NgramIndex, run_length
from edgespec.engine import Engine
from edgespec.acceptance import Acceptance, CopyAcceptance, expected_tokens
from edgespec.costs import Costs
from edgespec.policy import MIN_OBSERVATIONS, Offer, Policy, best_gamma, best_length

from fakes import FakeBackend


def brute_force(tokens, limit, n_min=1, n_max=8):
    for n in range(min(n_max, len(tokens)), n_min - 1, -1):
        suffix = tokens[-n:]
        for i in range(len(tokens) - 2, n - 2, -1):  # most recent earlier end position
            if tokens[i - n + 1:i + 1] == suffix:
                return n, tokens[i + 1:i + 1 + limit]
    return 0, []


def test_lookup_continues_the_longest_most_recent_match():
    idx = NgramIndex()
    toks = [5, 6, 7, 8, 9, 1, 6, 7, 3, 5, 6, 7]
    # suffix 5 6 7 occurs at 0..2 (continues 8 9); 6 7 alone occurs later at 6..7 (continues 3)
    assert idx.find(toks) == (3, 2) and idx.continuation(toks, 3) == [8, 9, 1]
    assert NgramIndex().continuation([1, 2, 3], 4) == []  # nothing repeats
    assert NgramIndex().continuation([4, 4], 5) == [4]    # continuation stops at the context end


def test_incremental_index_agrees_with_brute_force_search():
    rng = random.Random(0)
    idx = NgramIndex()
    toks = []
    for step in range(600):
        toks.extend(rng.choice([[rng.randrange(5)], [rng.randrange(30)] * 2, toks[-6:] or [1]]))
        if step % 3 == 0:
            n, cont = brute_force(toks, 7)
            assert idx.find(toks)[0] == n and idx.continuation(toks, 7) == cont, step


def test_index_work_per_new_token_is_bounded():
    idx = NgramIndex(n_max=8)
    toks = list(range(8000))
    idx.continuation(toks, 4)

    class CountingDict(dict):
        sets = 0

        def __setitem__(self, k, v):
            CountingDict.sets += 1
            super().__setitem__(k, v)
    idx.last_end = CountingDict(idx.last_end)
    toks.append(3)
    idx.continuation(toks, 4)
    assert CountingDict.sets == 8  # one entry per n-gram length, not a rescan of 8,000 tokens


def test_outcome_scores_the_last_proposal_against_committed_tokens():
    d = NgramDrafter()
    toks = [1, 2, 3, 4, 1, 2]
    d.begin(toks)
    assert d.match(toks, 3) == (2, [3, 4, 1])
    assert d.outcome(toks + [3, 4, 9]) == (2, 2, 3)
    assert d.outcome(toks) is None  # consumed


def test_run_length_extends_the_match_backwards_past_the_index_and_is_capped():
    passage = list(range(100, 120))
    toks = [1] + passage + [7, 8] + passage[:15]
    d = NgramDrafter()
    d.begin(toks)
    run, cont = d.match(toks, 4)
    assert run == 15 and cont == passage[15:19]  # the index matched 8; the copy is 15 long
    toks = list(range(200)) + [5] + list(range(200))
    assert run_length(toks, 199, 8) == RUN_MAX
    assert run_length([3, 1, 2, 9, 1, 2], 2, 2) == 2  # 3 != 9: stops


def test_copy_acceptance_counts_each_drafted_token_at_its_own_run_length():
    c = CopyAcceptance()
    c.update(run=3, matched=2, compared=10)  # tokens at runs 3, 4 hit; run 5 missed; the rest never at stake
    seen = [b.seen for b in c.buckets]
    assert seen[c.bucket(3)] == 1 and seen[c.bucket(4)] == 2 and sum(seen) == 3
    b4 = c.buckets[c.bucket(4)]
    assert b4.hits == pytest.approx(b4.decay)  # run 4 hit, then run 5 (same bucket) missed
    assert c.bucket(1) == 0 and c.bucket(64) == len(c.buckets) - 1


def test_survival_grows_with_the_run_and_longer_runs_inherit_evidence():
    c = CopyAcceptance()
    for _ in range(20):
        c.update(run=8, matched=4, compared=4)  # runs 8..11: always copied
    s_long, s_short = c.survival(8, 8), c.survival(1, 8)
    assert all(a > b for a, b in zip(s_long, s_short))
    assert all(x >= y for x, y in zip(s_long, s_long[1:]))  # a probability of "all of the first j"
    rate = c.buckets[c.bucket(8)].lower(0.0)
    assert c.survival(40, 1)[0] >= rate  # a 40-token run is at least as reliable as an 8-token one


def test_policy_drafts_long_copies_and_not_single_token_matches_on_this_cpus_curve():
    # this project's CPU: 16 rows cost 7x one step
    verify = [0.033, 0.058, 0.076, 0.092, 0.114, 0.138, 0.155, 0.21, 0.227, 0.247, 0.258, 0.267,
              0.28, 0.293, 0.309, 0.25] + [0.25 + 0.015 * k for k in range(1, 17)]
    p = Policy(Costs(tuple(verify)))
    for _ in range(30):
        p.ngram.update(1, 0, 1)      # one-token matches: rarely continued
        p.ngram.update(20, 12, 12)   # long copies: continued
    assert p.choose((1, 32), has_model=False, room=32).drafter == "none"
    c = p.choose((24, 32), has_model=False, room=32)
    assert c.drafter == "ngram" and c.gamma >= 15
    assert best_length(Costs(tuple(verify)), [1.0] * 31)[0] in (15, 31)  # certain copies: a cheap long pass


def test_copies_of_the_answers_own_text_are_judged_apart_from_copies_of_the_prompt():
    # rows cost half a step each: a short draft pays only when the copy is likely to hold
    costs = Costs(tuple(0.05 * (1 + 0.5 * (k - 1)) for k in range(1, 33)))
    p = Policy(costs)
    prompt_copy, own_copy = Offer(3, 16, "aligned", (), True), Offer(3, 16, "aligned", (), False)
    assert p.choose(prompt_copy, room=32).drafter == "copy"  # an edit resuming its passage
    assert p.choose(own_copy, room=32).drafter == "none"     # a repeated structure: often breaks
    # what the answer's own text shows does not move the trust in the prompt's passage
    for _ in range(10):
        for run in range(1, 12):
            p.copy_outcome("aligned", run, 0, 4, in_prompt=False)
    assert p.choose(Offer(8, 16, "aligned", (), False), room=32).drafter == "none"
    assert p.choose(Offer(8, 16, "aligned", (), True), room=32).gamma >= 2


def test_expected_tokens_formula():
    assert expected_tokens(0.0, 5) == 1
    assert expected_tokens(1.0, 5) == 6
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_policy_drafts_nothing_when_verifying_costs_as_much_as_decoding():
    # verifying k rows costs k plain steps: no acceptance rate can pay for it
    costs = Costs(verify=tuple(0.035 * k for k in range(1, 33)), draft_step=0.02)
    assert best_gamma(costs, 0.99, 0.0, 32)[0] == 0
    p = Policy(costs, model=Acceptance(prior=0.95, weight=1000))
    for _ in range(10):
        p.ngram.update(40, 30, 30)
    assert p.choose((4, 30), has_model=True, room=32).drafter == "none"


def test_policy_drafts_long_when_verifying_is_cheap():
    # a GPU-like curve: k rows cost about one step
    costs = Costs(verify=tuple(0.035 + 0.001 * k for k in range(1, 33)), draft_step=0.002)
    p = Policy(costs)
    for _ in range(MIN_OBSERVATIONS):
        p.ngram.update(6, 30, 30)
    c = p.choose((6, 32), has_model=False, room=32)
    assert c.drafter == "ngram" and c.gamma >= 16
    p2 = Policy(costs, model=Acceptance(prior=0.8, weight=1000))
    c2 = p2.choose(None, has_model=True, room=32)
    assert c2.drafter == "model" and c2.gamma >= 4


def test_policy_uses_a_cheaper_longer_pass_on_a_non_monotonic_curve():
    # 16 rows cost less than 12, as on this project's CPU
    verify = [0.035 + 0.025 * k for k in range(1, 33)]
    verify[15] = verify[10]
    g, _ = best_gamma(Costs(tuple(verify)), 0.98, 0.0, 32)
    assert g == 15  # 15 drafts + 1 bonus row = the cheap 16-row pass


def test_no_speculation_before_any_evidence():
    costs = Costs(verify=tuple(0.035 + 0.001 * k for k in range(1, 33)))
    p = Policy(costs)
    assert p.choose((3, 10), has_model=False, room=32).drafter == "none"


def test_ngram_and_auto_at_t0_equal_plain_exactly_on_the_fake():
    from edgespec.drafters.auto import AutoDrafter
    rng = np.random.default_rng(0)
    table = rng.normal(0, 2, (6, 6)).astype(np.float32)
    prompt = [0, 1, 2, 3, 4, 5, 0, 1, 2]
    plain = Engine(FakeBackend(table)).generate(prompt, max_tokens=100).tokens
    r = Engine(FakeBackend(table), NgramDrafter(gamma=6)).generate(prompt, max_tokens=100)
    assert r.tokens == plain and r.stats.accepted > 10
    costs = Costs(verify=tuple(0.035 + 0.001 * k for k in range(1, 33)))
    r = Engine(FakeBackend(table), AutoDrafter(Policy(costs))).generate(prompt, max_tokens=100)
    assert r.tokens == plain
    assert sum(v["accepted"] for k, v in r.stats.by_drafter.items() if k != "none") > 10


def test_copy_ceiling_is_the_hindsight_best_schedule():
    from edgespec.bench import copy_ceiling
    prompt = list(range(1, 31)) + [1, 2, 3]
    out = list(range(4, 21))  # a 17-token copy of the prompt
    free_rows = Costs(verify=(0.03,) * 32)
    assert copy_ceiling(free_rows, prompt, out) == pytest.approx(17.0)  # one pass does it all
    linear = Costs(verify=tuple(0.03 * k for k in range(1, 33)))
    assert copy_ceiling(linear, prompt, out) == pytest.approx(1.0)      # drafting never pays
    novel = [99, 98, 97, 96]
    assert copy_ceiling(free_rows, prompt, novel) == pytest.approx(1.0)  # nothing to copy


def test_a_value_quoted_from_the_prompt_is_drafted_under_a_constraint_at_once():
    # a fresh prompt hit of two tokens, before any copy was scored: the unconstrained prior is
    # too low to draft it; inside a JSON string (cut at its first forbidden token) it is drafted
    verify = (0.03, 0.04, 0.05, 0.06, 0.07, 0.08, 0.09, 0.10)
    p = Policy(Costs(verify))
    assert p.choose(Offer(2, 6, "fresh"), room=32).drafter == "none"
    c = p.choose(Offer(2, 6, "fresh", (), True, True), room=32)
    assert c.drafter == "ngram" and c.gamma >= 2
    # copies of the answer's own text are no quote: still not drafted
    assert p.choose(Offer(2, 6, "fresh", (), False, True), room=32).drafter == "none"
    # what such a hit teaches goes to its own table
    p.copy_outcome("fresh", 2, 0, 3, True, constrained=True)
    assert p.quoted.rounds == 1 and p.ngram.rounds == 0
