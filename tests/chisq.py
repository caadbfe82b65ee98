"""Pearson's chi-square test of counts against an exact law, shared by the statistical tests
(test_exact_fake.py on the fake backend, test_real_models.py on llama.cpp's rows)."""
import numpy as np


def chi2_pvalue(counts, probs, min_expected: float = 5.0) -> float:
    """The p-value of `counts` (any shape) drawn from the law `probs` (the same shape). Outcomes
    expected fewer than `min_expected` times are pooled into one category (and that into the
    smallest kept one when it is still too small), so the chi-square approximation holds."""
    counts, probs = np.ravel(counts).astype(np.float64), np.ravel(probs).astype(np.float64)
    if counts[probs == 0].sum() > 0:  # an outcome drawn where the exact law has no mass
        return 0.0
    exp = probs / probs.sum() * counts.sum()  # float32 rows: renormalise the last bits away
    big = exp >= min_expected
    obs_c = np.append(counts[big], counts[~big].sum())
    exp_c = np.append(exp[big], exp[~big].sum())
    if exp_c[-1] < min_expected:  # pool the remainder into the smallest kept category
        obs_c, exp_c = obs_c[:-1], exp_c[:-1]
        j = int(np.argmin(exp_c))
        obs_c[j] += counts[~big].sum()
        exp_c[j] += exp[~big].sum()
    stat = float(((obs_c - exp_c) ** 2 / exp_c).sum())
    from scipy import stats as sps  # here: scipy.stats costs every worker ~1 s at collection
    return float(sps.chi2.sf(stat, len(obs_c) - 1))
