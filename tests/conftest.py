import os
import sys
from pathlib import Path

# The CPU suite runs on the CPU even where a GPU is present, unless `-m gpu` asks for the device.
if not any(a == "gpu" or a.endswith(" gpu") for a in sys.argv):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = Path(__file__).resolve().parents[1]
CAPTURES = ROOT / "captures"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
