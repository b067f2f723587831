"""Student's t and the tests over seeds, against closed forms and against SciPy.

The SciPy figures were printed by scipy 1.17.1 (scipy.stats.ttest_ind(equal_var=False), ttest_rel, t.ppf,
t.cdf) in a side venv; SciPy is not a dependency. Bounds: the incomplete beta's continued fraction stops
at a relative change below 3e-16 after at most 300 terms, and lgamma/exp/log are correct to a few ulps in
any IEEE-754 libm, so a CDF is within ~300·2·2⁻⁵³ ≈ 7e-14 of exact; 1e-12 holds on any machine. A quantile
is bisected to adjacent doubles on that CDF, so its error is the CDF's divided by the density, ≥ 2e-3 at
every point used here: 1e-9 relative.
"""
import math
import random

import pytest

from topoclip.experiments.statistics import (holm, incomplete_beta, paired, permutation, prediction, t_cdf, t_quantile, tost,
                                             welch)

CDF_BOUND = 1e-12
QUANTILE_BOUND = 1e-9


@pytest.mark.parametrize("t", [-30.0, -2.1, -0.3, 0.0, 0.7, 4.0, 55.0])
def test_t_cdf_closed_forms(t):
    # df = 1 is the Cauchy distribution; df = 2 has F(t) = ½ + t / (2·sqrt(2 + t²)).
    assert t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=CDF_BOUND)
    assert t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=CDF_BOUND)


def test_incomplete_beta_symmetry_and_ends():
    for a, b, x in [(0.5, 0.5, 0.3), (2.0, 0.5, 0.9), (14.75, 0.5, 0.2), (3.0, 7.0, 0.6)]:
        assert incomplete_beta(a, b, x) + incomplete_beta(b, a, 1 - x) == pytest.approx(1.0, abs=CDF_BOUND)
    assert incomplete_beta(2.0, 3.0, 0.0) == 0.0 and incomplete_beta(2.0, 3.0, 1.0) == 1.0
    # I_x(1, b) = 1 − (1 − x)^b
    assert incomplete_beta(1.0, 3.5, 0.4) == pytest.approx(1 - 0.6 ** 3.5, abs=CDF_BOUND)


@pytest.mark.parametrize("df, quantile, cdf", [
    (1, 12.706204736174694, 0.141463028121509), (2, 4.302652729749462, 0.08527493459498375),
    (3.7, 2.8675207071911895, 0.05463235254111237), (4, 2.7764451051977934, 0.05182664315880109),
    (29.5, 2.043724966772122, 0.022194816365162077)])
def test_t_against_scipy(df, quantile, cdf):
    assert t_quantile(0.975, df) == pytest.approx(quantile, rel=QUANTILE_BOUND)
    assert t_cdf(-2.1, df) == pytest.approx(cdf, abs=CDF_BOUND)
    assert t_cdf(t_quantile(0.3, df), df) == pytest.approx(0.3, abs=CDF_BOUND)


def test_welch_against_scipy():
    # The example: the sphere at Multi's range against Multi, 3 seeds each.
    result = welch([61.2, 84.9, 79.6], [95.9, 94.6, 97.1])
    assert result.effect == pytest.approx(-20.633333333333333, rel=1e-14)
    assert result.df == pytest.approx(2.040412101062771, rel=1e-12)
    assert result.p == pytest.approx(0.10134864850951293, abs=CDF_BOUND)
    assert (result.low, result.high) == pytest.approx((-51.10665708360783, 9.839990416941145), rel=QUANTILE_BOUND)
    assert not result.significant
    result = welch([0.5, 1.5, 2.0, 2.5, 3.1], [0.1, 0.2, 0.25, 0.3])
    assert result.p == pytest.approx(0.017913616678006485, abs=CDF_BOUND)
    assert (result.low, result.high) == pytest.approx((0.4801846547611528, 2.9348153452388472), rel=QUANTILE_BOUND)
    assert result.significant and (result.n_a, result.n_b) == (5, 4)
    assert result.describe() == "+1.7 (95 % CI +0.5 to +2.9; Welch's t, p = 0.018; n = 5 and 4)"
    assert result.describe(holm_p=0.0537) == "+1.7 (95 % CI +0.5 to +2.9; Welch's t, p = 0.018, Holm p = 0.054; n = 5 and 4)"


@pytest.mark.parametrize("a, b, margin, p", [
    ([61.2, 84.9, 79.6], [95.9, 94.6, 97.1], 25.0, 0.3028076048044525),
    ([45.1, 44.3, 46.0, 44.8, 45.5], [44.9, 45.6, 44.0, 45.2, 44.7], 2.0, 0.0011549224881004948),
    ([0.5, 1.5, 2.0, 2.5, 3.1], [0.1, 0.2, 0.25, 0.3], 2.0, 0.27322987031417906)])
def test_tost_against_scipy(a, b, margin, p):
    # SciPy: the larger of ttest_ind(a + margin, b, equal_var=False, alternative="greater") and
    # ttest_ind(a − margin, b, equal_var=False, alternative="less"); shifting a leaves its variance alone.
    result = tost(a, b, margin)
    assert result.p == pytest.approx(p, abs=CDF_BOUND)
    assert result.equivalent == (p < 0.05)


def test_tost_agrees_with_the_90_percent_interval():
    # Equivalent at 5 % exactly when the 90 % Welch interval lies inside (−margin, margin) (both from one t and df).
    rng = random.Random(1)
    for _ in range(200):
        a = [rng.gauss(0.3, 1) for _ in range(rng.randint(2, 8))]
        b = [rng.gauss(0, 1) for _ in range(rng.randint(2, 8))]
        result = tost(a, b, 1.5)
        assert result.equivalent == (-1.5 < result.low and result.high < 1.5)
    assert tost([1.0, 1.0], [1.5, 1.5], 1.0).equivalent and not tost([1.0, 1.0], [2.5, 2.5], 1.0).equivalent
    assert tost([1.0, 2.0, 3.0], [2.0, 2.0, 2.5], 2.0).describe() == \
        "equivalent within ±2.0: -0.2 (90 % CI -1.8 to +1.4; TOST, p = 0.038; n = 3 and 3)"
    assert tost([1.0, 2.0, 3.0], [2.0, 2.0, 2.5], 1.0).describe().startswith("not shown equivalent within ±1.0: -0.2")
    with pytest.raises(ValueError, match="margin"):
        tost([1.0, 2.0], [1.0, 2.0], 0.0)


def test_permutation_against_scipy_and_by_hand():
    # scipy.stats.permutation_test(..., permutation_type="independent", n_resamples=inf), two-sided: 22/252 for the
    # bimodal held-out values below; for 1, 2, 3 against 4–7 only the observed split and its mirror are as extreme
    # (2 of the C(7, 3) = 35). Both are ratios of small integers, exact in any float arithmetic to 1 ulp.
    assert permutation([91.1, 0.0, 88.0, 2.0, 90.5], [0.0, 1.0, 85.0, 0.5, 0.0]) == pytest.approx(22 / 252, rel=1e-15)
    assert permutation([1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]) == pytest.approx(2 / 35, rel=1e-15)
    assert permutation([0.1, 0.2, 0.3], [0.3, 0.2, 0.1]) == 1.0  # a tie in exact arithmetic counts, whatever the rounding
    with pytest.raises(ValueError, match="permutation"):
        permutation([], [1.0])


def test_paired_against_scipy():
    result = paired([1.0, 2.5, 3.0, 4.5, 5.2], [0.8, 2.0, 3.1, 3.9, 4.0])
    assert result.df == 4 and result.p == pytest.approx(0.09216726216588661, abs=CDF_BOUND)
    assert (result.low, result.high) == pytest.approx((-0.12447488600534906, 1.0844748860053492), rel=QUANTILE_BOUND)
    assert result.describe(2) == "+0.48 (95 % CI -0.12 to +1.08; paired t, p = 0.092; n = 5)"


def test_interval_and_p_agree():
    # The 95 % interval excludes 0 exactly when p < 0.05: both come from the same t and df.
    rng = random.Random(0)
    for _ in range(200):
        a = [rng.gauss(0.5, 1) for _ in range(rng.randint(2, 6))]
        b = [rng.gauss(0, 2) for _ in range(rng.randint(2, 6))]
        result = welch(a, b)
        assert result.significant == (result.p < 0.05)


def test_degenerate_and_refused():
    assert welch([1.0, 1.0], [1.0, 1.0]).p == 1.0
    same = welch([2.0, 2.0, 2.0], [1.0, 1.0])
    assert same.p == 0.0 and same.low == same.high == 1.0
    assert same.unvaried and not welch([2.0, 2.1], [1.0, 1.0]).unvaried
    assert same.describe() == "+1.0 (no spread: every run gave the same value, nothing to test; n = 3 and 2)"
    with pytest.raises(ValueError, match="at least 2 runs"):
        welch([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="measured twice"):
        paired([1.0, 2.0], [1.0])


def test_prediction_interval_closed_form_and_refusal():
    # Two runs 0 and 2: mean 1, sd √2, t(0.975, 1) = 12.706204736174694 (SciPy, above); half-width t·√2·√(3/2).
    p = prediction([0.0, 2.0])
    half = 12.706204736174694 * math.sqrt(3.0)
    assert (p.mean, p.n) == (1.0, 2)
    assert p.low == pytest.approx(1.0 - half, rel=QUANTILE_BOUND) and p.high == pytest.approx(1.0 + half, rel=QUANTILE_BOUND)
    with pytest.raises(ValueError, match="at least 2 runs"):
        prediction([3.0])


def test_prediction_interval_covers_a_new_run_at_its_level():
    # Five normal "seeds", then a sixth: the interval from the five holds the sixth with probability 0.95 exactly.
    # Python's Mersenne Twister and gauss() are the same on every platform, so the count is deterministic; the
    # bound is 5 binomial standard deviations, sqrt(0.95·0.05/20000) ≈ 0.0015, so a wrong width fails (the
    # confidence interval's covers 0.68, a normal quantile's 0.88: both t_cdf at n − 1 = 4).
    rng, trials, hits = random.Random(0), 20000, 0
    for _ in range(trials):
        runs = [rng.gauss(40.0, 7.0) for _ in range(6)]
        interval = prediction(runs[:5])
        hits += interval.low <= runs[5] <= interval.high
    assert abs(hits / trials - 0.95) < 5 * math.sqrt(0.95 * 0.05 / trials)


@pytest.mark.parametrize("p_values, adjusted", [
    ([0.01, 0.04, 0.03, 0.005], [0.03, 0.06, 0.06, 0.02]),
    ([0.2, 0.001, 0.049, 0.5, 0.012, 0.3], [0.6, 0.006, 0.196, 0.6, 0.06, 0.6]),
    ([0.7], [0.7]), ([0.4, 0.9], [0.8, 0.9]), ([], [])])
def test_holm_against_statsmodels(p_values, adjusted):
    # Printed by statsmodels 0.15.0, multipletests(p_values, method="holm")[1], in a side venv. Each adjusted
    # p is one product of a double and an integer ≤ 6 (or 1.0): within 1 ulp, so rel=1e-15 holds anywhere.
    assert holm(p_values) == pytest.approx(adjusted, rel=1e-15)
