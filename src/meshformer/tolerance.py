"""The tolerance `--verify` applies (checkpoint/parity.py), here so the CLI's help can quote it without importing
torch (the `meshformer.checkpoint` package imports torch).

1e-4 on fp32 logits, or RELATIVE_TOLERANCE of the largest logit when that is larger: in a deep model fp32
rounding alone moves large logits by more than 1e-4 (parity.py has the measurements).
"""

TOLERANCE = 1e-4
RELATIVE_TOLERANCE = 1e-5
TOLERANCE_TEXT = f"{TOLERANCE:g}, or {RELATIVE_TOLERANCE:g} x the largest |logit| when that is larger"
