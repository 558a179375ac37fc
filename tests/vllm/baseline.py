"""Runs every phase of the engine tests on vLLM *without* a connector, in a process of its own,
and prints the generated tokens as JSON (the reference the connector's outputs must equal).

    python -m tests.vllm.baseline MODEL_DIR OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.vllm.conftest import PHASES, Engine


def main(model_dir: str, out_path: str) -> None:
    engine = Engine(Path(model_dir), None)
    try:
        out = {
            name: [[list(tokens) for tokens, _ in engine.generate(call)] for call in calls]
            for name, calls in PHASES.items()
        }
    finally:
        engine.close()
    Path(out_path).write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
