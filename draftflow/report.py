"""What a run shows its reader besides the tables: the stages' PNG plots as one markdown text, and links.

The Prefect UI cannot read the run folder, so small plots are inlined as base64 data URIs and
bigger ones are linked. What it does not know: Prefect (the pipeline flow publishes the text as
an artifact). Trade-off: inlining makes the artifact self-contained at the cost of its size,
bounded by `PLOT_MAX_BYTES` per plot.
"""

from __future__ import annotations

import base64
from pathlib import Path

PLOT_MAX_BYTES = 512 << 10  # bigger plots are linked, not inlined


def location_uri(location: str) -> str:
    """A link the UI can open: URLs as they are, local paths as file:// URIs."""
    return location if "://" in location else Path(location).resolve().as_uri()


def without_relative_images(markdown: str) -> str:
    """`markdown` (a report.md) with each relative image (`![t](plots/x.png)`, which the UI cannot load) named
    in words instead: `plots_markdown` embeds the same plots after it."""
    import re

    return re.sub(r"!\[([^\]]*)\]\((?![a-z]+:)([^)]+)\)", r"*(plot `\2`: embedded below)*", markdown)


def plots_markdown(stage_paths: list[str]) -> str:
    """The stages' PNG plots inlined as data URIs (the UI cannot read the run folder), else linked.

    Args:
        stage_paths: stage folders (local paths or fsspec URLs), e.g. `<root>/train/<fp>`.
    """
    import fsspec

    parts = []
    for path in stage_paths:
        fs, root = fsspec.core.url_to_fs(path)
        for png in sorted(fs.glob(f"{root}/**/*.png")):
            title = png[len(root):].lstrip("/")
            if "work" in Path(title).parts:  # train's resume folder keeps its own copies
                continue
            stage = Path(root).parent.name
            if fs.size(png) > PLOT_MAX_BYTES:
                where = png if "://" not in path else fs.unstrip_protocol(png)
                parts.append(f"- {stage} `{title}`: {location_uri(where)}")
                continue
            data = base64.b64encode(fs.cat_file(png)).decode()
            parts.append(f"### {stage}: {title}\n\n![{title}](data:image/png;base64,{data})\n")
    return "\n".join(parts)
