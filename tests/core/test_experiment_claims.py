import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.core.experiments.claims import (
    Claim,
    ClaimSyntaxError,
    Selector,
    Term,
    format_claim,
    parse_claim,
    same_setting,
)
from asyncgrpo.core.experiments.curves import CollapseRule, CurvePoint, Run, RunCurve
from asyncgrpo.core.experiments.statistic import STATISTICS, Statistic
from asyncgrpo.core.experiments.verdicts import (
    Outcome,
    evaluate_claim,
    evaluate_claims,
    exit_status,
)

# ------------------------------------------------------------------ parse and format

finite = st.floats(allow_nan=False, allow_infinity=False)
keys = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.]{0,8}", fullmatch=True)
values = st.text(st.characters(blacklist_characters='"', blacklist_categories=["Cs"]), max_size=8)
metric_names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_./-]{0,12}", fullmatch=True).filter(
    lambda name: name not in STATISTICS
)


@st.composite
def selectors(draw):
    names = draw(st.lists(keys, max_size=3, unique=True))
    return Selector([(name, draw(values)) for name in names])


def statistics(count: bool):
    if count:
        return st.just(Statistic("collapsed"))
    return st.one_of(
        st.builds(Statistic, st.sampled_from(["time_to", "steps_to"]), finite),
        st.builds(Statistic, st.just("final_reward"), st.none() | st.integers(1, 50)),
        st.builds(Statistic, st.sampled_from(["auc", "auc_time"])),
        st.builds(Statistic, metric_names),
    )


@st.composite
def claims(draw):
    count = draw(st.booleans())
    left = Term(draw(statistics(count)), draw(selectors()))
    operators = ["<=", "<", ">=", ">"] + (["=="] if count else [])
    right = draw(st.none() | st.builds(Term, statistics(count), selectors()))
    coefficient = draw(finite if right is None else finite.filter(lambda c: c > 0))
    confidence = draw(st.none() | st.floats(0.0, 1.0, exclude_min=True, exclude_max=True))
    return Claim(left, draw(st.sampled_from(operators)), right, coefficient, confidence)


@given(claims())
def test_parse_reads_back_what_format_writes(claim):
    text = format_claim(claim)
    assert parse_claim(text) == claim
    assert format_claim(parse_claim(text)) == text


@given(claims(), st.sampled_from(["", " ", "  \t"]))
def test_whitespace_between_tokens_does_not_matter(claim, space):
    text = format_claim(claim)
    squeezed = text.replace(" <= ", "<=").replace(" * ", "*").replace(" @ ", "@")
    assert parse_claim(space + squeezed + space) == claim


def test_the_claims_of_the_issue_parse():
    claim = parse_claim("time_to(0.9)[max_staleness=1] <= 0.8 * time_to(0.9)[max_staleness=0]")
    assert claim.left == Term(Statistic("time_to", 0.9), Selector([("max_staleness", "1")]))
    assert claim.right.statistic == Statistic("time_to", 0.9) and claim.coefficient == 0.8
    claim = parse_claim("final_reward[loss_type=cispo] >= final_reward[loss_type=score_centering]")
    assert (claim.operator, claim.coefficient) == (">=", 1.0)
    claim = parse_claim("collapsed[max_staleness=4] == 0")
    assert claim.right is None and claim.coefficient == 0 and claim.left.statistic.is_count
    claim = parse_claim('perf/step_s[model="Qwen/Qwen3 0.6B", lr=1e-2] < 0.5 @ 95%')
    assert claim.left.selector.pairs == (("model", "Qwen/Qwen3 0.6B"), ("lr", "1e-2"))
    assert claim.confidence == 0.95


@pytest.mark.parametrize(
    ("text", "position", "fix"),
    [
        ("time_to(0.9) <= 1", 13, "add a selector"),
        ("time_to[a=1] <= 1", 7, "time_to(0.9)"),
        ("auc[a=1] 1", 9, "compare two terms"),
        ("auc[a=1 b=2] <= 1", 8, "separate settings with ','"),
        ("auc[a=1] <= 1 extra", 14, "end the claim"),
        ("auc[a=1] <= 1 @ 90", 18, "'@ 90%'"),
        ("auc[a=1] <= 1 @ 120%", 16, "'@ 90%'"),
        ("final_reward(2.5)[] >= 1", 13, "final_reward(3)"),
        ("median(perf/step_s)[a=1] < 1", 0, "not median(perf/step_s)"),
        ("time_to(0.9)[a=1] == time_to(0.9)[a=0]", 18, "state a bound"),
        ("collapsed[a=1] <= time_to(0.9)[a=0]", 15, "compare collapsed with a number"),
        ("auc[a=1] <= -1 * auc[a=2]", 9, "positive factor"),
        ("auc[a=1, a=2] <= 1", 9, "name each setting once"),
        ("auc[a=] <= 1", 6, "quote it"),
        ("auc[a=1] <= 0.8 *", 17, "a factor multiplies a term"),
    ],
)
def test_parse_errors_name_the_claim_the_position_and_the_fix(text, position, fix):
    with pytest.raises(ClaimSyntaxError) as caught:
        parse_claim(text)
    error = caught.value
    assert (error.text, error.position) == (text, position), str(error)
    assert fix in error.fix
    assert repr(text) in str(error) and f"position {position}" in str(error)
    assert str(error).splitlines()[2] == "    " + " " * position + "^"


def test_selector_values_match_as_text_or_as_numbers():
    assert same_setting("1", "1") and same_setting("1e-2", "0.01") and same_setting("1", "1.0")
    assert not same_setting("cispo", "CISPO") and not same_setting("nan", "nan0")
    assert Selector([("lr", "1e-2")]).matches({"lr": "0.01", "seed": "0"})
    assert not Selector([("lr", "1e-2")]).matches({"seed": "0"})


# ------------------------------------------------------------------ evaluation


def timed_run(settings, seed, seconds, reached=True, entropy=0.5):
    """A run of 4 steps that reaches reward 0.95 at its last, after ``seconds`` (or never,
    ending at ``seconds``)."""
    metrics = {"entropy": entropy, "frac_reward_zero_std": 1.0, "perf/step_s": seconds / 4}
    rewards = [0.2, 0.4, 0.5, 0.95 if reached else 0.6]
    points = [CurvePoint(i + 1, seconds * (i + 1) / 4, r, metrics) for i, r in enumerate(rewards)]
    return Run(settings, seed, RunCurve(points))


def setting(staleness, seconds, reached=True, entropy=0.5):
    return [
        timed_run({"max_staleness": staleness}, seed, t, reached, entropy)
        for seed, t in enumerate(seconds)
    ]


SLOW = [20.0, 22.0, 21.0, 19.0, 23.0, 20.5]
FAST = [12.0, 13.0, 12.5, 11.0, 14.0, 12.2]
CLAIM = "time_to(0.9)[max_staleness=1] <= 0.8 * time_to(0.9)[max_staleness=0]"


def test_a_ratio_claim_holds_fails_or_stays_undecided():
    holds = evaluate_claim(parse_claim(CLAIM), setting(0, SLOW) + setting(1, FAST))
    assert holds.outcome is Outcome.HOLDS
    assert holds.comparison.ratio.high <= 0.8 and holds.runs == (6, 6)
    fails = evaluate_claim(parse_claim(CLAIM), setting(0, FAST) + setting(1, SLOW))
    assert fails.outcome is Outcome.FAILS and fails.comparison.ratio.low > 0.8
    # medians 20.75 and 16.5: ratio about 0.8, the interval straddles it
    close = [s * 0.8 for s in SLOW]
    undecided = evaluate_claim(parse_claim(CLAIM), setting(0, SLOW) + setting(1, close))
    assert undecided.outcome is Outcome.UNDECIDED
    r = undecided.comparison.ratio
    assert r.low <= 0.8 <= r.high
    assert "ratio" in undecided.reason and "6 and 6 runs" in undecided.reason


def test_a_run_that_never_reaches_the_threshold_counts_as_slowest():
    runs = setting(0, FAST) + setting(1, SLOW[:2]) + setting(1, SLOW[2:], reached=False)
    verdict = evaluate_claim(parse_claim(CLAIM), runs)
    assert verdict.outcome is Outcome.FAILS
    assert verdict.right.censored == 0 and verdict.left.censored == 4
    assert math.isinf(verdict.left.median.estimate)
    assert "4 censored" in verdict.reason
    never = evaluate_claim(parse_claim(CLAIM), setting(0, SLOW, False) + setting(1, SLOW, False))
    assert never.outcome is Outcome.UNDECIDED  # inf against inf decides nothing


def test_collapse_counts_are_exact():
    runs = setting(4, SLOW[:3]) + setting(4, SLOW[3:], entropy=0.001) + setting(0, SLOW)
    none = evaluate_claim(parse_claim("collapsed[max_staleness=0] == 0"), runs)
    assert none.outcome is Outcome.HOLDS and none.counts == (0, None)
    some = evaluate_claim(parse_claim("collapsed[max_staleness=4] == 0"), runs)
    assert some.outcome is Outcome.FAILS and some.counts == (3, None)
    assert some.reason == "3 of 6 runs"
    fewer = evaluate_claim(
        parse_claim("collapsed[max_staleness=0] < collapsed[max_staleness=4]"), runs
    )
    assert fewer.outcome is Outcome.HOLDS and fewer.counts == (0, 3)
    lenient = CollapseRule(entropy_below=0.0001)
    assert evaluate_claim(parse_claim("collapsed[] == 0"), runs, collapse_rule=lenient).outcome is (
        Outcome.HOLDS
    )


def test_a_setting_against_a_constant():
    runs = setting(1, FAST)
    assert evaluate_claim(parse_claim("perf/step_s[max_staleness=1] < 4"), runs).outcome is (
        Outcome.HOLDS
    )
    assert evaluate_claim(parse_claim("perf/step_s[max_staleness=1] > 4"), runs).outcome is (
        Outcome.FAILS
    )
    assert evaluate_claim(parse_claim("perf/step_s[max_staleness=1] < 3.1"), runs).outcome is (
        Outcome.UNDECIDED
    )
    verdict = evaluate_claim(parse_claim("final_reward(1)[max_staleness=1] >= 0.95"), runs)
    assert verdict.outcome is Outcome.HOLDS  # every run ends at exactly 0.95


def test_missing_runs_keys_and_metrics():
    runs = setting(0, SLOW)
    verdict = evaluate_claim(parse_claim(CLAIM), runs)
    assert verdict.outcome is Outcome.UNDECIDED
    assert verdict.reason == "no run matches time_to(0.9)[max_staleness=1]"
    with pytest.raises(ValueError, match="did you mean 'max_staleness'"):
        evaluate_claim(parse_claim("auc[max_stalenes=0] > 0"), runs)
    with pytest.raises(ValueError, match=r"max_staleness=0, seed=0.*did you mean 'perf/step_s'"):
        evaluate_claim(parse_claim("perf/step_sx[max_staleness=0] > 0"), runs)


@given(
    st.lists(st.floats(1.0, 100.0), min_size=1, max_size=6),
    st.lists(st.floats(1.0, 100.0), min_size=1, max_size=6),
    st.floats(0.25, 4.0),
    st.integers(0, 100),
)
def test_a_claim_and_its_negation_never_both_hold(a, b, coefficient, seed):
    runs = setting(0, a) + setting(1, b)
    left, right = (
        "time_to(0.9)[max_staleness=0]",
        f"{coefficient!r} * time_to(0.9)[max_staleness=1]",
    )
    for op, negation in (("<=", ">"), ("<", ">="), (">=", "<"), (">", "<=")):
        yes = evaluate_claim(parse_claim(f"{left} {op} {right}"), runs, resamples=300, rng=seed)
        no = evaluate_claim(
            parse_claim(f"{left} {negation} {right}"), runs, resamples=300, rng=seed
        )
        assert (yes.outcome is Outcome.HOLDS) == (no.outcome is Outcome.FAILS)
        assert (yes.outcome is Outcome.UNDECIDED) == (no.outcome is Outcome.UNDECIDED)


@given(st.lists(st.floats(1.0, 100.0), min_size=1, max_size=8), st.integers(0, 100))
def test_a_setting_is_never_claimed_slower_than_an_identical_one(times, seed):
    runs = setting(0, times) + [timed_run({"max_staleness": 1}, s, t) for s, t in enumerate(times)]
    for op in ("<=", ">="):
        text = f"time_to(0.9)[max_staleness=1] {op} time_to(0.9)[max_staleness=0]"
        verdict = evaluate_claim(parse_claim(text), runs, resamples=500, rng=seed)
        assert verdict.outcome is not Outcome.FAILS


def test_verdicts_do_not_depend_on_the_other_claims():
    runs = setting(0, SLOW) + setting(1, [s * 0.8 for s in SLOW])
    first = parse_claim(CLAIM)
    second = parse_claim("auc[max_staleness=1] >= auc[max_staleness=0]")
    alone = evaluate_claims([first], runs, seed=5)
    both = evaluate_claims([second, first], runs, seed=5)
    assert alone[0] == both[1]
    assert exit_status(both) == 0
    fails = evaluate_claims([parse_claim("collapsed[] == 0")], setting(0, SLOW, entropy=0.0))
    assert exit_status(fails) == 1
