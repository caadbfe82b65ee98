"""`bench --kinds structured`: validity, token shares and the hindsight ceiling, on real output
(SmolLM2) and on hand-made cases."""
import json

import pytest
from test_cli import assert_usage_error, run_cli

from edgespec.bench.structured import _copy_lengths, ceiling, shares, validity
from edgespec.engine import GenerationStats
from edgespec.costs import Costs

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "year", "name"],
          "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                         "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                         "name": {"type": "string", "maxLength": 16}}}
PROMPT = ("Extract the fields. Text: Anna Berg moved to Oslo in 2019.\n\nAnswer with JSON matching this "
          "schema: " + json.dumps(SCHEMA))


def test_validity_names_what_is_wrong():
    assert validity('{"city":"Oslo","year":2019,"name":"Anna Berg"}', SCHEMA) == (True, None)
    ok, why = validity('{"city":"Oslo","year":2019', SCHEMA)
    assert not ok and why.startswith("not JSON")
    ok, why = validity('{"city":"Bern","year":2019,"name":"x"}', SCHEMA)
    assert not ok and why.startswith("schema") and "Bern" in why


def test_shares_add_up_and_count_only_emitted_tokens():
    st = GenerationStats("auto", generated=10, by_drafter={
        "grammar": {"rounds": 2, "drafted": 4, "accepted": 4}, "copy": {"rounds": 1, "drafted": 3, "accepted": 2},
        "ngram": {"rounds": 1, "drafted": 1, "accepted": 1}, "none": {"rounds": 3, "drafted": 0, "accepted": 0}})
    assert shares(st) == pytest.approx({"forced": 0.4, "copied": 0.3, "model": 0.0, "sampled": 0.3})
    st.generated = 6  # drafts accepted past max_tokens were never emitted
    s = shares(st)
    assert sum(s.values()) == pytest.approx(1.0) and s["sampled"] == 0.0


def test_copy_lengths_are_the_longest_run_the_context_holds():
    assert _copy_lengths([5, 6, 7, 8], [6, 7, 9, 6, 7, 9]) == [2, 1, 0, 3, 2, 1]


class ScriptedGuide:
    """A constraint whose forced runs and one-legal-token positions are given per position."""

    def __init__(self, forced, single, vocab=8):
        self.forced_at, self.single, self.pos, self.vocab = forced, single, 0, vocab

    def forced(self):
        return list(self.forced_at.get(self.pos, []))

    def allowed(self):
        import numpy as np
        m = np.zeros(self.vocab, bool)
        m[: 1 if self.single[self.pos] else self.vocab] = True
        return m

    def advance(self, toks):
        self.pos += len(toks)


def test_ceiling_prices_forced_and_copied_runs():
    costs = Costs(tuple(0.01 * (1 + 0.25 * (k - 1)) for k in range(1, 17)))
    out = [1, 2, 3, 4, 5, 6, 7, 8]
    # nothing forced, nothing copyable: every model is plain decoding, one pass a token
    free = ScriptedGuide({}, [False] * 8)
    c = ceiling(costs, free, [0], out)
    assert c["ceiling"] == pytest.approx(1.0) and c["forced"] == pytest.approx(1.0) and c["none"] == pytest.approx(1.0)
    # tokens 1..3 forced from position 1 (one legal token each): drafted for free, fed with one pass
    forced = ScriptedGuide({1: [2, 3, 4]}, [False, True, True, True, False, False, False, False])
    c = ceiling(costs, forced, [0], out)
    assert c["forced"] > 1.2 and c["ceiling"] >= c["forced"] and c["single_share"] == pytest.approx(3 / 8)
    # the prompt holds the answer: copying beats forcing alone
    c2 = ceiling(costs, ScriptedGuide({1: [2, 3, 4]}, forced.single), [0] + out, out)
    assert c2["ceiling"] > c["ceiling"] and c2["copyable_share"] == 1.0
    # a forced run the answer does not take (another tokenization) is drafted and rejected
    wrong = ScriptedGuide({1: [9, 9, 9]}, [False] * 8)
    assert ceiling(costs, wrong, [0], out)["forced"] < 1.0


@pytest.fixture(scope="module")
def report(smol, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("structured")
    work = tmp / "s.jsonl"
    work.write_text(json.dumps({"id": "x1", "kind": "structured", "task": "extraction", "prompt": PROMPT,
                                "schema": SCHEMA}) + "\n")
    out = tmp / "s.json"
    code = None
    from edgespec.cli import main
    code = main(["bench", "--target", str(smol), "--kinds", "structured", "--workloads", str(work),
                 "--bench-tokens", "32", "--out", str(out)])
    assert code == 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_bench_reports_validity_and_shares_on_real_output(report):
    (row,) = report["rows"]
    assert set(row["modes"]) == {"auto", "none", "grammar-peer"} and row["plain_tps"] > 0
    for name, m in row["modes"].items():
        assert m["valid"], (name, m["text"], m["invalid_reason"])
        assert m["tps"] > 0 and m["ratio"] > 0
    auto, none = row["modes"]["auto"], row["modes"]["none"]
    assert auto["identical_to_none"] and none["identical_to_none"]  # T = 0: the same exact answer
    assert sum(auto["shares"].values()) == pytest.approx(1.0)
    assert auto["shares"]["forced"] > 0  # keys and punctuation of this schema are forced
    assert none["shares"]["forced"] == 0 and none["shares"]["sampled"] == pytest.approx(1.0)
    c = row["ceiling"]
    assert c["ceiling"] >= c["forced"] > 0 and 0 < c["single_share"] < 1
    s = report["by_task"]["extraction"]
    assert s["modes"]["auto"]["valid"] == "1/1" and "ceiling_fraction" in s["modes"]["auto"]


def test_structured_kind_runs_alone_and_has_its_own_modes(smol, capsys):
    code, _, err = run_cli(["bench", "--target", str(smol), "--kinds", "structured,edit"], capsys)
    assert_usage_error(code, err, "--kinds structured runs on its own")
    code, _, err = run_cli(["bench", "--target", str(smol), "--kinds", "structured", "--modes", "auto,ngram"], capsys)
    assert_usage_error(code, err, "unknown bench mode", "ngram", "grammar-peer")
