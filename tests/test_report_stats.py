"""infir2_jax.ablation.statistics against scipy.stats: t distribution, t intervals, paired differences, TOST."""

import math

import numpy as np
import pytest
from scipy import stats as sps

from infir2_jax.ablation import statistics as stats

DFS = [1, 2, 3, 4, 7, 12, 30, 200]


@pytest.mark.parametrize("df", DFS)
def test_t_cdf_matches_scipy_including_tails(df):
  for t in [-80.0, -12.0, -3.1, -1.0, -0.2, 0.0, 0.3, 1.7, 4.5, 25.0]:
    want = sps.t.cdf(t, df)
    got = stats.t_cdf(t, df)
    # relative accuracy in the tail that is small (that is what p-values read)
    small_want, small_got = min(want, 1 - want), min(got, 1 - got)
    assert small_got == pytest.approx(small_want, rel=1e-9, abs=1e-300), (df, t)


@pytest.mark.parametrize("df", DFS)
def test_t_ppf_matches_scipy(df):
  for q in [1e-6, 0.005, 0.025, 0.05, 0.3, 0.5, 0.8, 0.95, 0.975, 0.995]:
    assert stats.t_ppf(q, df) == pytest.approx(sps.t.ppf(q, df), rel=1e-10, abs=1e-12), (df, q)


def test_betainc_matches_scipy():
  from scipy import special
  for a, b, x in [(0.5, 0.5, 0.3), (2.0, 3.0, 0.9), (15.0, 0.5, 0.97), (1.0, 100.0, 0.001)]:
    assert stats.betainc(a, b, x) == pytest.approx(special.betainc(a, b, x), rel=1e-11)


@pytest.mark.parametrize("level", [0.9, 0.95, 0.99])
@pytest.mark.parametrize("n", [2, 3, 5, 17])
def test_mean_ci_matches_scipy_interval(n, level):
  x = np.random.default_rng(n).normal(3.0, 0.7, size=n)
  ci = stats.mean_ci(x, level)
  lo, hi = sps.t.interval(level, n - 1, loc=np.mean(x), scale=sps.sem(x))
  assert (ci.low, ci.high) == pytest.approx((lo, hi), rel=1e-12)
  assert ci.mean == pytest.approx(np.mean(x)) and ci.n == n


def test_mean_ci_known_values():
  # [1.0, 1.2, 0.9]: mean 1.0333, sd 0.152753, t_{0.975, 2} = 4.302653 -> half width 0.379458
  ci = stats.mean_ci([1.0, 1.2, 0.9])
  assert ci.half_width == pytest.approx(4.302652729911275 * 0.15275252316519466 / math.sqrt(3))
  one = stats.mean_ci([2.5])
  assert one.mean == 2.5 and math.isnan(one.low) and one.n == 1


def test_paired_diff_is_the_interval_of_differences():
  a = np.array([4.10, 4.21, 4.05, 4.33])
  b = np.array([4.08, 4.20, 4.01, 4.30])
  d = stats.paired_diff(a, b)
  res = sps.ttest_rel(a, b)
  ci = res.confidence_interval(0.95)
  assert (d.low, d.high) == pytest.approx((ci.low, ci.high), rel=1e-10)
  with pytest.raises(ValueError, match="equal sizes"):
    stats.paired_diff([1, 2], [1, 2, 3])


@pytest.mark.parametrize("shift", [0.0, 0.03, 0.08, -0.12])
def test_tost_p_values_match_two_one_sided_scipy_tests(shift):
  rng = np.random.default_rng(7)
  d = shift + rng.normal(0, 0.02, size=5)
  margin = 0.1
  t = stats.tost(d, margin, alpha=0.05)
  p_lower = sps.ttest_1samp(d, -margin, alternative="greater").pvalue
  p_upper = sps.ttest_1samp(d, margin, alternative="less").pvalue
  assert t.p_lower == pytest.approx(p_lower, rel=1e-9, abs=1e-15)
  assert t.p_upper == pytest.approx(p_upper, rel=1e-9, abs=1e-15)
  assert t.p_value == pytest.approx(max(p_lower, p_upper), rel=1e-9, abs=1e-15)
  # TOST at alpha <=> the 90% interval lies inside the margin
  lo, hi = sps.t.interval(0.9, d.size - 1, loc=d.mean(), scale=sps.sem(d))
  assert t.equivalent == (-margin < lo and hi < margin)


def test_verdicts():
  assert stats.verdict(stats.tost([0.001, -0.002, 0.0015, 0.0], 0.05)) == "equivalent"
  assert stats.verdict(stats.tost([0.30, 0.31, 0.29, 0.305], 0.05)) == "not equivalent"
  assert stats.verdict(stats.tost([0.1, -0.1, 0.05], 0.05)) == "inconclusive"
  assert stats.verdict(stats.tost([0.01], 0.05)).startswith("inconclusive")
  # identical differences: a plain comparison with the margin
  assert stats.tost([0.01, 0.01, 0.01], 0.05).equivalent
  assert not stats.tost([0.2, 0.2], 0.05).equivalent


def test_bad_arguments_raise_clear_errors():
  with pytest.raises(ValueError, match="margin"):
    stats.tost([0.1, 0.2], 0.0)
  with pytest.raises(ValueError, match="level"):
    stats.mean_ci([1, 2], 1.5)
  with pytest.raises(ValueError, match="q in"):
    stats.t_ppf(1.0, 3)
  with pytest.raises(ValueError, match="at least one"):
    stats.mean_ci([])
