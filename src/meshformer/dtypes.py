"""Config dtype names -> torch dtypes, in a module every layer may import (config names, models and
parallel code use them; none of those should import another only for this map)."""

from __future__ import annotations

import torch

DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
