"""Which drafter and how many drafts, per round, from the device's costs and online acceptance.

Expected tokens per second of a round with gamma drafts, each accepted with probability
alpha until the first miss (Leviathan et al. 2023, eq. 1):

    E[tokens] = (1 - alpha^(gamma+1)) / (1 - alpha)
    time      = gamma * T_draft + T_verify(gamma + 1)

T_verify(k) is the cost of a target pass that returns logits for k rows; it is not monotonic
on every device, which the search over gamma uses as it is. The costs are costs.py's (the
calibration, followed by the passes the engine runs), the acceptance acceptance.py's; this
module decides.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

from .acceptance import ALIGNED_PRIOR, ALIGNED_SHIFT, GENERATED_PRIOR, QUOTED_PRIOR, Acceptance, CopyAcceptance
from .costs import Costs, OnlineCosts, Part, Share, rows_cheap

MIN_OBSERVATIONS = 4  # copy proposals scored before a fresh lookup hit is drafted
CAUTION = 0.25        # acceptance is taken a quarter standard deviation below its estimate
MARGIN = 0.0          # steps a draft must be expected to save before it is made
# A pass several sequences share grows by drafts to at most this many times its plain cost: each
# of them waits for it, so a short request beside a long answer that copies (a 95%-accepted edit
# drafting 16 rows a pass on a CPU) gets its tokens at most this much slower than plain batching.
SHARED_STRETCH = 2.0
# On some builds a pass of more than a few rows computes every row otherwise than a single-row
# decode (repacked Q4_K weights on x86 CPUs: up to 3 rows bit for bit, 4 and more 0.4-0.6 apart
# in their logits, as 4-row kernels take over; an F16 target, and GPUs, from 2 rows on): a greedy
# answer then parts from plain decoding's at near-ties. With `Policy.bit_exact` (`--bit-exact`) a
# single sequence's passes never go beyond the limit the calibration found (`Policy.exact_rows`);
# by default they go where the saving is, and the answer is the target's distribution exactly (at
# T = 0: the target's batched logits, as llama.cpp and vLLM verify).



def drafts_likely(policy: Optional["Policy"]) -> bool:
    """Whether a constrained round drafts the usual tokenization of forced bytes after the forced
    tokens (`Guide.likely`): where rows are cheap; a fixed drafter (no policy) always does. Replayed
    on the structured workloads with this CPU's pass costs it loses (1.180x against 1.187x)."""
    return policy is None or rows_cheap(policy.costs)



class Offer(NamedTuple):
    """A copy drafter's proposal as the policy judges it."""

    run: int
    available: int
    state: str = "fresh"   # "fresh" (a lookup hit) or "aligned" (an established copy)
    risk: tuple[float, ...] = ()  # per token: the chance an edit begins there (from earlier edits)
    in_prompt: bool = True  # the source lies in the prompt (not in text this answer generated)
    constrained: bool = False  # under an output constraint, already cut at its first forbidden token


@dataclass(frozen=True)
class Choice:
    drafter: str       # "none", "ngram" (a lookup hit), "copy" (an aligned copy) or "model"
    gamma: int
    tokens_per_second: float
    explore: bool = False


def best_length(costs: Costs, survival: list[float], draft_step: float = 0.0) -> tuple[int, float]:
    """The draft length (0 allowed) with the highest expected tokens per second, where
    survival[j - 1] is the probability that the first j drafts are all accepted."""
    best = (0, 1.0 / costs.verify_cost(1))
    tokens = 1.0  # the target's own token comes with every pass
    for g, s in enumerate(survival[:costs.max_rows - 1], 1):
        tokens += s
        tps = tokens / (g * draft_step + costs.verify_cost(g + 1))
        if tps > best[1]:
            best = (g, tps)
    return best


def best_saving(costs: Costs, survival: list[float], draft_step: float = 0.0, fixed: float = 0.0,
                base: tuple[int, int] = (1, 1), token_cost: Optional[float] = None,
                max_pass: float = math.inf, pass_of: Optional[Callable[[int], float]] = None) -> tuple[int, float]:
    """(draft length >= 1, expected seconds saved) for the length that saves the most time
    against decoding the same expected tokens one pass each; survival[j - 1] is the chance
    that the first j drafts are all accepted; `fixed` is spent whatever the length (the draft
    model catching up). (0, -inf) when nothing is offered.

    `base` is the pass the round makes anyway, as (tokens fed, rows computed): (1, 1) the
    target's own token; under a constraint the forced tokens ride in it too, fed without rows
    of their own, and a draft costs only what it adds to that pass (the cost curve is not
    linear: rows added to a longer pass are cheaper).

    Savings, not tokens per second: at a copy accepted 95% per token, 2 rows and 16 rows may
    yield the same tokens per second, but the 16-row pass saves eight times as much.

    `token_cost`: what a token costs without drafts (default a one-row pass; when several
    sequences share the pass, their plain pass over their number: on a CPU a row costs nearly
    a step, so rows added to a shared pass pay only for drafts likelier to be accepted).

    `pass_of(g)`: what the whole pass costs with g drafts (default: `base` grown by g tokens and
    rows; a shared pass prices its micro-batches, `Costs.split_cost`)."""
    t1 = costs.verify_cost(1) if token_cost is None else token_cost
    fed, rows = base
    if pass_of is None:
        def pass_of(g: int) -> float:
            return costs.pass_cost(fed + g, rows + g)
    anyway = pass_of(0)
    best = (0, -math.inf)
    tokens = 0.0  # beyond the target's own token, which comes with the pass made anyway
    for g, s in enumerate(survival[:costs.max_rows - rows], 1):
        tokens += s
        whole = pass_of(g)
        if whole > max_pass * (1 + 1e-9):  # not monotonic in g where micro-batches merge: skipped, not the end
            continue
        saved = tokens * t1 - fixed - g * draft_step - (whole - anyway)
        if saved > best[1]:
            best = (g, saved)
    return best


def best_gamma(costs: Costs, alpha: float, draft_step: float, max_gamma: int) -> tuple[int, float]:
    """best_length for a constant per-token acceptance alpha."""
    return best_length(costs, [alpha ** j for j in range(1, max_gamma + 1)], draft_step)


EXPLORE_LOSS = 0.25  # steps a re-test of drafting is believed to lose, at most, per patience period
# The acceptance a good same-family draft model reaches on work it suits (Qwen2.5-Coder 0.5B for the
# 1.5B on fresh code: 0.8-0.9 per token). A generation that has not tried its draft model tries it
# once, at the length this acceptance would pay, where that would repay the model's catch-up on the
# context within the tokens left: the test costs little where rows are dear (it is never made) and
# finds the model where they are cheap (an F16 target, a GPU), whatever the prior says.
MODEL_HOPE = 0.85
# The share of a plain token's time the hope must save, a token, in rounds of their own, for the test
# to be made. A best case that saves less is within the error of the hope itself, and the test then
# costs more than it can find: over RPC at 30 ms round trip, with the remote on this 2-core CPU, the
# hope saved 4-10% of a token's time (as each run's calibration priced it), and the test lost
# 0.2-0.4 s of a 9 s answer against plain (docs/distributed.md). Rows at 0.3 of a step (issue 39's
# test: 12%) and a GPU (rows at 0.03 of a step: 19% with a draft step half the target's, 12% at 0.6)
# still test it.
HOPE_MARGIN = 0.1
HOPE_EVIDENCE = 2  # tokens of the model's drafts judged before the hope is given up untried
# The tokens the draft model's catch-up on the context is spread over: the answer's room, but no more
# than an answer is likely to run. Agents ask for 32,000 tokens and answer in a hundred; spread over
# the room, catching a 0.5B model up on a 23,000-token prompt (minutes on a CPU) looked paid for.
ANSWER_HORIZON = 256


class Policy:
    """Per round: plain decoding, a copy draft or a model draft, and how long."""

    def __init__(self, costs, max_gamma: int = 32, model_prior: float = 0.6,
                 ngram: Optional[CopyAcceptance] = None, model: Optional[Acceptance] = None,
                 aligned: Optional[CopyAcceptance] = None):
        """`costs`: an `OnlineCosts` (calibrated figures that follow the device), or fixed
        `Costs` (a simulation, a test: what the passes take is not learnt)."""
        self.online = costs if isinstance(costs, OnlineCosts) else OnlineCosts(costs, "given", learn=False)
        self.max_gamma = max_gamma
        self.model_prior = model_prior
        self.reset()  # the acceptance tables from their priors, then any given in their place
        self.ngram = ngram or self.ngram
        self.aligned = aligned or self.aligned
        self.model = model or self.model
        self.decisions: dict[str, int] = {}
        self._last_first_rate = 0.0
        self._model_lag = 1
        # the most tokens a pass may feed and still compute each row as a single-row decode does
        # (calibrate.exact_rows); None: no such limit known
        self.exact_rows: Optional[int] = None
        # passes kept within exact_rows (`--bit-exact`): T = 0 answers equal plain decoding's
        self.bit_exact = False
        # passes several sequences share cut into passes within exact_rows (`exact_groups`)
        self.exact_shared = False
        # decisions a function of the generation alone (`start`): the acceptance tables from their
        # priors, the costs of the adopted table, explorations on a schedule of the generation's
        # rounds. Off (a simulation, a test): one policy learns across generations from timings.
        self.reproducible = False
        self._frozen: Optional[Costs] = None
        self._round = 0
        self._schedule: dict[str, tuple[int, int]] = {}
        self._hoped = False  # the draft model's first test was made (`_hope`)

    def fork(self) -> "Policy":
        """A policy for another sequence: the same device costs (one `OnlineCosts`, learnt from
        every sequence's passes) and settings; with `reproducible`, acceptance of its own."""
        if not self.reproducible:
            return self
        p = Policy(self.online, self.max_gamma, self.model_prior)
        p.exact_rows, p.bit_exact, p.exact_shared, p.reproducible = (
            self.exact_rows, self.bit_exact, self.exact_shared, True)
        return p

    def start(self) -> None:
        """A generation begins. With `reproducible` (and a settled cost table) its drafting
        decisions depend on its own tokens only: the same request under the same settings makes
        the same passes, so its T = 0 answer repeats whatever the timings measured meanwhile."""
        if not self.reproducible:
            return
        self.reset()
        self._round = 0
        self._schedule = {}
        self._hoped = False
        self._frozen = self.online.adopted if self.online.settled else None

    @property
    def fixed_costs(self) -> bool:
        """This generation decides on the adopted table (not on timings measured during it)."""
        return self._frozen is not None

    @property
    def costs(self) -> Costs:
        """The costs decided on: with `reproducible`, the table adopted when the generation
        began; else those believed now (calibrated, then corrected by what the passes showed)."""
        return self._frozen if self._frozen is not None else self.online.current()

    def reset(self) -> None:
        """Forget what was learnt about acceptance (the benchmark starts every run from the
        priors). What the device costs is a fact of the device, not of a prompt: kept."""
        self.ngram = CopyAcceptance()
        self.aligned = CopyAcceptance(prior=ALIGNED_PRIOR, shift_rate=ALIGNED_SHIFT)
        self.generated = CopyAcceptance(prior=GENERATED_PRIOR)
        self.quoted = CopyAcceptance(prior=QUOTED_PRIOR)
        self.model = Acceptance(prior=self.model_prior)

    def table(self, state: str, in_prompt: bool = True, constrained: bool = False) -> CopyAcceptance:
        """Acceptance of copies of the prompt, fresh hits or aligned; copies of the answer's
        own text, fresh or aligned, share one table; fresh hits in the prompt under a
        constraint (a value quoted from it) have their own."""
        if not in_prompt:
            return self.generated
        if state == "aligned":
            return self.aligned
        return self.quoted if constrained else self.ngram

    # -- learning -------------------------------------------------------------------------------
    def copy_outcome(self, state: str, run: int, matched: int, compared: int, in_prompt: bool = True,
                     constrained: bool = False) -> None:
        self.table(state, in_prompt, constrained).update(run, matched, compared)

    def model_outcome(self, matched: int, compared: int) -> None:
        self.model.update(matched, compared)

    # -- deciding -------------------------------------------------------------------------------
    def choose(self, offer=None, has_model: bool = False, room: int = 0, model_lag: int = 1,
               base: tuple[int, int] = (1, 1), seqs: int = 1, share: Optional[Share] = None) -> Choice:
        """`offer`: a copy proposal (`Offer`, or a tuple (run length, continuation tokens
        available[, state[, risk]])) or None; `room`: most drafts that fit (context and
        max_tokens); `model_lag`: committed tokens the draft model has not seen yet; `base`:
        the pass this round makes anyway (tokens fed, rows computed: see `best_saving`), with
        `seqs` sequences' rows in it; `share`: the other sequences' parts of a shared pass
        (then `base` is this sequence's own part, and `seqs` follows from it). A shared pass
        is priced by its micro-batches (`Costs.split_cost`): a draft that makes it two
        computations pays for the second one."""
        self._model_lag = model_lag
        costs = self.costs
        self.online.tick()
        self._round += 1
        t1 = costs.verify_cost(1)
        if share is None and seqs > 1:  # base counts the others: one token and row each
            share = Share(0, tuple(Part(i, 1, 1) for i in range(1, seqs)))
            base = (max(1, base[0] - seqs + 1), max(1, base[1] - seqs + 1))
        pass_of, value, cap = None, t1, math.inf
        if share is not None and share.others:
            seqs = 1 + len(share.others)
            fed, rows = base
            others = list(share.others)

            memo: dict[int, float] = {}  # asked for by every drafter on offer, and the exact limit

            def pass_of(g: int) -> float:
                if g not in memo:
                    memo[g] = costs.split_cost(others + [Part(share.seq, fed + g, rows + g)])
                return memo[g]

            plain = costs.split_cost([Part(p.seq, 1, 1) for p in others] + [Part(share.seq, 1, 1)])
            value = plain / seqs  # a plain token in this pass
            # the others wait for this pass: it may grow to SHARED_STRETCH times its plain cost
            cap = SHARED_STRETCH * plain
        else:
            seqs = 1
        best = Choice("none", 0, 1.0 / t1)
        runner_up, saving = best, -math.inf  # the most promising draft
        tests: list[Choice] = []  # every drafter on offer, for exploration
        if offer and room > 0:
            offer = Offer(*offer)
            scored = self.ngram.rounds + self.aligned.rounds + self.generated.rounds
            # a quoted value's prior is a measurement under constraints: no need to wait for scores
            quoted = offer.constrained and offer.in_prompt
            if offer.state == "aligned" or quoted or scored >= MIN_OBSERVATIONS:
                n = min(offer.available, room, self.max_gamma)
                surv = self.table(offer.state, offer.in_prompt, offer.constrained).survival(offer.run, n, CAUTION)
                if offer.risk:  # a place where this generation made edits before: likely another
                    keep = 1.0
                    for i, r in enumerate(offer.risk[:n]):
                        keep *= 1.0 - r
                        surv[i] *= keep
                g, saving = self._within_exact(costs, surv, 0.0, 0.0, base, value, cap, seqs, pass_of)
                self._last_first_rate = surv[0] if surv else 0.0
                if g:  # named by what it is: a fresh lookup hit or an aligned copy
                    runner_up = Choice("copy" if offer.state == "aligned" else "ngram", g,
                                       _tps(costs, surv[:g], 0.0))
                    tests.append(runner_up)
        if has_model and room > 0 and costs.draft_step is not None:
            alpha = self.model.lower(CAUTION)
            surv = [alpha ** j for j in range(1, min(room, self.max_gamma) + 1)]
            # the catch-up is paid once for the rounds the model drafts from now on: its share here
            fixed = costs.catch_up(model_lag) * min(1.0, (1.0 + sum(surv)) / min(room, ANSWER_HORIZON))
            g, saved = self._within_exact(costs, surv, costs.draft_step, fixed, base, value, cap, seqs, pass_of)
            if g:
                tests.append(Choice("model", g, _tps(costs, surv[:g], costs.draft_step)))
                # a catch-up is spread over the rounds that draft after this one: only where they would
                # (a pass of their own, base (1, 1)), not at this round's price alone (the first round of
                # an answer, whose token came with the prompt, prices a draft's row as free)
                later = fixed == 0.0 or seqs > 1 or self._pays_later(costs, surv)
                if saved > saving and later:
                    runner_up, saving = tests[-1], saved
        if runner_up.gamma and saving > MARGIN * t1:
            best = runner_up
        if best.drafter == "none" and tests and tests[-1].drafter == "model" and seqs <= 1:
            hope = self._hope(costs, room, model_lag, base, value, pass_of)
            if hope is not None:
                tests.insert(0, hope)
        # a test beside other sequences would cost them a micro-batch of its own: tests are made alone
        best = self._explore(best, tests if seqs <= 1 else [], t1)
        self.decisions[best.drafter] = self.decisions.get(best.drafter, 0) + 1
        if self._frozen is not None:  # what this round's pass shows, on the generation's own schedule
            self._observed(self.online.bucket(best.gamma + 1), best.explore)
            if best.drafter == "model":
                self._observed("draft", best.explore)
        return best

    def _due(self, key: str, stretch: float = 1.0) -> bool:
        """`OnlineCosts.due`, or with `reproducible` its deterministic twin: rounds of this
        generation since `key` was last observed, against a patience that doubles with each
        observation (timings cannot move it, so they cannot change a decision). Not while the
        costs are not settled: a doubtful calibration is re-tested as the timings say."""
        if self._frozen is None:
            return self.online.due(key, stretch)
        if not self.online.learn:
            return False
        last, patience = self._schedule.get(key, (0, OnlineCosts.PATIENCE[1]))
        return self._round - last > stretch * patience

    def _observed(self, key: str, tested: bool) -> None:
        first, most = OnlineCosts.PATIENCE[1], OnlineCosts.PATIENCE[2]
        _, patience = self._schedule.get(key, (0, first))
        self._schedule[key] = (self._round, min(2 * patience, most) if tested else patience)

    def _within_exact(self, costs: Costs, surv: list[float], step: float, fixed: float, base, value: float,
                      cap: float, seqs: int, pass_of=None) -> tuple[int, float]:
        """best_saving; with `bit_exact`, kept to passes of at most `exact_rows` tokens (beside
        other sequences the same where shared passes are cut into exact ones, `exact_shared`;
        where they are not, a shared pass is beyond the limit anyway)."""
        limit = self.exact_rows if self.bit_exact else None
        if limit is not None and not (seqs > 1 and not self.exact_shared):
            surv = surv[:max(0, limit - base[0])]
        return best_saving(costs, surv, step, fixed, base, value, cap, pass_of) if surv else (0, -math.inf)

    def _pays_later(self, costs: Costs, surv: list[float]) -> bool:
        """Whether drafting at these survival odds saves time in a round of its own (base (1, 1))."""
        g, saved = self._within_exact(costs, surv, costs.draft_step, 0.0, (1, 1), costs.verify_cost(1), math.inf, 1)
        return g > 0 and saved > 0

    def _hope(self, costs: Costs, room: int, lag: int, base, value: float, pass_of) -> Optional[Choice]:
        """The draft model's first test in a generation (MODEL_HOPE), or None: tried already, or
        even at that acceptance it would save less than HOPE_MARGIN of a plain token (`value`: this
        sequence alone, as `choose` calls it) or could not repay its catch-up within the tokens left."""
        if self.model.seen > HOPE_EVIDENCE or self._hoped:  # a one-token re-test says little: still hoped
            return None
        surv = [MODEL_HOPE ** j for j in range(1, min(room, self.max_gamma) + 1)]
        g, saved = self._within_exact(costs, surv, costs.draft_step, 0.0, base, value, math.inf, 1, pass_of)
        if g == 0 or saved <= 0:
            return None
        # what it would save a token in the rounds after this one, each a pass of its own (base
        # (1, 1)): this round's pass may be priced apart (the first round of an answer, whose
        # token came with the prompt, pays for its drafts' rows alone), and the catch-up is
        # weighed against the answer, not this round (over RPC on a CPU, where 2 rows cost 2
        # steps, the first round's price made it catch up on the whole prompt for one draft)
        g_on, saved_on = self._within_exact(costs, surv, costs.draft_step, 0.0, (1, 1), value, math.inf, 1)
        if g_on == 0 or saved_on <= 0:
            return None
        per_token = saved_on / (1.0 + sum(surv[:g_on]))
        if per_token < HOPE_MARGIN * value or per_token * min(room, ANSWER_HORIZON) <= costs.catch_up(lag):
            return None
        return Choice("model", g, _tps(costs, surv[:g], costs.draft_step), explore=True)

    def _explore(self, choice: Choice, tests: list[Choice], t1: float) -> Choice:
        """Re-test what the policy stopped doing once its patience ran out: a plain pass while
        drafting, or a one-token draft while decoding plainly: verifying 2 rows is tested with
        the cheapest drafter on offer (a copy costs no drafting; the draft model may first have
        to catch up on the whole context), the draft model's step with the draft model."""
        online = self.online
        if choice.drafter != "none":
            # a plain pass never seen yet is checked early: the calibration may have recorded
            # it while something else ran, and every draft is judged against it
            key = online.bucket(1)
            unseen = key not in (self._schedule if self._frozen is not None else online.last_seen)
            if self._due(key) or (online.learn and unseen and self._rounds() > online.PATIENCE[0]):
                online.explorations += 1
                return Choice("none", 0, 1.0 / t1, explore=True)
            return choice
        if tests and tests[0].explore:  # the draft model's first test (`_hope`): made at once
            self._hoped = True
            online.explorations += 1
            return tests[0]
        for loss, test in sorted(((self._one_draft_loss(t), t) for t in tests), key=lambda lt: lt[0]):
            keys = [online.bucket(2)] + (["draft"] if test.drafter == "model" else [])
            # the believed loss of a test, spread over its patience, stays under EXPLORE_LOSS
            # of a step per round: a wrong belief of any size is re-tested, rarely if dear
            stretch = max(1.0, loss / (EXPLORE_LOSS * t1))
            if any(self._due(k, stretch) for k in keys):
                online.explorations += 1
                return Choice(test.drafter, 1, test.tokens_per_second, explore=True)
        return choice

    def _rounds(self) -> int:
        return self._round if self._frozen is not None else self.online.rounds

    def _one_draft_loss(self, choice: Choice) -> float:
        """Expected seconds lost by a one-token draft from this drafter, against plain decoding."""
        costs = self.costs
        if choice.drafter == "model":
            p, step = self.model.mean, (costs.draft_step or 0.0) + costs.catch_up(self._model_lag)
        else:
            p, step = self._last_first_rate, 0.0
        return step + costs.verify_cost(2) - (1.0 + p) * costs.verify_cost(1)


def _tps(costs: Costs, survival: list[float], draft_step: float) -> float:
    return (1.0 + sum(survival)) / (len(survival) * draft_step + costs.verify_cost(len(survival) + 1))

