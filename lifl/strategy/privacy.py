"""The privacy budget dp_fedavg spends: Google's dp-accounting RDP accountant.

Each round is a Poisson-sampled Gaussian mechanism (sampling rate q = goal / population, noise
multiplier z), composed over the rounds aggregated; ε is reported for the spec's δ, over the
accountant's default RDP orders (the fractional ones below 2 matter for small z).
"""

from __future__ import annotations

import logging
from functools import cache

from lifl.strategy.spec import StrategySpec


class _UnconvergedOrders(logging.Filter):
    """The accountant logs every fractional order whose series does not converge for small q, each
    round; it leaves those orders out of the minimum, which is all that matters here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to converge" not in record.getMessage()


@cache
def _accountant() -> type:
    """The accountant's class, imported on first use: the library takes most of a second to
    import, which every aggregator and gateway would pay at start for a budget few jobs spend."""
    from dp_accounting.rdp import rdp_privacy_accountant

    logging.getLogger("absl").addFilter(_UnconvergedOrders())
    return rdp_privacy_accountant.RdpAccountant


def privacy(spec: StrategySpec, rounds: int) -> dict[str, float]:
    """{"epsilon": ..., "delta": ...} spent after ``rounds`` rounds of a dp_fedavg spec."""
    if not spec.spends_privacy:
        raise ValueError(f"strategy {spec.name} spends no privacy budget")
    if rounds < 0:
        raise ValueError(f"rounds must be at least 0, got {rounds}")
    delta = float(spec.param("delta"))
    if rounds == 0:
        return {"epsilon": 0.0, "delta": delta}
    import dp_accounting

    accountant = _accountant()()
    event = dp_accounting.PoissonSampledDpEvent(
        float(spec.param("sampling_rate")), dp_accounting.GaussianDpEvent(float(spec.param("noise_multiplier"))))
    accountant.compose(event, rounds)
    return {"epsilon": float(accountant.get_epsilon(delta)), "delta": delta}
