"""MkDocs hook: benchmarks/README.md and the plots under benchmarks/results/ join the site as they lie.

The benchmarks' page is kept next to the scripts that make its figures; copying it into docs/ would give
two copies to keep equal. Its links to results/*.png resolve on the site as they do in the repository.
"""

from __future__ import annotations

import pathlib

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

REPO = pathlib.Path(__file__).resolve().parents[2]


def on_files(files: Files, config: MkDocsConfig) -> Files:
    paths = ["benchmarks/README.md"]
    paths += sorted(p.relative_to(REPO).as_posix() for p in (REPO / "benchmarks" / "results").glob("*.png"))
    for path in paths:
        files.append(File(path, str(REPO), config.site_dir, config.use_directory_urls))
    return files
