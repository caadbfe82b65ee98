"""Which drafter and how many drafts, per round, from the device's costs and online acceptance.

Expected tokens per second of a round with gamma drafts, each accepted with probability
alpha until the first miss (Leviathan et al. 2023, eq. 1):

    E[tokens] = (1 - alpha^(gamma+1)) / (1 - alpha)
    time      = gamma * T_draft + T_verify(gamma + 1)

T_verify(k) is the cost of a target pass that returns logits for k rows; it is not monotonic
on every device, which the search over gamma uses as it is. The costs start from the
calibration and follow the passes the engine runs (`OnlineCosts`): a measured curve is a
belief, and a belief the policy stopped testing is re-tested now and then.

A model draft's acceptance is one rate per token (a Beta estimate). A copy (prompt lookup or
an aligned copy) is not geometric: the longer a passage has been copied, the likelier its
next token is copied too (measured on this project's workloads: about 0.2 of single-token
matches continue, 0.85 after 8 agreeing tokens, 0.97 after 16). So copy acceptance is
estimated per run-length bucket, separately for a fresh lookup hit and for an established
alignment (where even the first token after an edit's resync is usually right), and a draft
of gamma tokens starting at run r is scored with the survival product of the buckets of
r, r+1, ...
"""
from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass
from statistics import median
from typing import Callable, NamedTuple, Optional

MIN_OBSERVATIONS = 4  # copy proposals scored before a fresh lookup hit is drafted
CAUTION = 0.25        # acceptance is taken a quarter standard deviation below its estimate
MARGIN = 0.0          # steps a draft must be expected to save before it is made
CATCH_UP = 0.3        # a token the draft model catches up on, in a batch, against one of its steps
# A token a pass feeds without computing its logits (a forced token, a row a constraint decides)
# costs about 0.7 of one with logits: Qwen 1.5B, 2 threads, logits on the last row only against
# every row at k = 2, 4, 8, 16 gave 0.69, 0.77, 0.72, 0.68 of the difference to one row.
FEED_SHARE = 0.7
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

# Run-length buckets (lower edges) and the prior per-token acceptance of each. Fresh lookup
# hits: below what the workloads showed for every kind (about 0.2 0.45 0.6 0.75 0.8 0.85 0.95
# 0.98 ...). Aligned copies: the continuation of an established copy after an edit.
RUN_EDGES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)
RUN_PRIOR = (0.15, 0.35, 0.5, 0.6, 0.7, 0.75, 0.85, 0.93, 0.95, 0.95, 0.95)
ALIGNED_PRIOR = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.93, 0.95, 0.95, 0.95)
# Copies whose source is text this answer generated (a repeated structure: rows of a table,
# similar functions) break far sooner than copies of a prompt passage: measured on the
# workloads, after 2 agreeing tokens 4 more agree 0.1 of the time there, 0.5 in the prompt.
GENERATED_PRIOR = (0.1, 0.25, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.93, 0.95, 0.95)
# Fresh prompt-lookup hits under a constraint, cut at their first forbidden token and where the
# quoted phrase ends (drafters/quote.py): inside a JSON string an extraction quotes its prompt,
# and such hits continue far more often (measured on the structured workloads, Qwen 1.5B, per
# token: 0.77 at run 1, 0.95 at 2, 0.94 at 3 and after); set below that.
QUOTED_PRIOR = (0.65, 0.8, 0.85, 0.85, 0.9, 0.9, 0.9, 0.93, 0.95, 0.95, 0.95)
PRIOR_WEIGHT = 4.0
ALIGNED_SHIFT = 0.3   # how fast the aligned priors follow the evidence together (CopyAcceptance)
SHIFT_MAX = 3.0


def _logit(p: float) -> float:
    p = min(max(p, 1e-4), 1 - 1e-4)
    return math.log(p / (1 - p))


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


@dataclass
class Acceptance:
    """Per-token acceptance as a Beta posterior with forgetting (recent rounds weigh more)."""

    prior: float = 0.5
    weight: float = 2.0        # prior strength, in pseudo-trials
    decay: float = 0.97        # per update: about the last 30 rounds matter
    hits: float = 0.0
    trials: float = 0.0
    seen: int = 0

    def observe(self, hit: bool) -> None:
        self.hits = self.hits * self.decay + hit
        self.trials = self.trials * self.decay + 1
        self.seen += 1

    def update(self, matched: int, compared: int) -> None:
        # geometric model: `matched` successes, then one failure unless everything matched
        trials = matched + (1 if matched < compared else 0)
        if trials == 0:
            return
        self.hits = self.hits * self.decay + matched
        self.trials = self.trials * self.decay + trials
        self.seen += trials

    @property
    def mean(self) -> float:
        return (self.hits + self.prior * self.weight) / (self.trials + self.weight)

    def lower(self, z: float = 1.0) -> float:
        """A pessimistic estimate: the posterior mean less z standard deviations."""
        m, n = self.mean, self.trials + self.weight
        return max(0.0, m - z * math.sqrt(m * (1.0 - m) / (n + 1.0)))


class CopyAcceptance:
    """Copy draft acceptance per token, by the length of the copy run it continues.

    With `shift_rate`, the priors of all buckets also move together (a shift in log-odds,
    learnt from every scored token), so that an answer that keeps resuming its copies (an
    edit) is trusted at short runs after a few rounds, before each bucket has evidence."""

    def __init__(self, decay: float = 0.98, prior: tuple[float, ...] = RUN_PRIOR, shift_rate: float = 0.0):
        self.base = tuple(prior)
        self.buckets = [Acceptance(prior=p, weight=PRIOR_WEIGHT, decay=decay) for p in prior]
        self.rounds = 0
        self.shift_rate = shift_rate
        self.shift = 0.0

    def _learn_shift(self, b: int, hit: bool) -> None:
        p = _sigmoid(_logit(self.base[b]) + self.shift)
        self.shift = min(SHIFT_MAX, max(-SHIFT_MAX, self.shift + self.shift_rate * (hit - p)))
        for bucket, base in zip(self.buckets, self.base):
            bucket.prior = _sigmoid(_logit(base) + self.shift)

    @staticmethod
    def bucket(run: int) -> int:
        return max(0, bisect.bisect_right(RUN_EDGES, run) - 1)

    def update(self, run: int, matched: int, compared: int) -> None:
        """A proposal made at `run` matched `matched` of the `compared` tokens committed since:
        token i was drafted at run + i; tokens after the first miss were never at stake."""
        self.rounds += 1
        for i in range(min(compared, matched + 1)):
            b = self.bucket(run + i)
            if self.shift_rate:
                self._learn_shift(b, i < matched)
            self.buckets[b].observe(i < matched)

    def survival(self, run: int, n: int, z: float = 0.0) -> list[float]:
        """P(the first j drafts are all accepted) for j = 1..n, each rate z deviations low.
        A longer run is taken to be at least as reliable as a shorter one, so a bucket with
        little evidence of its own inherits what the shorter runs showed."""
        rates, best = [], 0.0
        for b in self.buckets:
            best = max(best, b.lower(z))
            rates.append(best)
        out, s = [], 1.0
        for i in range(n):
            s *= rates[self.bucket(run + i)]
            out.append(s)
        return out


def expected_tokens(alpha: float, gamma: int) -> float:
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


@dataclass(frozen=True)
class Costs:
    """Seconds: verify[k - 1] is a target pass with logits on k rows (k = 1..len(verify));
    draft_step a draft model's single-token step (None without a draft model); draft_prefill
    what each token costs the draft model when it catches up, in one batch, on tokens committed
    while it was not drafting (None: CATCH_UP of a step)."""

    verify: tuple[float, ...]
    draft_step: Optional[float] = None
    draft_prefill: Optional[float] = None

    def catch_up(self, lag: int) -> float:
        """What the draft model spends before drafting when it is `lag` tokens behind (one or
        two behind is every round's normal first step)."""
        if self.draft_step is None or lag <= 2:
            return 0.0
        rate = self.draft_prefill if self.draft_prefill is not None else CATCH_UP * self.draft_step
        return (lag - 2) * rate

    @property
    def max_rows(self) -> int:
        return len(self.verify)

    def verify_cost(self, k: int) -> float:
        return self.verify[min(k, self.max_rows) - 1]

    def pass_cost(self, fed: int, rows: int) -> float:
        """A pass that feeds `fed` tokens and computes logits on `rows` of them (rows >= 1)."""
        rows = max(1, min(rows, fed)) if fed else max(1, rows)
        base = self.verify_cost(rows)
        if fed <= rows:
            return base
        return base + FEED_SHARE * max(0.0, self.verify_cost(fed) - base)

    def split_cost(self, parts) -> float:
        """A pass of several sequences' `parts` (Part), as llama.cpp computes it: one
        computation per micro-batch (`micro_batches`)."""
        return sum(self.pass_cost(fed, rows) for fed, rows in micro_batches(parts))


class Part(NamedTuple):
    """One sequence's part of a pass: its sequence id, the tokens it feeds and the rows of
    logits it asks for (its last `rows` tokens)."""

    seq: int
    fed: int
    rows: int


class Share(NamedTuple):
    """The rest of a pass several sequences share, as a sequence planning its draft sees it:
    its own sequence id, the other sequences' parts (their drafts, where already planned) and the
    tokens its own part feeds anyway (1: the last committed token; 0 in its first round, whose
    prompt row is already computed)."""

    seq: int
    others: tuple[Part, ...]
    own: int = 1


def micro_batches(parts) -> list[tuple[int, int]]:
    """(tokens fed, rows) of each micro-batch llama.cpp cuts a pass of several sequences into
    when each sequence has a KV stream of its own (llama_batch_allocr::split_equal, sequential):
    a micro-batch takes sequences with consecutive ids only, and the same number of tokens from
    each. So a pass where one of four sequences drafts 8 tokens is two graph computations, 4
    rows and then 8, each reading every weight: [0: 9, 1: 1, 2: 1, 3: 1] costs T(4) + T(8),
    and sequences 0 and 2 without 1 never share one."""
    at = {p.seq: 0 for p in parts if p.fed > 0}
    by = {p.seq: p for p in parts}
    out = []
    while at:
        ids = sorted(at)
        group = [ids[0]]
        for s in ids[1:]:
            if s != group[-1] + 1:
                break
            group.append(s)
        m = min(by[s].fed - at[s] for s in group)
        rows = 0
        for s in group:
            p, a = by[s], at[s]
            rows += max(0, min(a + m, p.fed) - max(a, p.fed - p.rows))
            at[s] = a + m
            if at[s] >= p.fed:
                del at[s]
        out.append((m * len(group), rows))
    return out


# With Policy.exact_shared (`--parallel-exact`, on by default through Settings.parallel_exact) a pass
# of several sequences that would feed more tokens than llama.cpp computes exactly (the policy's
# exact_rows) is cut into passes within that limit: every row is then computed as the sequence alone
# would compute it, and a greedy answer given beside others equals its answer alone. It costs
# throughput where batching pays: `serve --parallel 4` on this project's 2-core AMD EPYC gave 1.23x at
# once over serial with it, 1.45x without (scripts/parallel_servers.py). The calibrated
# single-sequence costs cannot price the cut (two sequences' rows in one pass cost more than one
# sequence's two rows: 1.92-2.30 steps against 1.58-1.98), so it is a setting, not a decision here.
def exact_groups(parts, limit: Optional[int], costs: "Costs", slack: float = math.inf) -> Optional[list[list[int]]]:
    """Indices of `parts` (Part) by the cheapest passes, sequences in id order, that keep each
    within `limit` tokens (a part beyond it alone), or None: one pass (no limit, within it already,
    or the cut would cost more than `slack` (a share) over the whole pass)."""
    if limit is None or len(parts) < 2 or sum(p.fed for p in parts) <= limit:
        return None
    order = sorted(range(len(parts)), key=lambda i: parts[i].seq)
    # best[i]: the cheapest cut of the first i parts (in id order), and where its last pass starts
    best: list[tuple[float, int]] = [(0.0, 0)] + [(math.inf, 0)] * len(order)
    for i in range(1, len(order) + 1):
        for j in range(i - 1, -1, -1):
            seg = [parts[k] for k in order[j:i]]
            if i - j > 1 and sum(p.fed for p in seg) > limit:
                break
            c = best[j][0] + costs.split_cost(seg)
            if c < best[i][0]:
                best[i] = (c, j)
    groups, i = [], len(order)
    while i > 0:
        j = best[i][1]
        groups.append(order[j:i])
        i = j
    groups.reverse()
    return groups if best[-1][0] <= (1 + slack) * costs.split_cost(parts) else None


def rows_cheap(costs: "Costs") -> bool:
    """A second verified row costs well under a decode step (a GPU; not a 2-core CPU, where it
    costs 0.8-0.9 of one): drafts right ~9 times in 10, such as the usual tokenization of bytes a
    grammar forces, pay only then."""
    return costs.verify_cost(2) - costs.verify_cost(1) < 0.5 * costs.verify_cost(1)


def drafts_likely(policy: Optional["Policy"]) -> bool:
    """Whether a constrained round drafts the usual tokenization of forced bytes after the forced
    tokens (`Guide.likely`): where rows are cheap; a fixed drafter (no policy) always does. Replayed
    on the structured workloads with this CPU's pass costs it loses (1.180x against 1.187x)."""
    return policy is None or rows_cheap(policy.costs)


def _log_ratio(observed: float, believed: float) -> float:
    return math.log(max(observed, 1e-7) / max(believed, 1e-7))


BATCH_SLACK = 1.25  # a k-row pass may cost up to 1.25x k single-token passes


class OnlineCosts:
    """The cost curve the policy decides on: calibrated figures corrected by every target pass
    and draft step the engine times.

    belief(k) = calibrated(k) * exp(level + offset(k)), in logs so that 10x too slow and 10x
    too fast weigh alike. `level` is the median of the latest passes' log-ratios (after their
    row count's own offset): it follows a device that became uniformly slower or faster,
    within WINDOW / 2 passes, and one outlier cannot move a median. `offset(k)` is the median
    of row count k's recent log-ratios beyond the level, shrunk by one pseudo-observation of
    0; row counts never seen take their nearest observed neighbours' offsets (interpolated),
    so that what single-token passes show moves the whole curve. The draft step has its own
    offset on the same level (one device, one load).

    Every row count bucket (and the draft step) also has a *patience*: the rounds the policy
    may go without observing it. The policy explores one whose patience ran out; an
    observation that agrees with the belief doubles its patience, one that disagrees makes
    every patience short again."""

    WINDOW = 15
    K_WINDOW = 9
    PATIENCE = (4, 16, 256)       # rounds between explorations: after a surprise, at first, at most
    AGREE = math.log(1.3)         # an observation within 30% of the belief agrees with it
    PERSIST_AFTER = 24            # passes observed before a lasting disagreement is written back
    PERSIST_GAP = math.log(1.5)   # how far the belief must have moved from the adopted figures (each
    # adoption changes the decisions of later generations: 1.25 churned with the noise of a 2-core CPU)

    def __init__(self, base: Costs, source: str = "calibrated", prior: int = 3,
                 persist: Optional[Callable[[Costs], bool]] = None, learn: bool = True):
        self.base = base
        self.learn = learn         # False: the figures are given (a simulation, a test) and stay
        self.source = source       # where `base` came from: calibrated, cached, provisional, given
        self.prior = prior         # pseudo-observations that the base figures are right
        self.persist = persist     # writes corrected figures back (returns True when it did)
        self.level_obs: deque[float] = deque(maxlen=self.WINDOW)
        self.level = 0.0
        self.k_obs: dict[int, deque[float]] = {}
        self.raw: dict[int, deque[float]] = {}  # per row count: the latest pass times, for describe()
        self.draft_obs: deque[float] = deque(maxlen=self.K_WINDOW)
        self.prefill_obs: deque[float] = deque(maxlen=self.K_WINDOW)  # seconds per caught-up token
        self.rounds = 0
        self.passes = 0
        self.draft_steps = 0
        self.last_seen: dict[str, int] = {}
        self.streaks: dict[tuple, tuple] = {}  # per window: (way of the last surprises, how many in a row)
        self.patience: dict[str, int] = {}
        self.explorations = 0
        self.persisted: Optional[Costs] = None
        self._offsets: Optional[list[float]] = None
        self._current: Optional[Costs] = None
        # the table reproducible decisions are made on (Policy.start): the calibration, replaced
        # only by a correction that held (`_maybe_persist`); `version` counts the replacements
        self.adopted: Costs = self.current()
        self.version = 0

    @property
    def settled(self) -> bool:
        """Whether decisions may be made on the adopted table: the calibration is trusted (`prior`),
        or a correction of it has held. A doubtful calibration (measured under load: T(1) taken as
        3.6 s on a busy machine) is followed pass by pass until one has."""
        return not self.learn or self.prior > 0 or self.version > 0

    # -- what the policy reads ----------------------------------------------------------------
    @property
    def max_rows(self) -> int:
        return self.base.max_rows

    def current(self) -> Costs:
        """The believed costs now."""
        if self._current is None:
            offs, lv = self.offsets(), self.level
            verify = [v * math.exp(lv + o) for v, o in zip(self.base.verify, offs)]
            # a k-row pass costs at least a 1-row pass and at most k of them (with some slack):
            # a belief outside that is a bad measurement (the cheaper figure is the one to
            # believe: other load only ever slows a pass), and it would keep the policy from
            # ever testing what it rules out
            one = min(verify)
            verify = tuple(min(max(v, one), BATCH_SLACK * k * one) for k, v in enumerate(verify, 1))
            step, prefill = self.base.draft_step, self.base.draft_prefill
            if step is not None:
                scale = math.exp(lv + self._draft_offset())
                step *= scale
                prefill = median(self.prefill_obs) if self.prefill_obs else (
                    prefill * scale if prefill is not None else CATCH_UP * step)
            self._current = Costs(verify, step, prefill)
        return self._current

    def offsets(self) -> list[float]:
        if self._offsets is None:
            seen = {k: median(list(obs) + [0.0]) for k, obs in self.k_obs.items() if obs}
            ks = sorted(seen)
            out = []
            for k in range(1, self.max_rows + 1):
                if not ks:
                    out.append(0.0)
                elif k in seen:
                    out.append(seen[k])
                else:
                    i = bisect.bisect_left(ks, k)
                    if i == 0:
                        out.append(seen[ks[0]])
                    elif i == len(ks):
                        out.append(seen[ks[-1]])
                    else:
                        lo, hi = ks[i - 1], ks[i]
                        out.append(seen[lo] + (seen[hi] - seen[lo]) * (k - lo) / (hi - lo))
            self._offsets = out
        return self._offsets

    def _draft_offset(self) -> float:
        return median(list(self.draft_obs) + [0.0]) if self.draft_obs else 0.0

    @staticmethod
    def bucket(rows: int) -> str:
        """Row counts explored together: 1, 2-3, 4-7, 8-15, 16-31, 32+ (and "draft")."""
        return f"rows{1 << (rows.bit_length() - 1)}"

    def due(self, key: str, stretch: float = 1.0) -> bool:
        """Has the policy gone without observing `key` for longer than its patience (times
        `stretch`: a test believed dear is made less often)?"""
        if not self.learn:
            return False
        return self.rounds - self.last_seen.get(key, 0) > stretch * self.patience.get(key, self.PATIENCE[1])

    # -- what the engine shows ----------------------------------------------------------------
    def tick(self) -> None:
        self.rounds += 1

    def observe_pass(self, rows: int, seconds: float) -> None:
        """A target pass that computed `rows` rows of logits took `seconds`."""
        if rows <= 0 or not seconds > 0 or not self.learn:
            return
        k = min(rows, self.max_rows)
        believed = self.current().verify_cost(k)
        r = _log_ratio(seconds, self.base.verify_cost(k))
        self.level_obs.append(r - self.offsets()[k - 1])
        self.level = median(list(self.level_obs) + [0.0] * self.prior)
        self.raw.setdefault(k, deque(maxlen=self.K_WINDOW)).append(seconds)
        obs = self.k_obs.setdefault(k, deque(maxlen=self.K_WINDOW))
        self._append(obs, r - self.level, _log_ratio(seconds, believed), ("rows", k))
        self.passes += 1
        self._offsets = self._current = None
        self._seen(self.bucket(k), _log_ratio(seconds, believed), _log_ratio(self.current().verify_cost(k), believed))
        self._maybe_persist()

    def observe_draft(self, steps: int, seconds: float, lag: int = 1) -> None:
        """`steps` draft-model steps took `seconds` in all, the draft model being `lag` tokens
        behind when it started (more than two: it caught up on them first, in one batch)."""
        if steps <= 0 or not seconds > 0 or self.base.draft_step is None or not self.learn:
            return
        if lag > 2:  # mostly catching up: what a caught-up token costs, not a step
            now = self.current()
            self.prefill_obs.append(max(0.0, seconds - steps * now.draft_step) / (lag - 2))
            self._current = None
            self.last_seen["draft"] = self.rounds  # tested, though not a clean step: not due again now
            return
        believed = self.current().draft_step
        r = _log_ratio(seconds / steps, self.base.draft_step)
        self._append(self.draft_obs, r - self.level, _log_ratio(seconds / steps, believed), ("draft",))
        self.draft_steps += 1
        self._current = None
        self._seen("draft", _log_ratio(seconds / steps, believed), _log_ratio(self.current().draft_step, believed))

    def _append(self, obs: deque, value: float, surprise: float, key: tuple) -> None:
        """Add an observation to a window. Three surprises in a row, the same way, mark a change
        of the device (an outlier is one, rarely two): the window restarts from them, or a
        rarely observed row count would wait for its whole window to turn over."""
        tol = max(self.AGREE, 2 * self.noise())
        sign = (surprise > tol) - (surprise < -tol)
        way, count = self.streaks.get(key, (0, 0))
        count = count + 1 if sign and sign == way else 1
        self.streaks[key] = (sign, count)
        obs.append(value)
        if sign and count >= 3:
            recent = list(obs)[-3:]
            obs.clear()
            obs.extend(recent)

    def _seen(self, key: str, surprise: float, moved: float) -> None:
        """An observation `surprise` (log) away from the belief: within the noise of recent
        passes, it doubles the patience of `key`; beyond it, `key` is looked at again soon
        (an outlier, or a change?); one that moved the belief itself (`moved`, log) means the
        device is not what it was believed to be: every belief is re-tested soon."""
        soon, first, most = self.PATIENCE
        tol = max(self.AGREE, 2 * self.noise())
        if abs(moved) > tol:
            for k in self.patience:
                self.patience[k] = min(self.patience[k], first)
            self.patience[key] = soon
        elif abs(surprise) < tol:
            self.patience[key] = min(2 * self.patience.get(key, first), most)
        else:  # an outlier or the first sign of a change: look again soon to tell which
            self.patience[key] = soon
        self.last_seen[key] = self.rounds

    def noise(self) -> float:
        """The spread (interquartile, log) of the latest passes against the belief."""
        q = sorted(self.level_obs)
        return q[3 * len(q) // 4] - q[len(q) // 4] if len(q) >= 8 else 0.0

    def _maybe_persist(self) -> None:
        """Adopt the corrected curve once it has held over PERSIST_AFTER passes with a steady
        level (later generations decide on it), and write it back, so that the next load starts
        from what the device does now."""
        if self.passes < self.PERSIST_AFTER or len(self.level_obs) < self.WINDOW:
            return
        now = self.current()
        moved = max(abs(_log_ratio(a, b)) for a, b in zip(now.verify, self.adopted.verify))
        if moved < self.PERSIST_GAP:
            return
        if self.noise() > self.PERSIST_GAP:  # the device is not steady now: no lasting conclusion
            return
        self.adopted = now
        self.version += 1
        if self.persist is not None and self.persist(now):
            self.persisted = now

    def describe(self) -> dict:
        now = self.current()
        moved = max(abs(_log_ratio(a, b)) for a, b in zip(now.verify, self.base.verify))
        d = {"source": "corrected online" if moved >= math.log(1.1) else self.source,
             "calibration": self.source,
             "passes_observed": self.passes, "draft_steps_observed": self.draft_steps,
             "t1_ms": round(1000 * now.verify[0], 2), "t1_calibrated_ms": round(1000 * self.base.verify[0], 2),
             "level": round(math.exp(self.level), 3),
             "explorations": self.explorations, "written_back": self.persisted is not None,
             "costs_version": self.version,
             # per row count seen: the median of its latest passes and what is believed now
             "pass_ms": {k: [round(1000 * median(self.raw[k]), 1), round(1000 * now.verify_cost(k), 1)]
                         for k in sorted(self.raw)}}
        if now.draft_step is not None:
            d["draft_step_ms"] = round(1000 * now.draft_step, 2)
        return d


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
                if saved > saving:
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

    def _hope(self, costs: Costs, room: int, lag: int, base, value: float, pass_of) -> Optional[Choice]:
        """The draft model's first test in a generation (MODEL_HOPE), or None: tried already, or
        it could not repay its catch-up within the tokens left even at that acceptance."""
        if self.model.seen > HOPE_EVIDENCE or self._hoped:  # a one-token re-test says little: still hoped
            return None
        surv = [MODEL_HOPE ** j for j in range(1, min(room, self.max_gamma) + 1)]
        g, saved = self._within_exact(costs, surv, costs.draft_step, 0.0, base, value, math.inf, 1, pass_of)
        if g == 0 or saved <= 0:
            return None
        per_token = saved / (1.0 + sum(surv[:g]))
        if per_token * min(room, ANSWER_HORIZON) <= costs.catch_up(lag):
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
