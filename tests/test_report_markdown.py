"""The result artifact's markdown: no image the Prefect UI cannot load."""

from __future__ import annotations

import re

from draftflow.report import plots_markdown, without_relative_images


def test_relative_images_are_named_and_the_plots_embedded(tmp_path):
    stage = tmp_path / "evaluate" / "fp"
    (stage / "plots").mkdir(parents=True)
    png = b"\x89PNG\r\n\x1a\n" + b"\0" * 32
    (stage / "plots" / "tau.png").write_bytes(png)
    report = "# report\n\n![tau](plots/tau.png)\n![remote](https://example.org/a.png)\n"
    md = without_relative_images(report) + plots_markdown([str(stage)])
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
    assert links and all(link.startswith(("data:image/png;base64,", "https://")) for link in links), links
    assert "*(plot `plots/tau.png`: embedded below)*" in md and "### evaluate: plots/tau.png" in md
