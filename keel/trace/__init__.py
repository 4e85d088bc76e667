"""Tracing the persistent batch: the recorder (recorder.py), the Chrome trace-event export
(chrome.py) and the self-contained HTML viewer (viewer.py). See docs/trace.md."""
