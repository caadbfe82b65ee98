"""The speculative round, over every running generation at once.

`start` puts a generation's prompt in its sequence. `step` runs one round for all of them:
each drafts (its lane's copy or n-gram proposal, or the draft model: those steps batched
across the sequences that want it), the target verifies every sequence's drafts in one pass,
each accepts by the exact rule (sampling.verify), its KV caches are cut back to what it
committed, and the committed tokens go to its queue. Under a constraint a round drafts the
tokens the grammar forces first, verifies on masked rows, and does not ask llama.cpp for
rows a mask decides alone. With one generation this is the plain speculative loop.
"""
from __future__ import annotations

import threading
import time
from typing import NamedTuple, Optional

import numpy as np

from .backend import lent
from .drafters import NO_DRAFT, Draft, Round
from .drafters.model import ModelWant, draft_many
from .errors import Aborted, BackendError, ConstraintError, damaged
from .generation import Generation
from .costs import Part, Share, exact_groups, micro_batches
from .policy import drafts_likely
from .sampling import Law, LawRows, law, verify, verify_greedy


def start(gen: Generation, target, sequences, lanes, busy: set, limit: Optional[int] = None) -> bool:
    """Prefill: the prompt into the generation's sequence (a free one claimed from
    `sequences`, not in `busy`, its prefix kept, copied or restored), its last row kept for the
    first round; `lanes(seq)` is the drafter for that sequence. With `limit`, at most that many
    prompt tokens a call (the rounds of others, and new arrivals, go on between): False until the prompt is in."""
    st = gen.stats
    if gen.cancel.is_set():  # cancelled before (or while) its prompt went in: none of it is evaluated
        finish(gen, "cancelled")
        return False
    if gen.seq < 0:
        gen.t1 = time.perf_counter()  # the prompt's start, until it is in
        gen.seq, gen.restored = sequences.claim(gen.tokens, busy)
        gen.n_ctx = target.n_ctx
    try:  # a piece alone can take seconds: a cancel (or its stream's end) stops it inside
        with target.abort_when(lambda: gen.cancel.is_set() or gen.finished):
            row, kept = sequences.prefill(gen.seq, gen.tokens, limit)
    except Aborted:
        finish(gen, "cancelled")
        return False
    if gen.restored is not None:  # the first piece says how much of the prompt was there already
        st.reused_prompt_tokens = kept
        st.restored_prompt_tokens = kept if gen.restored else 0
        gen.restored = None  # said
    if row is None:
        return False
    gen.started, gen.carry = True, row
    st.target_forwards += 1
    lane = gen.drafter = lanes(gen.seq)
    if lane is not None:
        lane.begin(list(gen.tokens))
        if gen.sources is not None:
            lane.use_sources(gen.sources)
    if gen.guide is not None:  # what the grammar drafts ahead: decided once a generation
        gen.ahead = gen.guide.likely if drafts_likely(lane.policy if lane is not None else None) else gen.guide.forced
    t0, gen.t1 = gen.t1, time.perf_counter()
    st.prompt_seconds = gen.t1 - t0
    return True


def step(target, gens: list[Generation], width: int, exact: bool = False) -> None:
    """One round for every started, unfinished generation in `gens`; `width` is the row width
    of the laws (the larger vocabulary of target and draft); `exact`: every sequence's rows (and
    its draft model's steps) in passes of their own, so that each computes as it would alone. A
    failure of one generation ends it alone (its stream raises it); a failed pass or draft ends
    every generation in it."""
    live = [g for g in gens if _goes_on(g, target)]
    if not live:
        return
    td = time.perf_counter()
    try:
        plans = _drafts(target, live, exact)                  # [(draft, drafter's part, n forced, masks)]
        tv = time.perf_counter()
        feeds = [_feed(g, target, draft.tokens, masks) for g, (draft, _, _, masks) in zip(live, plans)]
        parts = [part for part, _, _ in feeds if part is not None]
        cut = sorted(([i] for i in range(len(parts))), key=lambda g: parts[g[0]][0]) \
            if exact and len(parts) > 1 else _exact_cut(live, parts)
        got = iter(_verify(target, parts, cut))              # one pass (or one per group of `cut`)
    except Exception as exc:
        for g in live:
            g.error, g.finished = exc, True
        return
    timings = _timings(plans, feeds, parts, cut, draft_seconds=tv - td, verify_seconds=time.perf_counter() - tv)
    for g, (draft, inner, n_forced, masks), (part, ask, known), timing in zip(live, plans, feeds, timings):
        if part is not None and cut is not None and len(cut) > 1:
            g.stats.exact_cuts += 1
        try:
            got_rows = next(got) if part is not None else None
            logits = _logit_rows(draft.tokens, got_rows, ask, known, masks, target.n_vocab)
            if ask:
                g.stats.target_forwards += 1
            _commit(g, target, draft, inner, n_forced, logits, masks, width, timing)
        except Exception as exc:  # this generation's failure (a dead-end constraint), not the others'
            g.error, g.finished = exc, True


class Timing(NamedTuple):
    """What a round's pass and drafting cost, as one generation's drafter may learn it (Round's fields)."""

    verify_rows: int
    verify_seconds: float
    draft_seconds: float
    fed: int
    timed_pass: bool
    timed_draft: bool


def _timings(plans, feeds, parts, cut, draft_seconds: float, verify_seconds: float) -> list[Timing]:
    """Each generation's share of the round's timing. Alone, the pass and the drafting are its own.
    A pass several sequences shared is learnt from once, with all its rows, by the first of them, and
    only when llama.cpp computed it in one go (not cut for exactness, not several micro-batches);
    drafting is a generation's own only when no other drafted with the model beside it."""
    alone = len(plans) == 1
    rows_all, fed_all = sum(len(r) for _, _, r in parts), sum(len(t) for _, t, _ in parts)
    model_drafts = sum(1 for _, inner, _, _ in plans if inner.source == "model")
    claimed = alone or cut is not None or len(micro_batches([Part(seq, len(t), len(r)) for seq, t, r in parts])) > 1
    out = []
    for part, ask, _ in feeds:
        fed = len(part[1]) if part is not None else 0
        mine = alone or (part is not None and not claimed)
        claimed = claimed or mine
        rows, fed = (len(ask), fed) if alone or not mine else (rows_all, fed_all)
        out.append(Timing(rows, verify_seconds, draft_seconds, fed, timed_pass=mine, timed_draft=model_drafts <= 1))
    return out


def _exact_cut(live: list[Generation], parts) -> Optional[list[list[int]]]:
    """The parts by the passes that keep each within what llama.cpp computes exactly, where the
    policy (of the first lane that has one) is told to (`exact_shared`, --parallel-exact)."""
    policy = next((g.drafter.policy for g in live if g.drafter is not None and g.drafter.policy is not None), None)
    if policy is None or not policy.exact_shared or len(parts) < 2:
        return None
    return exact_groups([Part(seq, len(toks), len(rows)) for seq, toks, rows in parts], policy.exact_rows,
                        policy.costs)


def _verify(target, parts, groups: Optional[list[list[int]]] = None) -> list:
    """Each part's rows: one pass for all, or a pass per group of parts (`_exact_cut`)."""
    if not parts:
        return []
    if groups is None:
        return lent(target, parts)
    out: list = [None] * len(parts)
    for group in groups:
        for i, rows in zip(group, target.eval_batch([parts[i] for i in group])):
            out[i] = rows
    return out



def _limit(g: Generation) -> Optional[str]:
    """The finish reason when the answer or the context is full, else None."""
    st = g.stats
    if st.generated < g.request.max_tokens and len(g.tokens) < g.n_ctx:
        return None
    if g.guide is not None and g.guide.done and g.emitted_all:  # complete at exactly max_tokens
        return "stop"
    return "length" if st.generated >= g.request.max_tokens else "context"


def _goes_on(g: Generation, target) -> bool:
    """Whether the generation runs another round; if not, it is finished with its reason."""
    if g.finished:
        return False
    reason = _limit(g)
    if reason is None and g.cancel.is_set():
        reason = "cancelled"
    elif reason is None and g.guide is not None and g.guide.done:  # only end-of-generation could follow
        reason = "stop"
    if reason is not None:
        finish(g, reason)
        return False
    held = target.held(g.seq)  # an interrupted round may have left its drafts in the cache
    if len(held) > len(g.tokens) and not target.truncate(len(g.tokens), g.seq):
        raise BackendError("the target's KV cache could not be cut back")
    return True


# the llama.cpp thread (a round) and a reader (a stop string, a close) may both end a generation.
# Reentrant: a dropped stream caught in a reference cycle is ended by the garbage collector on whatever
# thread allocates, the loop inside finish() included, and its ending calls finish() for its own
# generation. Nothing holds the engine's admission lock while it waits for this one (Engine._release).
_finishing = threading.RLock()


def finish(g: Generation, reason: Optional[str], force: bool = False) -> None:
    """The generation ends (`reason` None: its stream was closed, no reason given)."""
    with _finishing:
        _finish(g, reason, force)


def stop_at(g: Generation, matched: str, read: int) -> None:
    """Its reader found stop string `matched` in the first `read` tokens: the generation ends there,
    "stop" (unless "cancelled" was said), and the tokens committed after them (a round that ran while
    they were read) are not part of the answer. Atomic against a round emitting (`_emit`)."""
    with _finishing:
        if not (g.finished and g.cancel.is_set()):
            _finish(g, "stop", force=True)
            g.stats.stop_sequence = matched
        g.stats.generated = min(g.stats.generated, read)


def _finish(g: Generation, reason: Optional[str], force: bool) -> None:
    if force and reason is not None:
        g.stats.finish_reason = reason
    if not g.finished:
        if reason is not None:
            g.stats.finish_reason = reason
        g.finished = True
        g.stats.decode_seconds = time.perf_counter() - g.t1 if g.started else 0.0
        costs = g.drafter.describe_costs() if g.drafter is not None else None
        if costs is not None:
            g.stats.costs = costs
        if g.drafter is not None and g.started:  # a draft memory remembers the answer (drafters/recall.py)
            g.drafter.end(list(g.tokens))


def _drafts(target, live: list[Generation], exact: bool = False):
    """Every generation's draft: (the whole draft, the drafter's part, how many tokens the
    constraint forced, the masks), the draft model's steps batched across the generations (with
    `exact`: each planned and drafted as if alone)."""
    mandatory = [len(g.tokens) - len(target.held(g.seq)) for g in live]  # tokens the pass feeds anyway
    drafted = [0] * len(live)  # the drafts each generation before this one added to the pass
    staged = []
    try:
        for i, g in enumerate(live):
            others = () if exact else tuple(Part(h.seq, m + d, d + (m > 0))
                                            for j, (h, m, d) in enumerate(zip(live, mandatory, drafted)) if j != i)
            forced, inner = _plan(g, Share(g.seq, others, mandatory[i]))
            staged.append([g, forced, inner])
            drafted[i] = len(forced) + (inner.n if isinstance(inner, ModelWant) else len(inner.tokens))
        wants = [s for s in staged if isinstance(s[2], ModelWant)]
        for s, d in zip(wants, draft_many([s[2] for s in wants], separate=exact) if wants else []):
            s[2] = d
    finally:
        for s in staged:  # the grammar back where the round found it
            if s[1]:
                s[0].guide.rollback(len(s[1]))
    out = []
    for g, forced, inner in staged:
        if isinstance(inner, ModelWant):  # the batch failed before drafting it
            inner = NO_DRAFT
        out.append(_combine(g, forced, inner))
    return out


def _plan(g: Generation, share) -> tuple[list[int], object]:
    """The tokens the constraint forces from here (point masses, source "grammar": verified like
    any draft, since the law may still prefer another tokenization of the same bytes), left
    advanced in the guide, and the drafter's plan after them (a Draft or a ModelWant)."""
    guide, lane, room = g.guide, g.drafter, g.room
    forced: list[int] = []
    if guide is not None and room > 0 and lane is not None:  # no drafter: plain decoding
        forced = (g.ahead or guide.forced)()[:room]
        guide.advance(forced)
    left = room - len(forced)
    if lane is None or left <= 0:
        return forced, NO_DRAFT
    return forced, lane.plan(g.tokens + forced, left, g.request.params, g.rng, guide, share=share)


def _combine(g: Generation, forced: list[int], inner: Draft):
    """The whole draft: the forced tokens' point masses, then the drafter's part cut at its
    first token the constraint forbids."""
    guide = g.guide
    if guide is not None and inner.tokens:
        guide.advance(forced)
        try:
            k = guide.legal_prefix(inner.tokens)
        finally:
            guide.rollback(len(forced))
        if k < len(inner.tokens):
            inner = Draft(inner.tokens[:k], None if inner.q is None else inner.q[:k], inner.source)
    draft = inner
    if forced:
        q = None
        if inner.q is not None:  # the forced tokens' rows are point masses
            q = LawRows([Law.point(t) for t in forced] + list(inner.q))
        draft = Draft(forced + inner.tokens, q, "grammar")
    masks = guide.masks(draft.tokens) if guide is not None else None
    return draft, inner, len(forced), masks


def _feed(g: Generation, target, drafts: list[int], masks):
    """This generation's part of the pass, (seq, tokens, rows) or None; the rows asked (indices into
    its k + 1 laws); the rows known without the pass ({index: logits}). Row i is the target's law
    for drafts[i], the last the bonus token's. In its first round row 0 is the prompt's last row,
    computed with the prompt (`carry`, used up here). A row a mask leaves one token in is not asked
    (nor is a part without open rows fed: its tokens stay pending for the next round)."""
    k = len(drafts)
    open_rows = list(range(k + 1)) if masks is None else [i for i in range(k + 1) if np.count_nonzero(masks[i]) > 1]
    if g.carry is not None:
        known, g.carry = {0: g.carry[0]}, None
        ask = [i for i in open_rows if i > 0]
        return ((g.seq, drafts, [i - 1 for i in ask]) if ask else None), ask, known
    if not open_rows:
        return None, [], {}
    pending = g.tokens[len(target.held(g.seq)):]
    return (g.seq, pending + drafts, [len(pending) - 1 + i for i in open_rows]), open_rows, {}


def _logit_rows(drafts, got, ask, known: dict, masks, n_vocab: int) -> list:
    """The k + 1 rows of logits (the target's `n_vocab` columns; the laws read them as `width`
    wide, zero beyond): the pass's rows (`got`, for the rows asked) and the rows known before it,
    not copied, and for a row the mask decides the point mass on its one legal token (a `Law`, which
    the verifier reads as it is: no row of 152k -inf to build and search)."""
    logits: list = [None] * (len(drafts) + 1)
    for i, row in known.items():
        logits[i] = row
    for j, i in enumerate(ask):
        logits[i] = got[j]
    if masks is not None:
        for i, row in enumerate(logits):
            if row is None:
                legal = masks[i][:n_vocab]
                t = int(np.argmax(legal))  # its one legal token (none: a row of -inf, which the verifier refuses)
                logits[i] = Law.point(t) if legal[t] else np.full(n_vocab, -np.inf, dtype=np.float32)
    return logits


def _commit(g: Generation, target, draft: Draft, inner: Draft, n_forced: int, logits, masks, width: int,
            timing: Timing) -> None:
    """Accept by the exact rule, cut the KV cache back, and queue what was committed."""
    params, st, guide = g.request.params, g.stats, g.guide
    drafts = draft.tokens
    try:  # each row is read (its law computed) only when the verifier gets to it
        if params.greedy:
            n, y = verify_greedy(drafts, logits, masks)
        else:
            n, y = verify(drafts, law(logits, params, width, masks), draft.q, g.rng)
    except FloatingPointError:  # a non-finite maximum: NaN rows
        raise damaged(target) from None
    new = drafts[:n] + [y]
    if not target.truncate(min(len(target.held(g.seq)), len(g.tokens) + n), g.seq):
        raise BackendError("the target's KV cache could not be cut back")
    g.tokens.extend(new)
    if guide is not None:
        guide.advance([t for t in new if not target.is_eog(t)])
    count(st, draft, n, n_forced, inner.source, timing.verify_seconds + timing.draft_seconds)
    if g.drafter is not None:
        g.drafter.observe(Round(tokens=g.tokens, draft=inner, accepted=max(0, n - n_forced), **timing._asdict()))
    with _finishing:  # atomic against a reader ending it at a stop string (stop_at): its count holds
        _emit(g, target, new, n)


def _emit(g: Generation, target, new: list[int], n: int) -> None:
    """The round's committed tokens to the generation's queue, up to its end."""
    st, guide = g.stats, g.guide
    g.last_round = 0
    for i, tok in enumerate(new):
        if g.finished:  # its reader ended it (a stop string) while this round ran: nothing more is its answer
            return
        if target.is_eog(tok):
            if guide is not None and not guide.accepting:  # the grammar left nothing else
                raise ConstraintError(f"the {g.request.constraint.describe()} cannot be "
                                      "completed from here: it admits no continuation of this answer")
            finish(g, "stop" if guide is not None else "eos")
            return
        st.generated += 1
        st.decode_seconds = time.perf_counter() - g.t1
        g.out.append((tok, i < n))
        g.last_round += 1
        if st.generated >= g.request.max_tokens:
            g.emitted_all = i == len(new) - 1
            break
    reason = _limit(g)
    if reason is not None:
        finish(g, reason)


def count(stats, draft: Draft, n: int, n_forced: int = 0, source: str = "", seconds: float = 0.0) -> None:
    """One round in the stats; a constrained draft counts its forced part (source "grammar")
    apart from the drafter's. `seconds`: the round's drafting and pass, counted to the drafter
    that chose it (the last part), so that what each drafter cost per token can be read off."""
    stats.rounds += 1
    drafts = draft.tokens
    if drafts:
        stats.drafted += len(drafts)
        stats.accepted += n
        stats.forced += min(n, n_forced)
        if len(stats.accept_histogram) <= len(drafts):
            stats.accept_histogram.extend([0] * (len(drafts) + 1 - len(stats.accept_histogram)))
        stats.accept_histogram[n] += 1
    parts = [(draft.source if drafts else "none", len(drafts), n)] if not n_forced else \
        [("grammar", n_forced, min(n, n_forced))] + \
        ([(source, len(drafts) - n_forced, max(0, n - n_forced))] if len(drafts) > n_forced else [])
    for i, (name, k, acc) in enumerate(parts):
        d = stats.by_drafter.setdefault(name, {"rounds": 0, "drafted": 0, "accepted": 0, "seconds": 0.0})
        d["rounds"] += 1
        d["drafted"] += k
        d["accepted"] += acc
        if i == len(parts) - 1:
            d["seconds"] = round(d.get("seconds", 0.0) + seconds, 6)
