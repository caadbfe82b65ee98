"""Aligned copy: follow the passage an answer is copying, through the edits it makes.

An edit answer is a passage of the prompt with local changes. Prompt lookup re-finds the
passage from scratch after every change, and a fresh three-token match looks like any
coincidence. This drafter keeps the *alignment* instead: the source position the output is
copying advances as tokens are committed; at a divergence (the edit itself) it remembers
where the copy stopped (the anchor) and watches the next committed tokens for the point
where they meet the same source again, a few tokens further (a replacement or a deletion)
or where they stopped (an insertion). From there it proposes the source's continuation, and
tells the policy that this is the resumption of a long copy, not a fresh hit.

Code editors' "speculative edits" work this way. Drafts are point masses (q is None),
verified exactly like any other.
"""
from __future__ import annotations

from typing import NamedTuple

from ..defaults import GAMMA
from . import Draft, Drafter, Round
from .ngram import NgramDrafter, agreed, run_length
from .recall import DraftMemory, prefer

ALIGNED_MIN = 12  # agreed tokens before a copy counts as an established alignment
ANCHOR_MIN = 3    # agreed tokens before a divergence is taken for an edit (not a coincidence that ended)
BACK = 4          # a resync may restart this many source tokens before the anchor (a repeat)
AHEAD = 48        # ... or this many after it (a deletion or a replacement)
MAX_LOST = 64     # committed tokens without a resync before the alignment is given up
CONFIRM = 3       # agreed tokens after a resync before it is trusted as the new anchor
REALIGN = 3       # a lookup hit this many times longer than the current run moves the alignment
RULE_MAX = 4      # source tokens an edit may replace to be remembered as a rule


class CopyMatch(NamedTuple):
    state: str               # "aligned" (an established copy), "fresh" (a lookup hit) or "none"
    run: int                 # tokens agreed since the copy (re)started
    continuation: list[int]  # what the source says comes next
    in_prompt: bool          # the source lies in the prompt (not in generated text)
    risk: tuple[float, ...] = ()  # per continuation token: how often an edit began at such a place
    # where the continuation comes from when not the context: "memory" (an earlier answer in the
    # draft memory, recall.py) or "quoted" (a text of the prompt as a JSON string writes it,
    # use_sources); its drafts go by that name
    source: str | None = None


NO_MATCH = CopyMatch("none", 0, [], False)


class CopyDrafter(Drafter):
    """Aligned copy with prompt lookup for fresh starts. As a drafter on its own it proposes
    `gamma` tokens a round; the auto drafter uses `match` and `outcome`."""

    name = "copy"
    forks = True

    def __init__(self, gamma: int = GAMMA, ngram: NgramDrafter | None = None):
        self.gamma = gamma
        self.ngram = ngram if ngram is not None else NgramDrafter()
        self._clear()

    # -- lifecycle --------------------------------------------------------------------------
    def begin(self, tokens: list[int]) -> None:
        self._clear()
        self.ngram.begin(tokens)
        self.prompt_len = self.seen = len(tokens)

    def use_memory(self, memory) -> None:
        """Its lookups draw on this draft memory (recall.DraftMemory) too."""
        self.ngram.use_memory(memory)

    def use_sources(self, sources) -> None:
        """This generation's lookups also draw on `sources`: the prompt's texts as a call's JSON
        string writes them, indexed as a draft memory is (`DraftMemory.of_sources`, built with the
        prompt, off the engine thread; read-only here). `begin` and `end` forget them."""
        self.sources = sources

    def end(self, tokens: list[int]) -> None:
        self.ngram.end(tokens)
        self.sources = None

    def reset(self) -> None:
        """Forget the request, what it learnt, and the draft memory's answers."""
        self.ngram.reset()
        self._clear()

    def _clear(self) -> None:
        self.prompt_len = self.seen = 0
        self.sources: DraftMemory | None = None
        self._drop()
        self.last: tuple[int, CopyMatch] | None = None
        # per kind of source place (the token itself, the two before it): [edits begun, copied]
        self.edits: dict[tuple, list[int]] = {}
        # edits seen: source tokens -> [replacement, times it held, times it did not]
        self.rules: dict[tuple, list] = {}
        self.rule_firsts: dict[int, set] = {}

    def _drop(self) -> None:
        self.src: int | None = None     # position of the source token the copy expects next
        self.diverged = False           # the output has left the source (an edit is under way)
        self.anchor: int | None = None  # source position where the last edit began, until a resync holds
        self.edit_out = 0               # output position where that edit began
        self.run = 0                    # tokens agreed since the copy (re)started
        self.copied = 0                 # tokens agreed since this alignment began
        self.lost = 0                   # tokens committed since the edit began
        self.sub: tuple | None = None   # a remembered edit being replayed: (key, value, tokens done)

    # -- following the output ---------------------------------------------------------------
    def advance(self, tokens: list[int]) -> None:
        """Fold the tokens committed since the last call into the alignment."""
        for p in range(self.seen, len(tokens)):
            self._step(tokens, p)
        self.seen = len(tokens)

    def _agree(self) -> None:
        self.run += 1
        self.copied += 1
        if self.run >= CONFIRM:
            self.anchor = None

    def _step(self, tokens: list[int], p: int) -> None:
        t = tokens[p]
        if self.src is None:
            return
        if not self.diverged:
            if self.sub is not None:  # replaying a remembered edit
                key, value, done = self.sub
                rule = self.rules[key]
                if t == value[done]:
                    self._agree()
                    if done + 1 < len(value):
                        self.sub = (key, value, done + 1)
                    else:
                        self.src, self.sub = self.src + len(key), None
                        rule[1] += 1
                    return
                rule[2] += 1  # not this time: an edit of its own starts here
                self.sub = None
            elif self.src < p and tokens[self.src] == t:
                self._count(tokens, self.src, 1)
                for key in self.rule_firsts.get(t, ()):  # a remembered edit not made here
                    if tuple(tokens[self.src:self.src + len(key)]) == key:
                        self.rules[key][2] += 1
                self.src += 1
                self._agree()
                return
            else:
                hit = self._rule_at(tokens, self.src, p, t)
                if hit is not None:  # the output makes an edit it made before
                    self.sub = (hit, self.rules[hit][0], 0)
                    self._step(tokens, p)
                    return
            if self.anchor is not None:    # a resync that did not hold: look on from the old anchor
                self.lost += self.run
            elif self.copied >= ANCHOR_MIN:  # a copy that held: the edit starts here
                self.anchor, self.lost, self.edit_out = self.src, 0, p
                self._count(tokens, self.src, 0)
            else:                          # a short match that ended: a coincidence
                self._drop()
                return
            self.diverged, self.run = True, 0
        self.lost += 1
        hit = self._resync(tokens, p)
        if hit is not None:
            j, m = hit
            self._remember(tokens, p, j, m)
            self.src, self.run, self.diverged = j + 1, m, False
            self.copied += m
        elif self.lost > MAX_LOST:
            self._drop()

    # -- edits made once are made again (a rename, the same change to every function) ---------
    def _remember(self, tokens: list[int], p: int, j: int, m: int) -> None:
        """At a resync: the source tokens the edit replaced and the output that replaced them
        become a rule, replayed wherever the source has them again."""
        old = tuple(tokens[self.anchor:j - m + 1])
        new = tuple(tokens[self.edit_out:p - m + 1])
        if 1 <= len(old) <= RULE_MAX and 1 <= len(new) <= 2 * RULE_MAX and old != new:
            self.rules[old] = [new, 0, 0]
            self.rule_firsts.setdefault(old[0], set()).add(old)

    def _rule_at(self, tokens: list[int], q: int, end: int, first: int | None = None) -> tuple | None:
        """A remembered edit whose source tokens start at q (and end before `end`), whose
        replacement starts with `first` if given; None when none applies or they failed more
        often than they held."""
        for key in self.rule_firsts.get(tokens[q], ()):
            new, held, failed = self.rules[key]
            if (failed <= held and tuple(tokens[q:q + len(key)]) == key and q + len(key) <= end
                    and (first is None or new[0] == first)):
                return key
        return None

    @staticmethod
    def _places(tokens: list[int], j: int) -> tuple[tuple, ...]:
        """What an edit made at source position j is remembered by: the token there (a renamed
        name, a changed bracket) and the two before it (where insertions go, after "):\n  ")."""
        return (("at", tokens[j]), ("after", tokens[j - 2], tokens[j - 1]) if j >= 2 else ("after",))

    def _count(self, tokens: list[int], j: int, copied: int) -> None:
        for key in self._places(tokens, j):
            self.edits.setdefault(key, [0, 0])[copied] += 1

    def _risk(self, tokens: list[int], j: int) -> float:
        """How often an edit began at places like source position j in this generation."""
        risk = 0.0
        for key in self._places(tokens, j):
            e = self.edits.get(key)
            if e and e[0]:
                risk = max(risk, e[0] / (e[0] + e[1] + 1))
        return risk

    def _resync(self, tokens: list[int], p: int) -> tuple[int, int] | None:
        """(source position, tokens agreeing) where the output's newest tokens meet the source
        again near the anchor; the longest agreement wins, then the nearest position. A far
        single-token meeting is likely a coincidence and needs more agreeing tokens."""
        t, a = tokens[p], self.anchor
        best = None
        for j in range(max(0, a - BACK), min(a + AHEAD, p)):
            if tokens[j] != t:
                continue
            m = 1
            while m < min(self.lost, 8) and j - m >= 0 and tokens[j - m] == tokens[p - m]:
                m += 1
            need = 1 if j - a <= 8 else 2 if j - a <= 24 else 3
            if m >= need and (best is None or (m, -abs(j - a)) > (best[1], -abs(best[0] - a))):
                best = (j, m)
        return best

    # -- proposals --------------------------------------------------------------------------
    def match(self, tokens: list[int], limit: int) -> CopyMatch:
        """The copy's continuation of the context, up to `limit` tokens, with the features the
        policy judges it by. A prompt-lookup hit starts (or replaces) the alignment when it
        agrees over more tokens than the current one."""
        self.advance(tokens)
        n, i = self.ngram.index.find(tokens)
        hit = run_length(tokens, i, n) if n else 0
        if hit and i + 1 != self.src and (self.src is None or hit > REALIGN * max(self.run, 1)
                                          or (self.diverged and hit >= REALIGN)):
            # a lookup hit starts an alignment, or replaces one it outgrows (another passage)
            self._drop()
            self.src, self.run, self.copied = i + 1, hit, hit
        if self.src is not None and not self.diverged:
            cont, places = self._continuation(tokens, limit)
            state = "aligned" if self.copied >= ALIGNED_MIN else "fresh"
            risk = tuple(j if isinstance(j, float) else self._risk(tokens, j) for j in places)
            m = CopyMatch(state, self.run, cont, self.src < self.prompt_len, risk)
        elif hit:  # inside an edit: a lookup hit elsewhere is offered, the anchor is kept
            m = CopyMatch("fresh", hit, tokens[i + 1:i + 1 + limit], i + 1 < self.prompt_len)
        else:
            m = NO_MATCH
        if not m.continuation:
            m = NO_MATCH
        # an earlier answer, or the prompt's text as the answer's JSON string quotes it, that agrees
        # with the context for longer: judged as a prompt lookup hit is (a copy of given text); a
        # quoted one is a file written again rather than a value, so once it agrees as long as an
        # aligned copy does it is judged as one (the policy's table of long copies)
        for source, origin in ((self.ngram.memory, "memory"), (self.sources, "quoted")):
            r = source.match(tokens, limit) if source is not None else None
            if r is not None and prefer(m.run, m.continuation, r):
                state = "aligned" if origin == "quoted" and r.run >= ALIGNED_MIN else "fresh"
                m = CopyMatch(state, r.run, r.continuation, True, source=origin)
        self.last = (len(tokens), m) if m.continuation else None
        return m

    def _continuation(self, tokens: list[int], limit: int) -> tuple[list[int], list]:
        """The source from the alignment on, with remembered edits applied; and per token its
        source position (an int), or inside a replayed edit the chance it is not made (a float)."""
        out: list[int] = []
        places: list = []
        q = self.src
        if self.sub is not None:
            key, value, done = self.sub
            out += value[done:]
            places += [0.0] * (len(value) - done)
            q += len(key)
        end = len(tokens)
        while len(out) < limit and q < end:
            key = self._rule_at(tokens, q, end)
            if key is not None:
                value, held, failed = self.rules[key]
                out += value
                # a replayed edit is as likely to be made again as it was before (Laplace)
                places += [(failed + 1) / (held + failed + 2)] + [0.0] * (len(value) - 1)
                q += len(key)
            else:
                out.append(tokens[q])
                places.append(q)
                q += 1
        return out[:limit], places[:limit]

    def propose(self, tokens, room, params, rng, guide=None) -> Draft:
        # point masses: the engine cuts them at the first token a constraint forbids
        m = self.match(tokens, min(self.gamma, room))
        return Draft(m.continuation, None, m.source or self.name)

    def outcome(self, tokens: list[int]) -> tuple[CopyMatch, int, int] | None:
        """How the last proposal fared against what was committed since:
        (its match, tokens matched before the first miss, tokens compared)."""
        if self.last is None:
            return None
        start, m = self.last
        self.last = None
        return (m, *agreed(m.continuation, tokens, start))

    def observe(self, round: Round) -> None:
        self.advance(round.tokens)

    def fork(self, seq: int) -> "CopyDrafter":
        """A drafter like this one for another sequence (its own index and alignment)."""
        return CopyDrafter(self.gamma, self.ngram.fork(seq))

    def close(self) -> None:
        pass
