"""Tokenise text or JSONL files into token shards + manifest.json for data.source (see docs/data.md).

python scripts/prepare_data.py --input FILES_OR_GLOBS --tokenizer byte|PATH/tokenizer.json --out DIR [--shards N]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from jaxseek.input.prepare import main  # noqa: E402

if __name__ == "__main__":  # worker processes re-import this file
  sys.exit(main())
