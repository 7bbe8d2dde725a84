"""What llama-perplexity --kl-divergence prints, formatted as it prints it: a line per chunk,
then (from 100 scored tokens on) the perplexity, KL-divergence and token-probability
statistics."""
from __future__ import annotations

from llamapy.kl_divergence import KLDivergenceResult, median, percentile

TABLE_HEADER = ("chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              "
                "Δp RMS            Same top p")
KLD_PERCENTILES = ((0.999, "99.9%"), (0.990, "99.0%"), (0.950, "95.0%"), (0.900, "90.0%"))
KLD_LOW_PERCENTILES = ((0.100, "10.0%"), (0.050, " 5.0%"), (0.010, " 1.0%"), (0.001, " 0.1%"))
P_DIFF_PERCENTILES = (*KLD_PERCENTILES, (0.750, "75.0%"))
P_DIFF_LOW_PERCENTILES = ((0.250, "25.0%"), *KLD_LOW_PERCENTILES)


def chunk_line(i: int, r: KLDivergenceResult) -> str:
    """The running values after chunk i."""
    rms, rms_err = r.rms_p_diff()
    top, top_err = r.same_top_fraction()
    return ("%4d    %9.4f ± %9.4f    %10.5f ± %10.5f    %10.5f ± %10.5f    %6.3f ± %6.3f %%    %6.3f ± %6.3f %%"
            % (i, *r.ppl(), *r.log_ppl_ratio(), *r.kl_divergence(), 100 * rms, 100 * rms_err, 100 * top,
               100 * top_err))


def statistics(r: KLDivergenceResult) -> list[str]:
    """The closing statistics (none below 100 scored tokens, as llama-perplexity)."""
    if r.count < 100:
        return []
    kld, p_diff = r.sorted_kld(), r.sorted_p_diff()
    lines = ["====== Perplexity statistics ======",
             "Mean PPL(Q)                   : %10.6f ± %10.6f" % r.ppl(),
             "Mean PPL(base)                : %10.6f ± %10.6f" % r.ppl_base(),
             "Cor(ln(PPL(Q)), ln(PPL(base))): %6.2f%%" % (100 * r.log_ppl_correlation()),
             "Mean ln(PPL(Q)/PPL(base))     : %10.6f ± %10.6f" % r.log_ppl_ratio(),
             "Mean PPL(Q)/PPL(base)         : %10.6f ± %10.6f" % r.ppl_ratio(),
             "Mean PPL(Q)-PPL(base)         : %10.6f ± %10.6f" % r.ppl_difference(),
             "",
             "====== KL divergence statistics ======",
             "Mean    KLD: %10.6f ± %10.6f" % r.kl_divergence(),
             "Maximum KLD: %10.6f" % kld[-1],
             *("%s   KLD: %10.6f" % (name, percentile(kld, f)) for f, name in KLD_PERCENTILES),
             "Median  KLD: %10.6f" % median(kld),
             *("%s   KLD: %10.6f" % (name, percentile(kld, f)) for f, name in KLD_LOW_PERCENTILES),
             "Minimum KLD: %10.6f" % kld[0],
             "",
             "====== Token probability statistics ======"]
    mean, err = r.mean_p_diff()
    rms, rms_err = r.rms_p_diff()
    top, top_err = r.same_top_fraction()
    return lines + ["Mean    Δp: %6.3f ± %5.3f %%" % (100 * mean, 100 * err),
                    "Maximum Δp: %6.3f%%" % (100 * p_diff[-1]),
                    *("%s   Δp: %6.3f%%" % (name, 100 * percentile(p_diff, f)) for f, name in P_DIFF_PERCENTILES),
                    "Median  Δp: %6.3f%%" % (100 * median(p_diff)),
                    *("%s   Δp: %6.3f%%" % (name, 100 * percentile(p_diff, f)) for f, name in P_DIFF_LOW_PERCENTILES),
                    "Minimum Δp: %6.3f%%" % (100 * p_diff[0]),
                    "RMS Δp    : %6.3f ± %5.3f %%" % (100 * rms, 100 * rms_err),
                    "Same top p: %6.3f ± %5.3f %%" % (100 * top, 100 * top_err)]
