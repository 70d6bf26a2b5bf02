"""Retrieval's settings, chosen on the selection split (docs/quality.md), read by the host and device scorers."""

DENSE_WEIGHT = 0.6
SHORTLIST = 12    # docs/quality.md: chosen on the selection split
MAX_PARTS = 8    # the intent and at most 7 of its clauses
VOTE_WEIGHT = 1.0         # what the nearest requests' whole vote adds to a tool's fused score
NEIGHBOURS = 10           # the requests nearest the intent that vote
VOTE_TEMPERATURE = 0.05   # their shares: a softmax of their cosines at this temperature
