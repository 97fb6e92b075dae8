"""Small-sample statistics for seed sweeps: Student-t intervals, paired differences, TOST.

Pure float64 numpy (no scipy at run time); tests/test_report_stats.py checks every function
against scipy.stats on known inputs.
"""

import dataclasses
import math

import numpy as np


def _betacf(a: float, b: float, x: float) -> float:
  """Continued fraction of the incomplete beta function (modified Lentz)."""
  tiny, eps = 1e-300, 1e-15
  qab, qap, qam = a + b, a + 1.0, a - 1.0
  c, d = 1.0, 1.0 - qab * x / qap
  d = 1.0 / (d if abs(d) > tiny else tiny)
  h = d
  for m in range(1, 10_000):
    m2 = 2 * m
    aa = m * (b - m) * x / ((qam + m2) * (a + m2))
    d = 1.0 + aa * d
    d = 1.0 / (d if abs(d) > tiny else tiny)
    c = 1.0 + aa / c
    c = c if abs(c) > tiny else tiny
    h *= d * c
    aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
    d = 1.0 + aa * d
    d = 1.0 / (d if abs(d) > tiny else tiny)
    c = 1.0 + aa / c
    c = c if abs(c) > tiny else tiny
    delta = d * c
    h *= delta
    if abs(delta - 1.0) < eps:
      return h
  raise ArithmeticError(f"incomplete beta did not converge for a={a}, b={b}, x={x}")


def betainc(a: float, b: float, x: float) -> float:
  """Regularized incomplete beta I_x(a, b) for a, b > 0 and x in [0, 1]."""
  if not 0.0 <= x <= 1.0:
    raise ValueError(f"betainc needs x in [0, 1], got {x}")
  if x in (0.0, 1.0):
    return x
  log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
               + a * math.log(x) + b * math.log1p(-x))
  if x < (a + 1.0) / (a + b + 2.0):  # the fraction converges fast on this side
    return math.exp(log_front) * _betacf(a, b, x) / a
  return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
  """P(T <= t) for Student's t with df degrees of freedom."""
  if df <= 0:
    raise ValueError(f"t_cdf needs df > 0, got {df}")
  if math.isnan(t):
    return math.nan
  if math.isinf(t):
    return 1.0 if t > 0 else 0.0
  tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))  # P(T > |t|)
  return 1.0 - tail if t > 0 else tail


def t_ppf(q: float, df: float) -> float:
  """The q-quantile of Student's t (inverse of t_cdf), by bisection to float64 precision."""
  if not 0.0 < q < 1.0:
    raise ValueError(f"t_ppf needs q in (0, 1), got {q}")
  if q == 0.5:
    return 0.0
  if q < 0.5:
    return -t_ppf(1.0 - q, df)
  lo, hi = 0.0, 1.0
  while t_cdf(hi, df) < q:
    lo, hi = hi, hi * 2.0
  for _ in range(200):
    mid = 0.5 * (lo + hi)
    if mid in (lo, hi):
      break
    lo, hi = (mid, hi) if t_cdf(mid, df) < q else (lo, mid)
  return 0.5 * (lo + hi)


@dataclasses.dataclass(frozen=True)
class MeanCI:
  """A sample mean with its two-sided t confidence interval.

  Attributes:
    mean: sample mean.
    low, high: interval bounds (NaN when n < 2).
    n: sample size.
    sd: sample standard deviation (ddof=1; NaN when n < 2).
    level: confidence level of [low, high].
  """
  mean: float
  low: float
  high: float
  n: int
  sd: float
  level: float

  @property
  def half_width(self) -> float:
    return (self.high - self.low) / 2.0

  def excludes(self, value: float = 0.0) -> bool:
    return not (self.low <= value <= self.high)


def _sample(values) -> np.ndarray:
  x = np.asarray(values, np.float64).ravel()
  if x.size == 0:
    raise ValueError("need at least one value")
  return x


def mean_ci(values, level: float = 0.95) -> MeanCI:
  """Mean and two-sided Student-t confidence interval at `level` (e.g. 0.95)."""
  if not 0.0 < level < 1.0:
    raise ValueError(f"level must be in (0, 1), got {level}")
  x = _sample(values)
  n, mean = x.size, float(np.mean(x))
  if n < 2:
    return MeanCI(mean, math.nan, math.nan, n, math.nan, level)
  sd = float(np.std(x, ddof=1))
  half = t_ppf(0.5 + level / 2.0, n - 1) * sd / math.sqrt(n)
  return MeanCI(mean, mean - half, mean + half, n, sd, level)


def paired_diff(a, b, level: float = 0.95) -> MeanCI:
  """Mean of a - b over paired samples (same seed), with its t interval."""
  a, b = _sample(a), _sample(b)
  if a.shape != b.shape:
    raise ValueError(f"paired samples need equal sizes, got {a.size} and {b.size}")
  return mean_ci(a - b, level)


@dataclasses.dataclass(frozen=True)
class Tost:
  """Two one-sided t tests of |mean difference| < margin.

  Attributes:
    p_value: max of the two one-sided p-values; equivalence is shown when p_value < alpha.
    p_lower: p of H0 "diff <= -margin".
    p_upper: p of H0 "diff >= +margin".
    equivalent: p_value < alpha, i.e. the (1 - 2 alpha) interval lies inside +-margin.
    ci: the (1 - 2 alpha) interval of the difference (90% for alpha = 0.05).
    margin, alpha: the test's settings.
  """
  p_value: float
  p_lower: float
  p_upper: float
  equivalent: bool
  ci: MeanCI
  margin: float
  alpha: float


def tost(diffs, margin: float, alpha: float = 0.05) -> Tost:
  """TOST equivalence test of the mean of `diffs` against the interval (-margin, +margin)."""
  if not margin > 0:
    raise ValueError(f"margin must be > 0, got {margin}")
  if not 0.0 < alpha < 0.5:
    raise ValueError(f"alpha must be in (0, 0.5), got {alpha}")
  ci = mean_ci(diffs, 1.0 - 2.0 * alpha)
  n, mean = ci.n, ci.mean
  if n < 2:
    p_lo = p_hi = math.nan
  elif ci.sd == 0.0:  # identical differences: the test degenerates to a comparison
    p_lo = 0.0 if mean > -margin else 1.0
    p_hi = 0.0 if mean < margin else 1.0
  else:
    se = ci.sd / math.sqrt(n)
    p_lo = 1.0 - t_cdf((mean + margin) / se, n - 1)  # H0: mean <= -margin
    p_hi = t_cdf((mean - margin) / se, n - 1)        # H0: mean >= +margin
  p = max(p_lo, p_hi) if n >= 2 else math.nan
  return Tost(p, p_lo, p_hi, bool(p < alpha), ci, margin, alpha)


def verdict(test: Tost) -> str:
  """"equivalent", "not equivalent" (the interval lies outside the margin) or "inconclusive"."""
  if test.ci.n < 2:
    return "inconclusive (n < 2)"
  if test.equivalent:
    return "equivalent"
  if test.ci.low >= test.margin or test.ci.high <= -test.margin:
    return "not equivalent"
  return "inconclusive"



def tost_power(sd: float, n: int, margin: float, alpha: float = 0.05) -> float:
  """Power of the paired TOST with n pairs to show equivalence when the true mean difference
  is 0 and the differences' standard deviation is sd.

  Exact up to quadrature: the mean is N(0, sd^2 / n), independent of the sample sd s with
  (n-1) s^2 / sd^2 ~ chi^2(n-1), and TOST shows equivalence iff |mean| < margin - t s / sqrt(n)
  (t = t_{1-alpha, n-1}). With the observed sd it says how likely "equivalent" was for a
  recipe exactly as good as the reference: at low power a verdict either way is luck.
  """
  if n < 2 or not math.isfinite(sd) or sd < 0:
    return math.nan
  if sd == 0.0:
    return 1.0
  k = n - 1
  t = t_ppf(1.0 - alpha, k)
  # u = sqrt(chi^2 value) = sqrt(k) s / sd, integrated up to where margin - t s / sqrt(n) = 0.
  u = np.linspace(0.0, margin * math.sqrt(n * k) / (t * sd), 4001)
  s = u * sd / math.sqrt(k)
  z = (margin - t * s / math.sqrt(n)) * math.sqrt(n) / sd
  inside = np.array([math.erf(v / math.sqrt(2.0)) for v in z])   # 2 Phi(z) - 1
  with np.errstate(divide="ignore"):
    log_u = np.where(u > 0, np.log(np.maximum(u, 1e-300)), -np.inf if k > 1 else 0.0)
  density = np.exp(math.log(2.0) + (k - 1) * log_u - u * u / 2 - (k / 2) * math.log(2.0)
                   - math.lgamma(k / 2))
  return float(np.clip(np.trapezoid(inside * density, u), 0.0, 1.0))
