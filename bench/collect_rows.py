"""Gather the rows of every finished model under a paper_table folder into one JSON file.

For a benchmark split over machines: each part runs ``paper_table.py --only ...``, this gathers
what finished (even if the part was cut short), and ``paper_table.py --merge`` builds the table.

    python bench/collect_rows.py RESULTS_FOLDER OUT.json
"""

import json
import sys
from pathlib import Path

folder, out = Path(sys.argv[1]), Path(sys.argv[2])
rows = [
    row for f in sorted(folder.glob("*/bench.json")) for row in json.loads(f.read_text())["rows"]
]
out.write_text(json.dumps({"rows": rows}, indent=1))
print(f"{len(rows)} rows from {folder} -> {out}")
