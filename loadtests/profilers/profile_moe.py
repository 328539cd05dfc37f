"""torch.profiler breakdown of decode steps of a mixture-of-experts model: the MoE layer's share
of the step, and inside it the router, the experts' matmuls, the grouping and the shared expert;
attention beside it (loadtests/lib/moe_profile.py, which `bench_engine.py --model <an MoE shape>`
uses too). Run alone:

    .venv/bin/python loadtests/profilers/profile_moe.py --shape tiny-moe-shape --batch 4 --context 32
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadtests.lib.checkpoints import MOE_SHAPES, write_moe_checkpoint  # noqa: E402
from loadtests.lib.moe_profile import print_moe_profile, profile_moe_decode  # noqa: E402
from model import LLM  # noqa: E402
from model.config import EngineConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="tiny-moe-shape", choices=list(MOE_SHAPES))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="qkv-moe-profile-")
    write_moe_checkpoint(Path(tmp), args.shape)
    llm = LLM(tmp, device=args.device, dtype=args.dtype, engine_config=EngineConfig(kv_cache_memory_bytes=1 << 30))
    print_moe_profile(profile_moe_decode(llm.engine, args.batch, args.context))


if __name__ == "__main__":
    main()
