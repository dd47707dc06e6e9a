"""How a judge's reply is read as a score (`parse_score`): a number by its grammar, a choice by the verdict rule, or a
JSON object's key (docs/environments.md, "Reading a judge's number" and "Reading a judge's choice"). Pure text rules:
no request, no state; `gyre.envs.judge.Judge` asks again when a reply holds no verdict."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from gyre.config.endpoint import JudgeConfig
from gyre.envs.parsers import strip_reasoning

# The number mode's grammar (docs/environments.md, "Reading a judge's number"). A number: an optional minus sign
# (never a range's dash: the 10 of "0-10" is not -10), digits, and an exponent ("1e1" is 10: it was read as 1). A
# comma between digits is read by what follows it: groups of exactly three digits are thousands ("1,000" is 1000,
# "12,345,678.5" is 12345678.5: "1,000" was read as 1.0), one comma before other digits is a decimal comma ("7,5"
# is 7.5: it was read as 5; "0,25"), and a run of commas is a list ("1,2,3": 1, 2 and 3, like "7, 8"). A number
# never starts inside another's digits or decimal part; a list's element after "1," is read alone (the 2 of
# "1,2,3" is 2, never the 2.3 of a decimal comma).
_THOUSANDS = r"\d{1,3}(?:,\d{3})+(?!,?\d)"  # not "1,0000" nor "1,000,5": a list then
_COMMA_FORMS = rf"(?<!\d[.,])(?:{_THOUSANDS}(?:\.\d+)?|\d+,\d+(?![.,]?\d))"
_DIGITS = rf"(?<!\d)(?:{_COMMA_FORMS}|(?<!\d\.)\d+(?:\.\d+)?)"
_NUM = rf"(?:(?<![\w.,])[-\u2212])?{_DIGITS}(?:[eE][+-]?\d+)?"
#: markdown around a number ("**7**", "`7`"): dropped before reading
_MARKUP = re.compile(r"[*_`]")
#: what the reply may say before its score; the last number after one of these is the score
_LABEL = re.compile(r"\b(?:score|rating|grade)\b[^\w\n]*(?:\b(?:is|of|was|would\s+be|=)\b[^\w\n]*)?$", re.IGNORECASE)
#: a judge declining to grade ("I can't rate this", "I am unable to assign a score"): its numbers are no verdict
_DECLINES = re.compile(r"(?:\b(?:cannot|unable\s+to|not\s+able\s+to|will\s+not|refuse\s+to|decline\s+to|"
                       r"impossible\s+to)|n['\u2019]t)\s+(?:\w+\s+){0,2}?(?:rate|score|grade|evaluate|assess|judge|assign|give|provide)\b",
                       re.IGNORECASE)  # fmt: skip
#: what may follow a bare number that ends the reply: words of a mention of the scale ("7 on a scale of 0-10")
_SCALE_WORDS = re.compile(r"\b(?:on|in|a|the|scale|range|of|from|out|to|points?)\b", re.IGNORECASE)


def _number(text: str) -> float:
    """The value of a number `_NUM` matched: thousands commas dropped, a decimal comma read as a point."""
    text = text.replace("\u2212", "-")
    if re.search(_THOUSANDS, text):
        return float(text.replace(",", ""))
    return float(text.replace(",", "."))


def _terms(reply: str, max_score: float) -> list[tuple[float, float | None, bool, bool]]:
    """The numbers of a reply, each as (value, its scale or None, labelled, last): "8/10", "8 out of 10" and "8 of 10"
    give 8 on a scale of 10, "80%" 80 on a scale of 100; `last`: nothing but punctuation and a mention of the scale
    follows it (it ends the reply: "so: 7."). Mentions of the judge's own scale are not numbers: a bare "/10",
    "out of 10", "of 10", ranges "0-10", "1 to 10" (their lower end too: "7 on a scale of 0-10" is 7) and "a
    10-point scale"."""
    text = _MARKUP.sub("", reply)
    # the top of the scale as the judge may write it: "1000" or "1,000"
    top = rf"(?:{re.escape(f'{max_score:g}')}|{re.escape(f'{max_score:,g}')})(?:\.0+)?(?![.,]?\d)"
    text = re.sub(rf"(?<![\w.])[01](?:\.0+)?\s*(?:-|\u2013|\u2014|\bto\b)\s*{top}", " ", text, flags=re.IGNORECASE)
    # "a 10-point scale": "I can't rate this on a 10-point scale" read as 10, the full reward
    text = re.sub(rf"(?<![\w.]){top}[-\s]?points?\b", " ", text, flags=re.IGNORECASE)
    of = r"(?:/|\bout\s+of\b|\bof\b)"
    pattern = re.compile(rf"(?P<value>{_NUM})(?:\s*{of}\s*(?P<scale>{_NUM})|(?P<percent>\s*%))?|{of}\s*{top}",
                         re.IGNORECASE)  # fmt: skip
    terms = []
    for match in pattern.finditer(text):
        if match.group("value") is None:  # the scale alone: "on a scale of 10"
            continue
        value = _number(match.group("value"))
        scale = match.group("scale")
        scale = _number(scale) if scale else (100.0 if match.group("percent") else None)
        tail = _SCALE_WORDS.sub(" ", re.sub(rf"{of}\s*{top}", " ", text[match.end() :], flags=re.IGNORECASE))
        terms.append((value, scale, bool(_LABEL.search(text[: match.start()])), not re.search(r"\w", tail)))
    return terms


def _json_value(reply: str, key: str) -> Any:
    """`key` of the last JSON object in the reply that has it (None if none does). Each `{` is tried as the start
    of an object, so braces in the text around it (LaTeX's \\frac{1}{2}, a set {a, b}) do not hide it."""
    decoder, value = json.JSONDecoder(), None
    for start in (i for i, char in enumerate(reply) if char == "{"):
        try:
            obj, _ = decoder.raw_decode(reply, start)
        except ValueError:
            continue
        if isinstance(obj, dict) and key in obj:
            value = obj[key]
    return value


# The choice mode's verdict rule (docs/environments.md, "Reading a judge's choice"). A choice right after a verdict
# label ("Verdict: incorrect", "the final answer is yes") is the verdict, the last such one; else a choice that opens
# the reply ("Incorrect. The correct answer is 5": a judge leading with its verdict); else the last choice named (a
# judge reasoning first concludes last: "a correct answer would be 5, so it is incorrect" read the first, "correct",
# and rewarded a wrong reply 1). A negated choice ("not correct", "isn't entirely correct", "cannot be correct",
# "nothing incorrect", "no incorrect step") is no vote for it: with two choices it is the other one, with more no
# verdict. It read as the choice it negates: "The response is not correct." rewarded 1, and "The response is correct;
# nothing incorrect in it." 0 (its last choice, "incorrect", under a negation the rule did not know).
_NEGATORS = r"not|never|cannot|no|nothing|none|without"
_NEGATED = re.compile(rf"(?:\b(?:{_NEGATORS})|n't)[\s*_`\"']+(?:(?:be|is|was|are|were)[\s*_`\"']+)?"
                      r"(?:(?:quite|\w+ly)[\s*_`\"']+)?$", re.IGNORECASE)  # fmt: skip
#: what may come before a choice that opens the reply: markdown, punctuation and a negation ("**Not correct.**")
_LEADS = re.compile(rf"[^\w]*(?:(?:{_NEGATORS})[^\w]+)?$", re.IGNORECASE)
#: a choice before one of these nouns is an adjective ("the correct answer") or a determiner ("no errors": a yes/no
#: judge's "It has no errors." read its "no"), not a verdict
_DESCRIBES = re.compile(r"[\s*_`]+(?:answers?|responses?|replies|reply|ones?|solutions?|results?|values?|steps?|"
                        r"errors?|mistakes?|issues?|problems?|flaws?|typos?)\b", re.IGNORECASE)  # fmt: skip
_VERDICT = re.compile(r"\b(?:verdict|judge?ment|decision|conclusion|answer|grade|label|assessment)\b[^\w\n]*"
                      r"(?:\bis\b[^\w\n]*)?$", re.IGNORECASE)  # fmt: skip


def _choice(choices: dict[str, float], reply: str) -> float:
    """The reward of the verdict a reply gives among `choices` (word -> reward), by the rule above; ValueError when
    it gives none. Whole words by lookaround, not \\b: a choice ending in a non-word character ("yes!", "A+") never
    matched \\b before a space. Where two choices overlap the longer is the one named ("A+" over "A")."""
    spans = sorted(((m.start(), m.end(), word) for word in choices
                    for m in re.finditer(rf"(?<!\w){re.escape(word)}(?!\w)", reply, re.IGNORECASE)),
                   key=lambda span: (span[0], -span[1]))  # fmt: skip
    named: list[tuple[str, bool, bool, int, int]] = []  # (choice, negated, labelled, start, end), in reply order
    end = -1
    for start, stop, word in spans:
        if start < end:  # inside a longer choice named here
            continue
        end = stop
        negated = _NEGATED.search(reply, 0, start)
        before = reply[: negated.start() if negated else start]
        named.append((word, negated is not None, _VERDICT.search(before) is not None, start, stop))
    if not named:
        raise ValueError(f"none of {sorted(choices)} in the reply")
    labelled = [one for one in named if one[2]]
    # a choice naming a noun ("the correct answer is cba") describes the reference, not the reply: no conclusion
    verdicts = [one for one in named if not _DESCRIBES.match(reply, one[4])]
    # an opening choice describing a noun ("No errors found, so yes") opens no verdict either
    leads = named[0] in verdicts and _LEADS.match(reply, 0, named[0][3]) is not None
    if not (labelled or leads or verdicts):
        raise ValueError(f"the reply names {sorted({one[0] for one in named})} only before a noun, as no verdict")
    word, negated, *_ = labelled[-1] if labelled else named[0] if leads else verdicts[-1]
    if not negated:
        return float(choices[word])
    others = [other for other in choices if other != word]
    if len(others) != 1:
        raise ValueError(f"the reply says not {word!r}, which names none of the other {len(others)} choices")
    return float(choices[others[0]])


def parse_score(config: JudgeConfig, reply: str) -> float:
    """The reward a judge's reply gives; ValueError saying why when it holds none. A reasoning judge's thinking is no
    part of its verdict (`strip_reasoning`: the text after its last `</think>`): served without a reasoning parser
    (Gyre's server, vLLM without `--reasoning-parser`) its reply holds the whole `<think>` block, and a choice
    considered there ("yes? no: ...") or a labelled number ("a score of 9 at first") was read as the grade."""
    reply = strip_reasoning(reply)
    if config.score == "choice":
        return _choice(config.choices, reply)
    if config.score == "json":
        value = _json_value(reply, config.json_key)
        if isinstance(value, str) and re.fullmatch(rf"\s*{_NUM}\s*", value):
            # {"score": "7"}: a weak judge quotes its number; every such reply was unreadable
            value = _number(value.strip())
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"no JSON object with a number under {config.json_key!r}")
    else:
        terms = _terms(reply, config.max_score)
        if not terms:
            raise ValueError("no number in the reply")
        # the last labelled number ("Score: 7"), else the last one on the judge's scale ("7/10 - misses 2 steps"
        # read 2), else a bare number that ends the reply ("so I'd say 7."), where a judge concludes. Any other
        # number is no verdict: a count in its reasoning, or a judge declining to grade ("I can't score this: it has
        # 2 answers" read 2, "I can't rate this on a 10-point scale" 10, the full reward)
        labelled = [term for term in terms if term[2]]
        on_scale = [term for term in terms if term[1] == config.max_score]
        if not (labelled or on_scale):
            if _DECLINES.search(reply):
                raise ValueError("the judge declined to grade: its numbers are no score")
            if not terms[-1][3]:
                raise ValueError("no score: no number after 'score', 'rating' or 'grade', none on the scale, and "
                                 "more than the scale follows the last number")  # fmt: skip
        value, scale, *_ = (labelled or on_scale or terms)[-1]
        if scale is not None and scale != config.max_score:  # another scale than the judge was asked for
            raise ValueError(f"score {value:g} is on a scale of {scale:g}, not of max_score = {config.max_score:g}")
    try:
        value = float(value)  # a JSON integer of 400 digits: OverflowError (it escaped as a rollout's error, 0)
    except OverflowError:
        raise ValueError(f"score {str(value)[:20]}... is outside 0..{config.max_score:g}") from None
    if not (math.isfinite(value) and 0 <= value <= config.max_score):
        raise ValueError(f"score {value} is outside 0..{config.max_score:g}")
    return value / config.max_score
