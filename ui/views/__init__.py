"""The dashboard's pages, one Streamlit script each, registered by ui/app.py in this order.

The folder is not called ``pages/``: Streamlit routes a ``pages/`` folder next to the entry script
by itself (its older multipage mode), which runs a page without ui/app.py's connection setup.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

PAGES_DIR: Final = Path(__file__).resolve().parent

# (file, title, icon, url path); the first is the default page
PAGES: Final = (
    ("overview.py", "Overview", ":material/monitoring:", "overview"),
    ("predictions.py", "Predictions", ":material/psychology:", "predictions"),
    ("cache.py", "Cache effectiveness", ":material/speed:", "cache"),
    ("sizing.py", "Host-tier sizing", ":material/storage:", "sizing"),
    ("decisions.py", "Decisions", ":material/list_alt:", "decisions"),
    ("tuning.py", "Tuning", ":material/tune:", "tuning"),
    ("sql.py", "SQL", ":material/database:", "sql"),
)
