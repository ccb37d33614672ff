"""verl's ``loss_agg_mode`` names and the rlkit aggregation each corresponds to (shared by the tests)."""

from rlkit.components.aggregation import (
    SeqMeanTokenMean,
    SeqMeanTokenSum,
    SeqMeanTokenSumNorm,
    TokenMean,
    TokenSum,
)

AGGREGATIONS = {
    "token-mean": TokenMean(),
    "token-sum": TokenSum(),
    "seq-mean-token-sum": SeqMeanTokenSum(),
    "seq-mean-token-mean": SeqMeanTokenMean(),
    "seq-mean-token-sum-norm": SeqMeanTokenSumNorm(),
}
