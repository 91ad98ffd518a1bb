"""The tolerance `--verify` applies (interop/parity.py), here so the CLI's help can quote it without importing
torch (the `meshformer.interop` package imports torch).

1e-4 on fp32 logits, or RELATIVE_TOLERANCE of the largest logit when that is larger: in a deep model fp32
rounding alone moves large logits by more than 1e-4 (parity.py has the measurements). Where even that is exceeded,
transformers computes the same tokens a second way (its other attention implementation, eager <-> sdpa), and
REFERENCE_NOISE_FACTOR times how far its own two results differ is the tolerance when larger: a conversion is held
to what transformers itself reproduces (parity.py: why the largest logit alone is the wrong scale).
"""

TOLERANCE = 1e-4
RELATIVE_TOLERANCE = 1e-5
REFERENCE_NOISE_FACTOR = 4
TOLERANCE_TEXT = (
    f"{TOLERANCE:g}, or {RELATIVE_TOLERANCE:g} x the largest |logit| when that is larger, or "
    f"{REFERENCE_NOISE_FACTOR:g} x how far transformers' own eager and sdpa attention differ on the same tokens "
    f"when that is larger still"
)
