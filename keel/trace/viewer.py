"""Render a persistent-batch trace (JSON Lines, keel/trace/recorder.py) as one HTML page.

The page is self-contained: the template (viewer.html, next to this file) carries its CSS and
JS inline, and the trace goes inline too, as JSON in a <script type="application/json">
element. Nothing is fetched, so the file opens from disk (file://) with no network.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from keel.trace.recorder import load_trace

logger = logging.getLogger(__name__)

TEMPLATE_PATH = Path(__file__).with_name("viewer.html")
# Where the template wants the trace JSON: inside <script type="application/json">.
PLACEHOLDER = "/*__KEEL_TRACE_DATA__*/"


def embed_json(data: Any) -> str:
    """JSON that is safe inside a <script> element: "</" and "<!--" (which can only occur in
    strings) are written so that the HTML parser never sees them."""
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return text.replace("</", "<\\/").replace("<!--", "\\u003c!--")


def render_html(trace_path: Path, out_path: Path | None = None) -> Path:
    """Write the trace viewer for trace_path to out_path (default: the trace with suffix .html)
    and return out_path."""
    trace_path = Path(trace_path)
    out_path = trace_path.with_suffix(".html") if out_path is None else Path(out_path)
    data = load_trace(trace_path)
    try:
        payload = embed_json(data)
    except ValueError as e:  # NaN or infinity: JSON.parse in the page would reject them
        raise ValueError(f"{trace_path}: cannot embed the trace as JSON ({e})") from e
    template = TEMPLATE_PATH.read_text(encoding="utf-8")
    if template.count(PLACEHOLDER) != 1:
        raise RuntimeError(f"{TEMPLATE_PATH}: expected the placeholder {PLACEHOLDER} once")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(template.replace(PLACEHOLDER, payload), encoding="utf-8")
    logger.info("trace viewer for %d steps written to %s", len(data["steps"]), out_path)
    return out_path
