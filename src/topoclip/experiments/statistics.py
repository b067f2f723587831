"""Tests over seeds: is a difference between two cells (or two points of the same runs) more than seed noise?

    welch(a, b)            two groups of runs (two cells), unequal variances: Welch's t
    paired(after, before)  the same runs at two points (e.g. a curve's last evaluation against an earlier one)
    tost(a, b, margin)     is |mean(a) − mean(b)| below a margin stated in advance? Two one-sided Welch tests:
                           "no difference found" is not "equivalent"; this asks the second question
    permutation(a, b)      the exact two-sided permutation test of mean(a) − mean(b): no normality assumed, for
                           values that are bimodal across seeds (a seed learns a held-out pair or it does not)
    prediction(values)     where one more run of the same cell lands: the interval a re-run is checked against
    holm(p_values)         the p-values of a family of tests, adjusted so that any false "significant" among them
                           has probability ≤ 5 % (Holm–Bonferroni)

Each returns a `Difference`: the effect (mean of a − mean of b, from the unrounded values), its 95 %
confidence interval, the two-sided p-value, the degrees of freedom and the numbers of runs. With
3–5 seeds per cell these are the honest tools: a bootstrap over so few values understates its own
interval, and "beyond the spread" (|Δ| > sd₁ + sd₂) is not a test at any n.

Student's t distribution is computed here from the regularised incomplete beta function (Numerical
Recipes §6.4, Lentz's continued fraction), so topoclip needs no SciPy; tests/experiments/test_statistics.py
checks it against the closed forms for 1 and 2 degrees of freedom and against SciPy's ttest_ind.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Optional, Sequence

# The continued fraction converges in O(sqrt(max(a, b))) terms; 300 covers any df a seed count makes.
BETA_MAX_TERMS = 300
# Stop once a term changes the fraction by less than this relative amount: about double precision's epsilon.
BETA_EPSILON = 3e-16
# Lentz's method replaces an exact zero denominator by this tiny number (NR §5.2) so the recurrence goes on.
LENTZ_TINY = 1e-300


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n − 1 in the denominator; 0 for one value)."""
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return mean, std


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of I_x(a, b) (NR eq. 6.4.5), evaluated by the modified Lentz method."""
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > LENTZ_TINY else LENTZ_TINY)
    result = d
    for m in range(1, BETA_MAX_TERMS + 1):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > LENTZ_TINY else LENTZ_TINY)
            c = 1.0 + numerator / c
            c = c if abs(c) > LENTZ_TINY else LENTZ_TINY
            result *= c * d
        if abs(c * d - 1.0) < BETA_EPSILON:
            return result
    raise ArithmeticError(f"incomplete beta I_{x}({a}, {b}) did not converge in {BETA_MAX_TERMS} terms")


def incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b), for a, b > 0 and 0 ≤ x ≤ 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):  # where the fraction converges fast; else use I_x(a, b) = 1 − I_{1−x}(b, a)
        return front * _beta_fraction(a, b, x) / a
    return 1.0 - front * _beta_fraction(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T ≤ t) for Student's t with df degrees of freedom: ½·I_{df/(df+t²)}(df/2, ½) in the tail."""
    tail = 0.5 * incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


@lru_cache(maxsize=256)  # a report asks for the same few (level, df) pairs in every cell
def t_quantile(p: float, df: float) -> float:
    """The t with P(T ≤ t) = p, by bisection on t_cdf (monotone) down to adjacent doubles."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"t_quantile needs 0 < p < 1, got {p}")
    low, high = -1.0, 1.0
    while t_cdf(low, df) > p:
        low *= 2.0
    while t_cdf(high, df) < p:
        high *= 2.0
    while (middle := (low + high) / 2.0) not in (low, high):  # until the bracket is two adjacent doubles
        low, high = (middle, high) if t_cdf(middle, df) < p else (low, middle)
    return middle


def format_p(p: float) -> str:
    """"p = 0.021", or "p < 0.001" below the three decimals a p-value is shown with."""
    return "p < 0.001" if p < 0.001 else f"p = {p:.3f}"


@dataclass(frozen=True)
class Difference:
    """mean(a) − mean(b) with its confidence interval and two-sided p-value."""

    test: str  # "Welch's t" or "paired t"
    effect: float
    low: float
    high: float
    p: float
    df: Optional[float]  # None when no run varied (nothing to test against)
    n_a: int
    n_b: int
    level: float = 0.95

    @property
    def significant(self) -> bool:
        """The interval excludes 0 (equivalently p < 1 − level)."""
        return self.low > 0 or self.high < 0

    @property
    def unvaried(self) -> bool:
        """Every run gave the same value (e.g. a fixed τ): the interval is a point and p says nothing."""
        return self.low == self.high

    def describe(self, digits: int = 1, holm_p: Optional[float] = None) -> str:
        """"+15.2 (95 % CI 3.1 to 27.3; Welch's t, p = 0.021; n = 5 and 5)", with ", Holm p = 0.084" after p when
        this test's p adjusted within its family (`holm`) is given."""
        n = f"n = {self.n_a}" if self.test == "paired t" else f"n = {self.n_a} and {self.n_b}"
        if self.unvaried:
            return f"{self.effect:+.{digits}f} (no spread: every run gave the same value, nothing to test; {n})"
        p = format_p(self.p) + ("" if holm_p is None else f", Holm {format_p(holm_p)}")
        return (f"{self.effect:+.{digits}f} ({self.level * 100:.0f} % CI {self.low:+.{digits}f} to "
                f"{self.high:+.{digits}f}; {self.test}, {p}; {n})")

    def as_dict(self) -> dict:
        return asdict(self)


def _from_t(test: str, effect: float, standard_error: float, df: Optional[float], n_a: int, n_b: int, level: float) -> Difference:
    if standard_error == 0.0:  # every run gave the same value in both groups: no noise to test against
        return Difference(test, effect, effect, effect, 0.0 if effect else 1.0, df, n_a, n_b, level)
    half_width = t_quantile(0.5 + level / 2.0, df) * standard_error
    p = 2.0 * t_cdf(-abs(effect) / standard_error, df)
    return Difference(test, effect, effect - half_width, effect + half_width, min(p, 1.0), df, n_a, n_b, level)


def welch(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> Difference:
    """Welch's t for mean(a) − mean(b): variances not assumed equal, Welch–Satterthwaite degrees of freedom."""
    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"Welch's t needs at least 2 runs per group, got {len(a)} and {len(b)}")
    (mean_a, sd_a), (mean_b, sd_b) = mean_std(a), mean_std(b)
    va, vb = sd_a ** 2 / len(a), sd_b ** 2 / len(b)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1)) if va + vb else None  # no variance
    return _from_t("Welch's t", mean_a - mean_b, math.sqrt(va + vb), df, len(a), len(b), level)


@dataclass(frozen=True)
class Equivalence:
    """Two one-sided tests (Schuirmann 1987) of −margin < mean(a) − mean(b) < margin, on Welch's t."""

    effect: float
    low: float  # the (1 − 2α) Welch interval: equivalent at α exactly when it lies inside (−margin, margin)
    high: float
    p: float  # the larger of the two one-sided p-values
    margin: float
    n_a: int
    n_b: int
    alpha: float = 0.05

    @property
    def equivalent(self) -> bool:
        return self.p < self.alpha

    def describe(self, digits: int = 1) -> str:
        """"equivalent within ±2.0: +0.4 (90 % CI −0.9 to +1.7; TOST, p = 0.012; n = 5 and 5)"."""
        verdict = "equivalent" if self.equivalent else "not shown equivalent"
        return (f"{verdict} within ±{self.margin:.{digits}f}: {self.effect:+.{digits}f} ({(1 - 2 * self.alpha) * 100:.0f} % "
                f"CI {self.low:+.{digits}f} to {self.high:+.{digits}f}; TOST, {format_p(self.p)}; n = {self.n_a} and {self.n_b})")

    def as_dict(self) -> dict:
        return asdict(self)


def tost(a: Sequence[float], b: Sequence[float], margin: float, alpha: float = 0.05) -> Equivalence:
    """TOST of mean(a) − mean(b) against ±margin: p = max of P(T ≥ (δ + margin)/se) (H0: δ ≤ −margin) and
    P(T ≤ (δ − margin)/se) (H0: δ ≥ margin), Welch's standard error and degrees of freedom."""
    if margin <= 0:
        raise ValueError(f"an equivalence margin must be > 0, got {margin}")
    interval = welch(a, b, level=1 - 2 * alpha)
    (_, sd_a), (_, sd_b) = mean_std(a), mean_std(b)
    standard_error = math.sqrt(sd_a ** 2 / len(a) + sd_b ** 2 / len(b))
    effect = interval.effect
    if standard_error == 0.0:  # no spread: the difference is what it is
        p = 0.0 if abs(effect) < margin else 1.0
    else:
        p = max(t_cdf(-(effect + margin) / standard_error, interval.df), t_cdf((effect - margin) / standard_error, interval.df))
    return Equivalence(effect, interval.low, interval.high, p, margin, len(a), len(b), alpha)


def paired(after: Sequence[float], before: Sequence[float], level: float = 0.95) -> Difference:
    """The paired t for mean(after − before) over the same runs (n − 1 degrees of freedom)."""
    if len(after) != len(before) or len(after) < 2:
        raise ValueError(f"the paired t needs ≥ 2 runs measured twice, got {len(after)} and {len(before)} values")
    differences = [x - y for x, y in zip(after, before)]
    mean, sd = mean_std(differences)
    return _from_t("paired t", mean, sd / math.sqrt(len(differences)), len(differences) - 1, len(after), len(before),
                   level)


# Two relabelled differences of means that are equal in exact arithmetic can differ in the last bits of a float sum;
# a difference counts as "at least as extreme" within this share of the largest |value| of the observed one (well
# above the ~1e-15 relative rounding of a mean of ≤ 24 values, far below any difference a seed makes).
PERMUTATION_TIE = 1e-9


def permutation(a: Sequence[float], b: Sequence[float]) -> float:
    """The exact two-sided p of mean(a) − mean(b) under exchangeability: the share of the C(n_a + n_b, n_a) ways to
    relabel the pooled runs whose |difference of means| is at least the observed one (the observed labelling
    included, so p ≥ 1 / C). Exact, so at 5 + 5 runs the smallest possible p is 2/252 ≈ 0.008."""
    if len(a) < 1 or len(b) < 1 or len(a) + len(b) > 24:
        raise ValueError(f"the exact permutation test takes 1-23 runs per group and ≤ 24 in all, got {len(a)} and {len(b)}")
    pooled, total = [*a, *b], float(sum(a) + sum(b))
    threshold = abs(sum(a) / len(a) - sum(b) / len(b)) - PERMUTATION_TIE * max(abs(v) for v in pooled)
    extreme = count = 0
    for chosen in itertools.combinations(range(len(pooled)), len(a)):
        in_a = sum(pooled[i] for i in chosen)
        count += 1
        extreme += abs(in_a / len(a) - (total - in_a) / len(b)) >= threshold
    return extreme / count


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment of m p-values, in their order: the i-th smallest becomes
    max over j ≤ i of min(1, (m − j + 1)·p_(j)). "Adjusted p < α" for any of them then holds the chance of
    one or more false rejections in the family at α whatever the dependence between the tests (Holm 1979),
    and it is never less powerful than Bonferroni's m·p."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted, running = [0.0] * len(p_values), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


@dataclass(frozen=True)
class Prediction:
    """Where one more run of a cell lands, from the n runs already made: mean ± t·sd·sqrt(1 + 1/n)."""

    mean: float
    low: float
    high: float
    n: int
    level: float = 0.95


def prediction(values: Sequence[float], level: float = 0.95) -> Prediction:
    """The prediction interval for one new run (Student's t with n − 1 degrees of freedom).

    A confidence interval bounds the cell's mean; a single re-run also carries its own seed noise, so its
    interval is wider by sqrt(1 + 1/n) / sqrt(1/n). For normally spread runs it covers a new run with
    probability `level` exactly, whatever the unknown mean and spread.
    """
    if len(values) < 2:
        raise ValueError(f"a prediction interval needs at least 2 runs, got {len(values)}")
    mean, sd = mean_std(values)
    half_width = t_quantile(0.5 + level / 2.0, len(values) - 1) * sd * math.sqrt(1.0 + 1.0 / len(values))
    return Prediction(mean, mean - half_width, mean + half_width, len(values), level)
