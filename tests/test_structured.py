"""Structured output on a real model (SmolLM2): JSON Schema, regex and grammars through the
library and the CLI; answers that parse and validate, bad constraints refused in one line."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import jsonschema
import pytest

from edgespec import Engine, UsageError
from edgespec.request import Request

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}
EXTRACT = [{"role": "user", "content": "Extract the person as JSON: Maria Lopez, 41, lives in Lima."}]
YEAR = r" [12][0-9]{3}\. It was (good|bad|fine)\."


@pytest.fixture(scope="module")
def engines(smol, smol_draft):
    with Engine.load(str(smol), drafter="auto", n_ctx=1024, calibrate="never") as auto, \
            Engine.load(str(smol), draft=str(smol_draft), drafter="model", n_ctx=1024) as model, \
            Engine.load(str(smol), drafter="none", n_ctx=1024) as plain:
        yield {"auto": auto, "model": model, "none": plain}


@pytest.mark.parametrize("mode", ["auto", "model", "none"])
def test_json_schema_answers_validate_at_t0_and_t1(engines, mode):
    eng = engines[mode]
    for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2)):
        r = eng.chat(EXTRACT, max_tokens=80, temperature=temperature, seed=seed, json_schema=PERSON)
        assert r.finish_reason == "stop", r.text
        jsonschema.validate(json.loads(r.text), PERSON)
        forced = r.stats.by_drafter.get("grammar", {"drafted": 0})["drafted"]
        # keys, quotes, braces: the grammar drafts them, unless there is no drafter at all
        assert (forced > 0) == (mode != "none") and r.stats.forced <= forced


def test_the_same_request_object_and_keyword_options_agree(engines):
    eng = engines["none"]
    req = Request.build(max_tokens=40, json_schema=json.dumps(PERSON))
    assert eng.chat(EXTRACT, req).tokens == eng.chat(EXTRACT, max_tokens=40, json_schema=PERSON).tokens
    with pytest.raises(UsageError, match="not both"):
        eng.chat(EXTRACT, req, max_tokens=3)
    with pytest.raises(UsageError, match="unknown option 'json'"):
        eng.chat(EXTRACT, json={})


def test_regex_and_grammars_are_followed_at_t1(engines):
    eng = engines["auto"]
    for seed in range(4):
        r = eng.generate("The year is", max_tokens=20, temperature=1.0, top_p=0.9, seed=seed, regex=YEAR)
        assert re.fullmatch(YEAR, r.text) and r.finish_reason == "stop", r.text
    gbnf = 'root ::= "Answer: " ("yes" | "no") "."'
    lark = 'start: "Answer: " ANSWER "."\nANSWER: "yes" | "no"'
    for grammar in (gbnf, lark):
        r = eng.chat([{"role": "user", "content": "Is water wet?"}], max_tokens=10, grammar=grammar)
        assert r.text in ("Answer: yes.", "Answer: no."), r.text


def test_a_cut_answer_is_length_and_may_be_incomplete(engines):
    r = engines["auto"].chat(EXTRACT, max_tokens=3, json_schema=PERSON)
    assert r.finish_reason == "length" and len(r.tokens) == 3


@pytest.mark.parametrize("mode", ["auto", "none"])
def test_a_complete_answer_of_exactly_max_tokens_is_stop(engines, mode):
    full = engines[mode].chat(EXTRACT, max_tokens=60, json_schema=PERSON)
    assert full.finish_reason == "stop"
    exact = engines[mode].chat(EXTRACT, max_tokens=len(full.tokens), json_schema=PERSON)
    assert exact.tokens == full.tokens and exact.finish_reason == "stop"
    short = engines[mode].chat(EXTRACT, max_tokens=len(full.tokens) - 1, json_schema=PERSON)
    assert short.finish_reason == "length"


@pytest.mark.parametrize("options, message", [
    (dict(json_schema={"type": "wat"}), "JSON schema was refused"),
    (dict(json_schema="{not json"), "not valid JSON"),
    (dict(json_schema=[1]), "a JSON schema is an object"),
    (dict(regex="a("), "regex was refused"),
    (dict(grammar="root ::= (("), "refused"),
    (dict(regex="a", grammar='start: "a"'), "at most one of"),
    # what JSON cannot hold, and text that is not text
    (dict(json_schema={"enum": {1, 2}}), "not JSON data"),
    (dict(json_schema={"properties": {1: {}, "b": {}}}), "not JSON data"),
    (dict(regex="\ud800"), "regex is not valid text"),
    (dict(grammar='start: "\ud800"'), "grammar is not valid text"),
    # constraints llguidance compiles but no text satisfies
    (dict(regex="a[^\x00-\U0010FFFF]"), "admits no answer"),
    (dict(grammar='start: start "a"'), "admits no answer"),
    (dict(json_schema={"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}), "admits no answer"),
])
def test_bad_constraints_are_usage_errors_before_anything_runs(engines, options, message):
    with pytest.raises(UsageError, match=message) as err:
        engines["auto"].chat(EXTRACT, max_tokens=4, **options)
    assert "\n" not in str(err.value)


def _run(smol, *args):
    return subprocess.run([sys.executable, "-m", "edgespec", "run", "--target", str(smol), "--ctx", "1024",
                           "--drafter", "ngram", *args], capture_output=True, text=True,
                          timeout=300)


def test_cli_json_schema_from_a_file_or_inline_and_errors(smol, tmp_path):
    path = tmp_path / "person.json"
    path.write_text(json.dumps(PERSON))
    for spec in (str(path), json.dumps(PERSON)):
        r = _run(smol, "--json-schema", spec, "--json", "--max-tokens", "80", "-p", EXTRACT[0]["content"])
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        jsonschema.validate(json.loads(out["text"]), PERSON)
        assert out["stats"]["finish_reason"] == "stop" and out["stats"]["by_drafter"]["grammar"]["drafted"] > 0
    r = _run(smol, "--regex", "[0-9]+", "--max-tokens", "8", "-p", "Pick a number")
    assert r.returncode == 0 and re.fullmatch("[0-9]+", r.stdout.strip()), r.stdout
    for bad, what in ((["--json-schema", '{"type": "wat"}'], "refused"), (["--json-schema", "nope.json"], "neither"),
                      (["--grammar", str(tmp_path / "missing.lark")], "cannot read"),
                      (["--regex", "a", "--grammar", str(path)], "not allowed with")):
        r = _run(smol, *bad, "-p", "hi")
        assert r.returncode == 2, r.stderr
        assert what in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_every_registered_drafter_is_a_mode_of_the_cli_and_library(smol):
    from edgespec.assemble import DRAFTERS
    assert set(DRAFTERS) == {"auto", "model", "ngram", "copy", "none"}
    with Engine.load(str(smol), drafter="copy", n_ctx=512) as eng:
        r = eng.chat([{"role": "user", "content": "Repeat exactly: the quick brown fox jumps over the lazy dog"}],
                     max_tokens=16)
        assert eng.mode == "copy" and r.stats.by_drafter.get("copy", {}).get("accepted", 0) > 0
    with pytest.raises(UsageError, match="unknown drafter 'lookup'; choose one of auto, model, ngram, copy, none"):
        Engine.load(str(smol), drafter="lookup")
