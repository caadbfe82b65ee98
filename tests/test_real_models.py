"""Real GGUF models through real llama.cpp: SmolLM2-135M (+ a truncated copy as draft) and,
marked `qwen`, the Qwen2.5-Coder 1.5B/0.5B pair."""
import json

import numpy as np
import psutil
import pytest

from edgespec import Engine
from edgespec.backend import default_threads

from edgespec.sampling import SamplingParams, warp
from edgespec.slots import PIECE
from chisq import chi2_pvalue
from tables import one_table

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences what a mutex is.",
]


def llama_cpp_greedy(path, prompt_tokens, n, n_ctx=1024, flash_attn=False):
    """Plain greedy decoding by llama-cpp-python's own high-level Llama: the reference."""
    import llama_cpp
    llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, verbose=False, n_threads=default_threads(), flash_attn=flash_attn)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    out = []
    for tok in llm.generate(prompt_tokens, top_k=1, temp=0.0, repeat_penalty=1.0):
        if llama_cpp.llama_vocab_is_eog(vocab, tok):
            break
        out.append(tok)
        if len(out) >= n:
            break
    llm.close()
    return out


@pytest.mark.parametrize("flash_attn", ["auto", "off"])
def test_plain_decoding_equals_llama_cpp_python_greedy(smol, flash_attn):
    # exactness is defined against the same configuration: auto is on for llama.cpp's CPU backend
    with Engine.load(str(smol), drafter="none", n_ctx=1024, flash_attn=flash_attn) as eng:
        for prompt in PROMPTS:
            ptoks = eng.chat_tokens([{"role": "user", "content": prompt}])
            ours = eng.generate(ptoks, max_tokens=48).tokens
            assert len(ours) >= 16
            assert ours == llama_cpp_greedy(smol, ptoks, 48, flash_attn=flash_attn != "off")


# llama.cpp computes a multi-token batch with other kernels than a single token, so logits of
# a verified row differ from plain decoding's in their last bits (measured here: up to 0.97 on
# SmolLM2 Q4_1, 0.67 on Qwen Q4_K_M, over 40 positions; llama.cpp issues #25618, #27407).
# Greedy speculative output therefore equals plain greedy output token for token except from a
# near-tie on: where they part, the two tokens' plain logits must be within NEAR_TIE.
NEAR_TIE = 0.5


def plain_greedy_with_logits(backend, ptoks, n):
    backend.reset()
    row = backend.eval(ptoks, [len(ptoks) - 1])[0]
    out, rows = [], []
    for _ in range(n):
        tok = int(np.argmax(row))
        if backend.is_eog(tok):
            break
        out.append(tok)
        rows.append(row)
        row = backend.eval([tok], [0])[0]
    backend.reset()
    return out, rows


def assert_equal_up_to_a_near_tie(spec, plain, rows, eos):
    """Returns where the outputs part (None when identical)."""
    i = next((i for i, (s, p) in enumerate(zip(spec, plain)) if s != p), None)
    if i is None:
        if len(spec) == len(plain):
            return None
        i = len(spec)  # speculative decoding stopped: it chose end-of-generation there
    s = spec[i] if i < len(spec) else eos
    gap = float(rows[i][plain[i]] - rows[i][s])
    assert gap < NEAR_TIE, f"token {i}: speculative chose {s}, plain {plain[i]}, logit gap {gap:.3f}"
    return i


def _greedy_spec_vs_plain(target, draft, n, gamma, drafter="model", prompts=PROMPTS):
    parted = []
    with Engine.load(str(target), draft=str(draft) if draft else None, drafter=drafter, n_ctx=1024,
                     gamma=gamma) as eng:
        for prompt in prompts:
            ptoks = eng.chat_tokens([{"role": "user", "content": prompt}])
            plain, rows = plain_greedy_with_logits(eng.target, ptoks, n)
            eng.reset()
            r = eng.generate(ptoks, max_tokens=len(plain))
            assert r.stats.drafted > 0
            parted.append(assert_equal_up_to_a_near_tie(r.tokens, plain, rows, eng.target.eos))
    return parted


def test_speculative_greedy_equals_plain_greedy_smollm2(smol, smol_draft):
    parted = _greedy_spec_vs_plain(smol, smol_draft, 48, gamma=3)
    # a pass that parts at token 0 would say nothing: the outputs agree for a while first
    # (measured here: identical on both prompts, or parting late at a near-tie)
    assert all(p is None or p >= 8 for p in parted), parted


def test_ngram_greedy_equals_plain_greedy_smollm2(smol):
    parted = _greedy_spec_vs_plain(smol, None, 48, gamma=4, drafter="ngram")
    assert all(p is None or p >= 8 for p in parted), parted


@pytest.mark.qwen
def test_speculative_greedy_equals_plain_greedy_qwen_pair(qwen_pair):
    # the code prompt only: it has no near-tie in its first 32 tokens, so the outputs must be identical
    # (the chat prompt's parting at a near-tie is SmolLM2's case above; on this pair it cost 9 s more)
    assert _greedy_spec_vs_plain(*qwen_pair, 32, gamma=4, prompts=PROMPTS[:1]) == [None]


@pytest.mark.slow
def test_kv_caches_hold_exactly_the_committed_tokens_and_rss_stays_flat_over_150_generations(smol, smol_draft):
    """After every round of one sampled generation that crosses a 128-token piece and of 150 short
    ones (a prompt, then drafts of up to two tokens, some rejected), both KV caches hold exactly the
    committed tokens; the process's memory does not grow with generations or with rejected drafts
    (the fake-backend test checks 1,000 rounds position by position). One test for what were two:
    the same rounds prove both."""
    # parallel=1: every generation on sequence 0, so eng.drafter is the lane that observes each round
    with Engine.load(str(smol), draft=str(smol_draft), drafter="model", n_ctx=512, gamma=2, parallel=1) as eng:
        target, drafter = eng.target, eng.drafter
        checks = []
        observe = drafter.observe

        def checked_observe(round):
            observe(round)
            tokens = round.tokens
            # the target holds every committed token but the newest (fed next round)
            checks.append((target.pos_max(), len(tokens) - 2, target.tokens == tokens[:-1],
                           drafter.backend.pos_max(), drafter.backend.n_past - 1,
                           drafter.backend.tokens == tokens[:drafter.backend.n_past]))
        drafter.observe = checked_observe
        rss = []
        proc = psutil.Process()
        story = "Once upon a time, the sea was calm and the ship sailed on. " * 8  # 113 tokens
        r = eng.generate(story, max_tokens=48, temperature=1.0, seed=1)
        assert r.stats.prompt_tokens < PIECE < checks[-1][0]  # it went on past a piece
        ptoks = eng.tokenize("List some fruits:")
        drafted = accepted = 0
        for i in range(150):
            r = eng.generate(ptoks, max_tokens=3, temperature=1.0, seed=i)
            drafted, accepted = drafted + r.stats.drafted, accepted + r.stats.accepted
            if i in (49, 149):
                rss.append(proc.memory_info().rss)
        assert len(checks) >= 150
        assert 0 < accepted < drafted  # drafts were accepted, and rejected ones cut back
        for t_max, want, t_same, d_max, d_want, d_same in checks:
            assert t_max == want and t_same
            assert d_max == d_want and d_same and d_max <= want
    # over the last 100 generations: a leak of 82 KiB a generation fails
    assert rss[1] - rss[0] < 8 * 2**20, [r / 2**20 for r in rss]


def _exact_first_two(eng, ptoks, params):
    """Exact marginals of the first two tokens, from the target's own logits.

    llama.cpp's batched kernels round differently from its single-token ones, so the rows
    are computed exactly as the engine computes them for every draw that follows: the prompt
    evaluated in one batch (its last row kept and reused by every repeat of the request), and
    the first generated token alone (gamma = 1, max_tokens = 2: drafted and accepted, or
    sampled after a rejection).
    """
    t = eng.target
    t.reset()
    p1 = warp(t.eval(ptoks, [len(ptoks) - 1])[0], params).astype(np.float64)
    p2 = np.zeros_like(p1)
    for x in np.flatnonzero(p1):
        t.truncate(len(ptoks))
        p2 += p1[x] * warp(t.eval([int(x)], [0])[0], params)
    eng.reset()
    return p1, p2


@pytest.mark.slow
def test_t1_first_two_tokens_follow_the_target_law_on_real_models(smol, smol_draft):
    """600 draws of the first two tokens with a genuinely different draft; the chi-square
    p-value of each marginal must exceed 1e-4 (a correct sampler fails one of the two with
    probability 2e-4). Longer drafts and every filter are covered on the fake backend, exactly
    (tests/test_verify_exact.py, test_exact_fake.py): this checks the real models' rows reach it."""
    params = SamplingParams(temperature=1.0, top_k=12, top_p=0.97, min_p=0.01)
    n = 600
    with Engine.load(str(smol), draft=str(smol_draft), drafter="model", n_ctx=256, gamma=1) as eng:
        ptoks = eng.tokenize("The sea is")  # short: the draft evaluates the prompt again every draw
        p1, p2 = _exact_first_two(eng, ptoks, params)
        rng = np.random.default_rng(12345)
        c1 = np.zeros_like(p1)
        c2 = np.zeros_like(p2)
        drafted = accepted = 0
        kw = dict(max_tokens=2, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                  min_p=params.min_p)
        for _ in range(n):
            r = eng.generate(ptoks, seed=int(rng.integers(2**63)), **kw)
            c1[r.tokens[0]] += 1
            c2[r.tokens[1]] += 1
            drafted += r.stats.drafted
            accepted += r.stats.accepted
    assert 0.05 < accepted / drafted < 0.95  # both acceptance and rejection were exercised
    assert chi2_pvalue(c1, p1) > 1e-4
    assert chi2_pvalue(c2, p2) > 1e-4


def test_stream_text_equals_generate_text_and_marks_draft_tokens(smol, smol_draft):
    with Engine.load(str(smol), draft=str(smol_draft), drafter="model", n_ctx=512, gamma=3) as eng:
        r = eng.generate("Paris is the capital of", max_tokens=40)
        stream = eng.stream("Paris is the capital of", max_tokens=40)
        events = list(stream)
    assert stream.stats.reused_prompt_tokens == stream.stats.prompt_tokens  # the repeat reused the cache
    assert events[-1].finish_reason == stream.finish_reason == r.finish_reason
    assert "".join(e.text for e in events) == r.text
    assert [e.token for e in events] == r.tokens + [None]  # then the closing event
    assert sum(e.from_draft for e in events) == r.stats.accepted
    s = r.stats.as_dict()
    for key in ("drafted", "accepted", "acceptance_rate", "target_forwards", "generated",
                "tokens_per_second", "drafter", "accept_histogram"):
        assert key in s
    assert s["generated"] == len(r.tokens) and s["drafter"] == "model"
    hist = s["accept_histogram"]
    # every round drafted except perhaps the last, which has room for one token only
    assert sum(hist) in (s["rounds"], s["rounds"] - 1)
    assert sum(n * c for n, c in enumerate(hist)) == s["accepted"]
    assert json.loads(json.dumps(s)) == s


EDIT = ("Rename the variable `total` to `acc` everywhere in this function and show the whole function:\n\n"
        "def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    if not xs:\n"
        "        return 0\n    return total / len(xs)\n")


@pytest.mark.qwen
def test_bit_exact_equals_plain_and_the_default_repeats_itself_qwen_pair(qwen_pair, own_tables):
    """Issue 39. With bit_exact auto keeps every pass within the rows this build computes as a
    single-token decode does, and its T = 0 tokens equal plain decoding's, bit for bit, also on an
    edit, where the default drafts long copies beyond that limit. The default's decisions are a
    function of the request: the same request twice on one engine, and on a second engine, gives
    the same tokens (timings measured meanwhile cannot change a draft)."""
    target, draft = qwen_pair
    n = 40
    # the edit only: on the code prompt auto drafted one token in 39 rounds here (measured), so bit
    # for bit it was plain decoding against itself
    with Engine.load(str(target), draft=str(draft), n_ctx=1024, bit_exact=True) as eng:
        ptoks = eng.chat_tokens([{"role": "user", "content": EDIT}])
        plain, _ = plain_greedy_with_logits(eng.target, ptoks, n)
        eng.reset()
        r = eng.generate(ptoks, max_tokens=len(plain))
        assert r.tokens == plain
        assert r.stats.costs["bit_exact"] is True
        # drafts within the limit were taken, so it was not plain decoding against itself (where a
        # single row is all this build computes as a decode does, an F16 target, auto never drafts)
        if r.stats.costs["exact_rows"] > 1:
            assert r.stats.accepted > 0
    runs = []
    for repeats in (2, 1):  # twice on one engine, once on a second
        with one_table(Engine.load(str(target), draft=str(draft), n_ctx=1024)) as eng:
            # no correction adopted or written back meanwhile (one that holds would change the
            # table decided on, as said in docs/exactness.md): both engines decide on one table
            ptoks = eng.chat_tokens([{"role": "user", "content": EDIT}])
            for _ in range(repeats):
                r = eng.generate(ptoks, max_tokens=n)
                assert r.stats.costs["reproducible"] is True and r.stats.costs["bit_exact"] is False
                runs.append((r.tokens, {k: (v["rounds"], v["drafted"], v["accepted"])
                                        for k, v in r.stats.by_drafter.items()}))
    assert all(run == runs[0] for run in runs)  # the same tokens, from the same drafts
    assert runs[0][1].get("copy", (0,))[0] + runs[0][1].get("ngram", (0,))[0] > 0  # it copied
