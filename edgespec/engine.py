"""The speculative loop: draft, verify in one target pass, commit, cut both KV caches."""
from __future__ import annotations

import codecs
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from .errors import BackendError, UsageError
from .sampling import SamplingParams, verify, verify_greedy, warp

DRAFTER_MODES = ("auto", "model", "ngram", "none")
DEFAULT_GAMMA = 4


def check_drafter(mode: str) -> None:
    if mode not in DRAFTER_MODES:
        raise UsageError(f"unknown drafter {mode!r}; choose one of {', '.join(DRAFTER_MODES)}")


@dataclass
class GenerationStats:
    drafter: str
    prompt_tokens: int = 0
    generated: int = 0
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    target_forwards: int = 0
    accept_histogram: list[int] = field(default_factory=list)  # [n] = rounds that accepted n drafts
    by_drafter: dict = field(default_factory=dict)  # name -> {"rounds", "drafted", "accepted"}
    prompt_seconds: float = 0.0
    decode_seconds: float = 0.0
    finish_reason: str = ""

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Decode phase only: generated tokens over the time after the prompt was processed."""
        return self.generated / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["acceptance_rate"] = round(self.acceptance_rate, 4)
        d["tokens_per_second"] = round(self.tokens_per_second, 2)
        return d

    def summary(self) -> str:
        s = (f"{self.generated} tokens, {self.tokens_per_second:.1f} tok/s, "
             f"prompt {self.prompt_tokens} tok in {self.prompt_seconds:.2f}s, "
             f"{self.target_forwards} target passes, drafter {self.drafter}")
        if self.drafted:
            s += f", accepted {self.accepted}/{self.drafted} ({100 * self.acceptance_rate:.0f}%)"
        if self.drafter == "auto":
            s += " [" + ", ".join(f"{k}: {v['rounds']} rounds" + (f" {v['accepted']}/{v['drafted']}" if v["drafted"] else "")
                                  for k, v in sorted(self.by_drafter.items())) + "]"
        return s


@dataclass(frozen=True)
class GenerationResult:
    text: str
    tokens: list[int]
    stats: GenerationStats


@dataclass(frozen=True)
class StreamEvent:
    text: str          # text that became printable with this token (may be empty)
    token: int
    from_draft: bool   # the token was a draft the target accepted


def _fit_budget(t_info, draft_path, drafter, n_ctx, budget):
    """Drop the draft model (for n-grams) when it does not fit the memory budget; say so once."""
    from .ggufinfo import read_info
    from .memory import estimate_process, parse_size
    budget = parse_size(budget) if isinstance(budget, str) else int(budget)
    d_info = read_info(draft_path) if draft_path else None
    wanted = "model" if draft_path else ("ngram" if drafter in ("auto", "ngram") else "none")
    for mode in dict.fromkeys([wanted, "ngram" if drafter in ("auto", "model") else wanted, "none"]):
        need = estimate_process(t_info, d_info, n_ctx=n_ctx, drafter=mode)["total"]
        if need <= budget:
            if mode != wanted:
                print(f"edgespec: the draft model does not fit in {budget / 2**30:.2f} GiB "
                      f"({estimate_process(t_info, d_info, n_ctx=n_ctx, drafter=wanted)['total'] / 2**30:.2f} GiB "
                      f"needed); using {mode} drafting instead", file=sys.stderr)
                return ("auto" if drafter == "auto" and mode == "ngram" else mode), None
            return drafter, draft_path
    raise UsageError(f"{t_info.path.name} does not fit in {budget / 2**30:.2f} GiB even without a drafter "
                     f"at n_ctx {n_ctx}: lower --ctx or raise --memory-budget (see `edgespec plan`)")


def _pad(rows: np.ndarray, width: int) -> np.ndarray:
    if rows.shape[1] == width:
        return rows
    out = np.full((rows.shape[0], width), -np.inf, dtype=np.float32)
    out[:, : rows.shape[1]] = rows[:, :width]
    return out


class Engine:
    """A target model and an optional drafter. Use `Engine.load` to build one from GGUF files."""

    def __init__(self, target, drafter=None, *, gamma: int = DEFAULT_GAMMA, n_vocab: int | None = None,
                 ngram=None, policy=None):
        """`drafter` (a draft model) and/or `ngram` propose; with a `policy` (auto mode) each
        round picks the drafter and draft length, otherwise the one drafter drafts `gamma`."""
        self.target = target
        self.drafter = drafter
        self.ngram = ngram
        self.policy = policy
        self.gamma = gamma
        self.n_vocab = n_vocab or target.n_vocab
        self.last_stats: GenerationStats | None = None
        if (drafter is not None or ngram is not None) and not target.can_truncate:
            if drafter is not None:
                drafter.close()
            raise UsageError(f"{target.path.name} is a recurrent or hybrid model whose cache cannot be "
                             "cut back after a rejected draft: speculation is impossible, use --drafter none")

    @property
    def mode(self) -> str:
        if self.policy is not None:
            return "auto"
        return "model" if self.drafter else "ngram" if self.ngram else "none"

    @classmethod
    def load(cls, target: str, draft: str | None = None, drafter: str = "auto", *,
             n_gpu_layers: int = -1, draft_n_gpu_layers: int = -1, n_ctx: int = 4096,
             threads: int | None = None, gamma: int = DEFAULT_GAMMA, verbose: bool = False,
             models_file: str | None = None, memory_budget: int | str | None = None) -> "Engine":
        """Load a target (GGUF path or models.toml pair name) and, if wanted, its draft model."""
        from .backend import LlamaBackend
        from .calibrate import load_or_measure
        from .drafters.model import ModelDrafter
        from .drafters.ngram import NgramDrafter
        from .policy import Policy
        from .ggufinfo import check_pair, read_info
        from .hub import resolve

        check_drafter(drafter)
        if not (isinstance(n_ctx, int) and n_ctx >= 16):
            raise UsageError(f"n_ctx must be an integer >= 16, got {n_ctx!r}")
        if not (isinstance(gamma, int) and 1 <= gamma <= 32):
            raise UsageError(f"gamma (draft length) must be an integer in 1..32, got {gamma!r}")
        target_path, pair_draft = resolve(target, models_file=models_file)
        draft_path = (draft or pair_draft) if drafter in ("auto", "model") else None
        if drafter == "model" and not draft_path:
            raise UsageError("--drafter model needs a draft: pass --draft PATH or a pair that has one")
        t_info = read_info(target_path)
        if draft_path:
            check_pair(target_path, draft_path)  # before any weights are loaded
        if memory_budget is not None:
            drafter, draft_path = _fit_budget(t_info, draft_path, drafter, n_ctx, memory_budget)
        tb = LlamaBackend(target_path, n_ctx=n_ctx, n_gpu_layers=n_gpu_layers, threads=threads,
                          verbose=verbose)
        db = None
        if drafter == "auto" and not tb.can_truncate:
            print(f"edgespec: {Path(target_path).name} is a recurrent or hybrid model; its cache cannot be "
                  "cut back after a rejection, so it decodes without speculation", file=sys.stderr)
            drafter, draft_path = "none", None
        try:
            if draft_path:
                db = LlamaBackend(draft_path, n_ctx=n_ctx, n_gpu_layers=draft_n_gpu_layers,
                                  threads=threads, verbose=verbose)
            n_vocab = max(tb.n_vocab, db.n_vocab) if db else tb.n_vocab
            model_drafter = ModelDrafter(db, n_vocab) if db else None
            ngram = NgramDrafter() if drafter in ("auto", "ngram") else None
            policy = None
            if drafter == "auto":
                policy = Policy(load_or_measure(tb, db))
            return cls(tb, model_drafter, gamma=gamma, n_vocab=n_vocab, ngram=ngram, policy=policy)
        except BaseException:
            if db is not None:
                db.close()
            tb.close()
            raise

    # -- lifecycle ------------------------------------------------------------------------
    def reset(self) -> None:
        """Start the next generation from nothing: empty KV caches (no reused prompt prefix)
        and, in auto mode, the policy's priors instead of what earlier generations taught it."""
        self.target.reset()
        if self.drafter is not None:
            self.drafter.backend.reset()
        if self.policy is not None:
            self.policy.reset()

    def close(self) -> None:
        if self.drafter is not None:
            self.drafter.close()
        self.target.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- generation -----------------------------------------------------------------------
    def generate(self, prompt: str, **kwargs) -> GenerationResult:
        """Generate from a verbatim prompt; keyword arguments as `stream`."""
        return self._collect(self.stream(prompt, **kwargs))

    def _collect(self, events) -> GenerationResult:
        tokens, parts = [], []
        for ev in events:
            tokens.append(ev.token)
            parts.append(ev.text)
        return GenerationResult(text="".join(parts), tokens=tokens, stats=self.last_stats)

    def stream(self, prompt: str, **kwargs) -> Iterator[StreamEvent]:
        """Yield tokens as they are committed, with the text each makes printable.

        The prompt is tokenized verbatim (BOS added, special tokens parsed). Keyword arguments:
        max_tokens=128, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=None, stop=().
        Generation ends at an end-of-generation token, after `max_tokens`, or at a stop string
        (not included). Statistics of the finished request are in `engine.last_stats`.
        """
        return self._stream_prompt(self.target.tokenize(prompt, add_bos=True, special=True), **kwargs)

    def format_chat(self, messages) -> str:
        """The target's chat template applied to `messages` (list of {'role', 'content'})."""
        from .chat import render
        t = self.target
        return render(t.chat_template(), messages, bos_token=t.token_text(t.bos) if t.bos >= 0 else "",
                      eos_token=t.token_text(t.eos) if t.eos >= 0 else "")

    def stream_chat(self, messages, **kwargs) -> Iterator[StreamEvent]:
        """`stream` for a conversation, through the target's chat template."""
        tokens = self.target.tokenize(self.format_chat(messages), add_bos=True, special=True)
        if len(tokens) > 1 and tokens[0] == tokens[1] == self.target.bos:
            tokens = tokens[1:]  # the template wrote BOS and the tokenizer added one
        return self._stream_prompt(tokens, **kwargs)

    def chat(self, messages, **kwargs) -> GenerationResult:
        """`generate` for a conversation, through the target's chat template."""
        return self._collect(self.stream_chat(messages, **kwargs))

    def _stream_prompt(self, prompt_tokens: list[int], max_tokens: int = 128, temperature: float = 0.0,
                       top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None,
                       stop: Sequence[str] = ()) -> Iterator[StreamEvent]:
        params = SamplingParams(temperature, top_k, top_p, min_p)
        if not (isinstance(max_tokens, int) and max_tokens >= 1):
            raise UsageError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        stop = tuple(s for s in ((stop,) if isinstance(stop, str) else stop) if s)
        return self._stream_tokens(prompt_tokens, max_tokens, params, seed, stop)

    def _stream_tokens(self, prompt_tokens, max_tokens, params, seed, stop):
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        hold = max((len(s) for s in stop), default=1) - 1  # chars that may start a stop string
        text = ""        # decoded, not yet emitted
        prev = None      # one event of lookahead, so the final flush has a token to ride on
        gen = self.generate_tokens(prompt_tokens, max_tokens, params, seed)
        try:
            for token, from_draft in gen:
                text += decoder.decode(self.target.token_to_piece(token))
                hit = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
                if hit >= 0:
                    if prev:
                        yield prev
                    yield StreamEvent(text[:hit], token, from_draft)
                    self.last_stats.finish_reason = "stop"
                    return
                cut = max(0, len(text) - hold)
                if prev:
                    yield prev
                prev, text = StreamEvent(text[:cut], token, from_draft), text[cut:]
            if prev:
                yield StreamEvent(prev.text + text + decoder.decode(b"", final=True), prev.token,
                                  prev.from_draft)
        finally:
            gen.close()

    def generate_tokens(self, prompt_tokens: list[int], max_tokens: int, params: SamplingParams,
                        seed: int | None = None) -> Iterator[tuple[int, bool]]:
        """The speculative loop over token ids: yields (token, from_draft) as they are committed."""
        target, model, ngram, policy = self.target, self.drafter, self.ngram, self.policy
        n_ctx = target.n_ctx
        if not prompt_tokens:
            raise UsageError("the prompt is empty after tokenization")
        if len(prompt_tokens) >= n_ctx:
            raise UsageError(f"the prompt is {len(prompt_tokens)} tokens but the context holds {n_ctx}: "
                             "raise --ctx or shorten the prompt")
        rng = np.random.default_rng(seed)
        max_gamma = policy.max_gamma if policy else self.gamma
        stats = GenerationStats(drafter=self.mode, prompt_tokens=len(prompt_tokens),
                                accept_histogram=[0] * (max_gamma + 1))
        self.last_stats = stats
        tokens = list(prompt_tokens)

        # Prefill the prompt in one batch, as plain llama.cpp decoding does (a token's KV
        # depends, in its last bits, on the batch it was computed in), keeping the last row.
        t0 = time.perf_counter()
        kept = target.keep_prefix(tokens)
        carry = target.eval(tokens[kept:], [len(tokens) - kept - 1])
        stats.target_forwards += 1
        for d in (model, ngram):
            if d is not None:
                d.begin(tokens)
        t1 = time.perf_counter()
        stats.prompt_seconds = t1 - t0
        try:
            while stats.generated < max_tokens and len(tokens) < n_ctx:
                room = min(max_gamma, max_tokens - stats.generated - 1, n_ctx - len(tokens) - 1)
                name, drafts, q = self._draft(tokens, room, params, rng)
                if carry is not None:  # first round: the last prompt row is already computed
                    logits = np.concatenate([carry, target.eval(drafts, range(len(drafts)))]) if drafts else carry
                    stats.target_forwards += bool(drafts)
                    carry = None
                else:
                    pending = tokens[target.n_past:]
                    feed = pending + drafts
                    logits = target.eval(feed, range(len(pending) - 1, len(feed)))
                    stats.target_forwards += 1
                if params.greedy:
                    n, y = verify_greedy(drafts, logits)
                else:
                    n, y = verify(drafts, warp(_pad(logits, self.n_vocab), params), q, rng)
                new = drafts[:n] + [y]
                if not target.truncate(len(tokens) + n):
                    raise BackendError("the target's KV cache could not be cut back")
                tokens.extend(new)
                self._after_round(tokens, name, drafts, n, stats)
                for i, tok in enumerate(new):
                    if target.is_eog(tok):
                        stats.finish_reason = "eos"
                        return
                    stats.generated += 1
                    stats.decode_seconds = time.perf_counter() - t1
                    yield tok, i < n
                    if stats.generated >= max_tokens:
                        break
            stats.finish_reason = "length" if stats.generated >= max_tokens else "context"
        finally:
            stats.decode_seconds = time.perf_counter() - t1

    def _draft(self, tokens, room, params, rng):
        """(drafter name, draft tokens, q rows or None) for this round."""
        if room <= 0:
            return "none", [], None
        if self.policy is None:  # one drafter, fixed length
            d = self.drafter or self.ngram
            if d is None:
                return "none", [], None
            drafts, q = d.propose(tokens, room, params, rng)
            return d.name, drafts, q
        n, cont = self.ngram.lookup(tokens, room) if self.ngram else (0, [])
        choice = self.policy.choose((n, len(cont)) if cont else None, self.drafter is not None, room)
        if choice.drafter == "ngram":
            return "ngram", cont[:choice.gamma], None
        if choice.drafter == "model":
            drafts, q = self.drafter.propose(tokens, choice.gamma, params, rng)
            return "model", drafts, q
        return "none", [], None

    def _after_round(self, tokens, name, drafts, n, stats) -> None:
        stats.rounds += 1
        if self.drafter is not None:
            self.drafter.accept(tokens)  # cut the draft's cache back to the committed prefix
        if self.policy is not None:
            if self.ngram is not None and (seen := self.ngram.outcome(tokens)) is not None:
                # scored whether or not it drafted this round: lookups cost nothing
                self.policy.ngram.update(*seen)
            if name == "model":
                self.policy.model.update(n, len(drafts))
        if drafts:
            stats.drafted += len(drafts)
            stats.accepted += n
            stats.accept_histogram[n] += 1
        d = stats.by_drafter.setdefault(name if drafts else "none", {"rounds": 0, "drafted": 0, "accepted": 0})
        d["rounds"] += 1
        d["drafted"] += len(drafts)
        d["accepted"] += n
