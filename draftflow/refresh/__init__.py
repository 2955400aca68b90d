"""Keeping a drafter fresh: new traffic in batches behind a watermark (`batches`), and what each refresh decided
(`history`). The flow that runs a refresh is `flows/refresh.py`."""
