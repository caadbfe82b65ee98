"""What a target pass and a draft step cost: llama.cpp's passes as edgespec prices them.

`Costs` is one table (seconds for a pass with logits on k rows, the draft model's step and
catch-up); `micro_batches` is how llama.cpp cuts a pass several sequences share, and
`exact_groups` the cut that keeps each sequence's rows computed as alone; `OnlineCosts` starts
from the calibration and follows the passes the engine times (a measured curve is a belief, and
a belief the policy stopped testing is re-tested now and then).
"""
from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass
from statistics import median
from typing import Callable, NamedTuple, Optional

CATCH_UP = 0.3        # a token the draft model catches up on, in a batch, against one of its steps
# A token a pass feeds without computing its logits (a forced token, a row a constraint decides)
# costs about 0.7 of one with logits: Qwen 1.5B, 2 threads, logits on the last row only against
# every row at k = 2, 4, 8, 16 gave 0.69, 0.77, 0.72, 0.68 of the difference to one row.
FEED_SHARE = 0.7


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

